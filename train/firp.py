"""jaxspec-train firp: FIRP's linear maps on a frozen base model (paper §3.3, §4.2.3).

1. Data: the base model's own greedy answers to ShareGPT train-split prompts (shared with
   Medusa, train/selfdata.py). The real tokens' pass (keys/values of layers >= t_1, states
   at each t_i, last states) is computed once and cached on disk.
2. Steps train in sequence: step i's map (identity-initialised) learns while maps 1..i-1,
   already trained, stay in place, so step i's pseudo state sees the earlier ones as at
   inference (`--training chained`, the default). `--training paper` is §3.3's: step i's
   pseudo state for position q+i sees the real states up to q+i-1 and no other pseudo
   state, so each map learns on its own. Anchors are sampled in the answers; the loss is
   KL(P_{q+i} || P~_q): the base model's distribution at position q+i against the pseudo
   state's (cross-entropy to the teacher's soft labels; the teacher's entropy is constant).
3. Orbax checkpoints every --save-every steps; a rerun resumes (stage and step).
4. Evaluation: per-step top-1..5 agreement with the base model's greedy tokens on the test
   split, pseudo states drafted as at inference (chained) for either training; trees
   searched from it; the drafter and its card are written to --out, then its
   accepted tokens per step are measured (train/acceptance.py).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxspec.cli import positive_int
from jaxspec.data.sources import split_tag
from jaxspec.drafters.firp import (
    FirpDrafter,
    FirpSettings,
    apply_map,
    pseudo_forward,
    real_context,
)
from jaxspec.errors import JaxspecError
from jaxspec.llama import lm_logits
from jaxspec.outputs import write_text
from jaxspec.tree import searched_trees

from . import skeleton
from .args import int_list, parse, trainer_parser
from .checkpoints import command_flags, load_json, resume, save
from .features import self_answers
from .selfdata import ANSWER_BATCH
from .skeleton import Result, Trainer


def default_layers(n_layers: int) -> tuple[int, ...]:
    """The paper's choice scaled to depth: 15/20/25 of 32 layers -> about L/2, 2L/3, 5L/6."""
    return tuple(sorted({max(1, round(n_layers * f)) for f in (0.5, 2 / 3, 5 / 6)}))


def parse_args(argv):
    p = trainer_parser(
        "firp", __doc__, steps=300, save_every=25, can_stop_early=False,
        steps_help="updates per FIRP step (a rerun with more continues the current FIRP step)",
    )  # fmt: skip
    p.add_argument(
        "--layers",
        type=int_list,
        help="comma-separated t_1<...<t_K (default: about L/2, 2L/3, 5L/6)",
    )
    p.add_argument(
        "--pass-layers",
        type=int_list,
        help="cache the real pass for these layers (a superset of --layers: ablations share it)",
    )
    p.add_argument("--anchors", type=positive_int, default=64, help="anchors sampled per sequence")
    p.add_argument(
        "--training",
        choices=("chained", "paper"),
        default="chained",
        help="chained: each pseudo state sees the anchor's context and the chain's earlier "
        "pseudo states, as when drafting; paper: the real states before its position (§3.3)",
    )
    p.add_argument(
        "--variant",
        choices=("firp", "unchained", "early-exit"),
        default="firp",
        help="ablations for the reproduction study write only their report.json",
    )
    return parse(p, argv)


def parse_layers(text: str | None, n_layers: int) -> tuple[int, ...]:
    """--layers as checked by `int_list`, or the default for the model's depth."""
    return tuple(int(x) for x in text.split(",")) if text else default_layers(n_layers)


class RealPassCache:
    """The real tokens' pass for every sequence, as float16 .npy memmaps in `folder`:
    keys/values [N,L-t_1,Kv,n,H] (layers t_1..L), states [N,K,n,D], last [N,n,D].
    Written batch by batch; `progress.json` counts the rows done (a rerun finishes the rest)."""

    def __init__(self, model, data: dict, layers, folder: Path, batch: int = 4):
        self.layers, self.first = layers, layers[0]
        self.data = data
        cfg = model.cfg
        N, n = data["tokens"].shape
        shapes = {
            "keys": (N, cfg.n_layers - self.first, cfg.n_kv_heads, n, cfg.head_dim),
            "values": (N, cfg.n_layers - self.first, cfg.n_kv_heads, n, cfg.head_dim),
            "states": (N, len(layers), n, cfg.dim),
            "last": (N, n, cfg.dim),
        }
        folder.mkdir(parents=True, exist_ok=True)
        progress = folder / "progress.json"
        done = load_json(progress)["rows"] if progress.is_file() else 0
        self.arrays = {
            name: open_array(folder / f"{name}.npy", shape, resume=bool(done))
            for name, shape in shapes.items()
        }
        run = jax.jit(partial(real_context, cfg=cfg, layers=layers))
        for start in tqdm(range(done, N, batch), desc=f"real pass {folder.name}", unit="batch"):
            rows = slice(start, min(start + batch, N))
            h, block, states = run(model.params, tokens=jnp.asarray(data["tokens"][rows]))
            self.arrays["keys"][rows] = np.stack(block.keys[self.first :], 1)
            self.arrays["values"][rows] = np.stack(block.values[self.first :], 1)
            self.arrays["states"][rows] = np.stack([states[t] for t in layers], 1)
            self.arrays["last"][rows] = np.asarray(h)
            for array in self.arrays.values():
                array.flush()
            write_text(progress, json.dumps({"rows": rows.stop}))

    def batch(self, rows: np.ndarray, layers) -> dict:
        """Rows as model inputs: keys/values tuples over all layers (None below the
        cached ones), states {t: [B,n,D]} for `layers` (a subset of the cached ones)."""
        if not set(layers) <= set(self.layers):
            raise JaxspecError(f"the cached pass holds layers {self.layers}, not all of {layers}")
        get = {name: jnp.asarray(a[rows], jnp.float32) for name, a in self.arrays.items()}
        keys, values = (
            (None,) * self.first + tuple(get[name][:, j] for j in range(get[name].shape[1]))
            for name in ("keys", "values")
        )
        states = {t: get["states"][:, self.layers.index(t)] for t in layers}
        return {"keys": keys, "values": values, "states": states, "last": get["last"]}


def open_array(path: Path, shape, resume: bool) -> np.ndarray:
    """A float16 .npy memmap of `shape`: a new one, or the one a run began (`resume`; a
    damaged one is a one-line error naming it)."""
    if not resume:
        return np.lib.format.open_memmap(path, "w+", np.float16, shape)
    try:
        return np.lib.format.open_memmap(path, "r+")
    except (ValueError, OSError) as e:
        raise JaxspecError(
            f"cache file {path} is damaged ({type(e).__name__}); delete its folder and rerun"
        ) from None


def valid_anchor_range(data: dict, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence, anchors in [start - 1, length - 1 - K]: inside the answer, with all K
    targets inside the sequence."""
    return data["starts"] - 1, data["lengths"] - 1 - K


def sample_anchors(rng, low, high, count) -> np.ndarray:
    """[len(low), count] anchors drawn uniformly from [low, high] per row."""
    span = np.maximum(high - low + 1, 1)
    return (low[:, None] + rng.integers(0, 1 << 30, (len(low), count)) % span[:, None]).astype(
        np.int32
    )


def pseudo_logits(base, cfg, maps, layers, batch, anchors, variant="firp", paper=False):
    """Batch of cached passes -> pseudo logits [B,A,K,V] for K = len(maps) steps.

    variant "firp"; "unchained": a step does not see its chain's earlier steps (Fig. 7);
    "early-exit": the mapped state goes straight to the lm_head, skipping the remaining
    layers (what FIRP's refinement is measured against, Fig. 3). paper: step i sees the
    real states before its position instead of the chain (--training paper)."""
    states = batch["states"]
    if variant == "early-exit":
        at = [
            apply_map(m, jnp.take_along_axis(states[t], anchors[:, :, None], 1))
            for m, t in zip(maps, layers, strict=False)
        ]
        return lm_logits(base, cfg, jnp.stack(at, 2))
    pseudo, _ = pseudo_forward(
        base, cfg, maps, layers, batch["keys"], batch["values"], states, anchors,
        variant != "unchained" and not paper, teacher_forced=paper,
    )  # fmt: skip
    return lm_logits(base, cfg, pseudo)


def teacher_logits(base, cfg, last, anchors, step):
    """The base model's logits at anchor + step: [B,A,V]."""
    h = jnp.take_along_axis(last, (anchors + step)[:, :, None], axis=1)
    return lm_logits(base, cfg, h)


@partial(jax.jit, static_argnames=("cfg", "layers", "optimizer", "variant", "paper"))
def train_step(state, frozen, base, batch, anchors, *, cfg, layers, optimizer, variant, paper):
    """One update of the newest map (the others frozen; with `paper` they do not reach its
    pseudo state) -> state, loss."""
    stage = len(frozen) + 1

    def loss_fn(current):
        maps = [*frozen, current]
        logits = pseudo_logits(base, cfg, maps, layers, batch, anchors, variant, paper)
        logits = logits[:, :, -1]
        teacher = jax.nn.softmax(teacher_logits(base, cfg, batch["last"], anchors, stage), -1)
        return optax.softmax_cross_entropy(logits, teacher).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state["current"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["current"])
    current = optax.apply_updates(state["current"], updates)
    state = {**state, "current": current, "opt_state": opt_state}
    return {**state, "step": state["step"] + 1, "stage_step": state["stage_step"] + 1}, loss


@partial(jax.jit, static_argnames=("cfg", "layers", "variant"))
def topk_hits(base, maps, batch, anchors, *, cfg, layers, variant="firp"):
    """-> [K,5] hits at top-1..5 per step against the base model's greedy tokens."""
    logits = pseudo_logits(base, cfg, maps, layers, batch, anchors, variant)
    ranks = jax.lax.top_k(logits, 5)[1]
    hits = []
    for i in range(len(maps)):
        target = jnp.argmax(teacher_logits(base, cfg, batch["last"], anchors, i + 1), -1)
        hits.append((jnp.cumsum(ranks[:, :, i] == target[..., None], -1) > 0).sum((0, 1)))
    return jnp.stack(hits)


def eval_anchors(cache: RealPassCache, n_steps: int, per_seq: int = 64, seed: int = 0):
    """Yields (rows, anchors [len(rows), per_seq]) over the test answers, 4 rows at a time,
    drawn with a fixed seed: every drafter evaluated on them sees the same anchors."""
    rng = np.random.default_rng(seed)
    low, high = valid_anchor_range(cache.data, n_steps)
    for start in range(0, len(low), 4):
        rows = np.arange(start, min(start + 4, len(low)))
        keep = rows[high[rows] >= low[rows]]
        if len(keep):
            yield keep, sample_anchors(rng, low[keep], high[keep], per_seq)


def evaluate(model, maps, layers, cache: RealPassCache, variant="firp"):
    """Top-1..5 accuracy [K,5] per step on the test anchors."""
    hits, count = np.zeros((len(layers), 5)), 0
    for rows, anchors in eval_anchors(cache, len(layers)):
        hits += np.asarray(
            topk_hits(model.params, maps, cache.batch(rows, layers), jnp.asarray(anchors),
                      cfg=model.cfg, layers=layers, variant=variant)
        )  # fmt: skip
        count += anchors.size
    return hits / count


def real_pass(
    model, shared: Path, work: Path, split: str, n: int, prompt_len: int, new_tokens: int, layers,
    answer_batch: int = ANSWER_BATCH,
):  # fmt: skip
    """The RealPassCache of the model's answers to n `split` prompts, in the FIRP work
    folder `work` (the answers themselves are cached in `shared`, the folder every trainer
    reads them from)."""
    answers = self_answers(model, shared, split, n, prompt_len, new_tokens, answer_batch)
    name = f"{split_tag(split)}-{n}-p{prompt_len}-n{new_tokens}-t{'-'.join(map(str, layers))}"
    return RealPassCache(model, answers, layers, work / f"pass-{name}")


class Firp(Trainer):
    method = "firp"

    def __init__(self, args, model):
        super().__init__(args, model)
        cfg = model.cfg
        self.layers = parse_layers(args.layers, cfg.n_layers)
        self.drafter = FirpDrafter(cfg, self.layers)  # validates the layers
        self.pass_layers = (
            parse_layers(args.pass_layers, cfg.n_layers) if args.pass_layers else self.layers
        )
        FirpDrafter(cfg, self.pass_layers)  # and these
        if not set(self.layers) <= set(self.pass_layers):
            raise JaxspecError(
                f"--pass-layers {self.pass_layers} must include --layers {self.layers}"
            )

    def prepare(self) -> None:
        """The data's real pass (cached) and the answers' anchor ranges."""
        self.train_pass, self.test_pass = (
            real_pass(self.model, self.shared, self.work, split, n, self.args.prompt_len,
                      self.args.new_tokens, self.pass_layers, self.args.answer_batch)
            for split, n in (("train", self.args.train_seqs), ("test", self.args.test_seqs))
        )  # fmt: skip
        self.low, self.high = valid_anchor_range(self.train_pass.data, self.drafter.n_steps)
        self.usable = np.flatnonzero(self.high >= self.low)

    def start(self):
        """Maps trained in stages: `stage` is the FIRP step being trained (0-based), its map
        `current` (maps[stage] stale), `stage_step` its updates so far, `step` all updates."""
        maps = self.drafter.init()["maps"]
        state = {
            "maps": maps,
            "current": maps[0],
            "opt_state": self.optimizer.init(maps[0]),
            "stage": jnp.int32(0),
            "stage_step": jnp.int32(0),
            "step": jnp.int32(0),
        }
        manager, state, resumed = resume(self.work, self.args, state)
        if resumed:
            print(
                f"resumed at FIRP step {int(state['stage']) + 1}, update {int(state['stage_step'])}"
            )
        return manager, self.replicated(state)

    def fit(self, manager, state):
        """--steps updates per FIRP step, one stage after the other -> (state, the final
        loss per FIRP step trained in this invocation)."""
        args, K, layers = self.args, self.drafter.n_steps, self.layers
        losses = {}
        done = int(state["stage"]) * args.steps + int(state["stage_step"])
        bar = tqdm(total=K * args.steps, initial=min(done, K * args.steps), desc="train firp")
        while True:
            stage = int(state["stage"])
            if int(state["stage_step"]) >= args.steps:
                if stage == K - 1:
                    break
                maps = state["maps"]
                state = {  # the map is final: the next FIRP step trains with it in place
                    **state,
                    "maps": [*maps[:stage], state["current"], *maps[stage + 1 :]],
                    "current": maps[stage + 1],
                    "opt_state": self.optimizer.init(maps[stage + 1]),
                    "stage": jnp.int32(stage + 1),
                    "stage_step": jnp.int32(0),
                }
                continue
            step = int(state["step"])
            rng = np.random.default_rng([args.seed, step])  # the step's own: resumes alike
            batch = min(args.batch, len(self.usable))
            rows = np.sort(rng.choice(self.usable, batch, replace=False))
            anchors = sample_anchors(rng, self.low[rows], self.high[rows], args.anchors)
            state, loss = train_step(
                state, state["maps"][:stage], self.model.params,
                self.train_pass.batch(rows, layers), jnp.asarray(anchors), cfg=self.cfg,
                layers=layers[: stage + 1], optimizer=self.optimizer, variant=args.variant,
                paper=args.training == "paper",
            )  # fmt: skip
            losses[stage + 1] = float(loss)
            bar.update()
            bar.set_postfix(firp_step=stage + 1, loss=f"{float(loss):.3f}")
            save(manager, step + 1, state, last=step + 1 == K * args.steps)
        bar.close()
        return state, losses

    def finish(self, state, losses) -> Result:
        """The report (also report.json, for every variant); only the "firp" variant writes
        and measures a drafter."""
        args, layers = self.args, self.layers
        maps = [*state["maps"][: len(layers) - 1], state["current"]]
        accuracy = evaluate(self.model, maps, layers, self.test_pass, variant=args.variant)
        report = {
            "layers": list(layers),
            "steps_per_firp_step": args.steps,
            "final_loss_per_step": {k: round(v, 4) for k, v in losses.items()},
            "test_topk_accuracy": [[round(float(x), 4) for x in row] for row in accuracy],
            "train_minutes": self.minutes(),
        }
        write_text(self.out / "report.json", json.dumps({**report, "variant": args.variant},
                                                        indent=2))  # fmt: skip
        settings = FirpSettings(layers=tuple(layers), trees=searched_trees(accuracy))
        data = {"test_topk_accuracy": np.asarray(report["test_topk_accuracy"], np.float64)}
        drafts = args.variant == "firp"
        return Result(report, settings, {"maps": maps}, card(args, self.cfg, report),
                      self.test_pass.data if drafts else None, data)  # fmt: skip

    def save(self, result: Result) -> None:
        if self.args.variant == "firp":  # the ablations write only their report.json
            super().save(result)


def train(argv) -> dict:
    return skeleton.train(Firp, parse_args(argv))


TRAINING = {
    "chained": "trained in sequence (each pseudo state sees the chain's earlier ones, as when "
    "drafting)",
    "paper": "each trained on its own, its pseudo state seeing the real states before its "
    "position (the paper's §3.3)",
}


def card(args, cfg, report) -> str:
    rows = "\n".join(
        f"| {k + 1} | {report['layers'][k]} | " + " | ".join(f"{x:.3f}" for x in acc) + " |"
        for k, acc in enumerate(report["test_topk_accuracy"])
    )
    return f"""# FIRP drafter for {cfg.name}

- Linear maps (D x D + bias) at layers {report["layers"]} of {cfg.n_layers}; pseudo states
  pass the remaining layers and the model's own lm_head.
- Data: the base model's own greedy answers to the first user turns of {args.train_seqs}
  ShareGPT train-split conversations; {args.anchors} anchors per sequence per step.
- Training: {args.steps} steps per FIRP step, {TRAINING[args.training]}, {args.batch} sequences per
  step, AdamW lr {args.lr} cosine, KL to the base model's distributions;
  {report["train_minutes"]} minutes end to end on the machine that trained it.
- Final training loss per FIRP step: {report["final_loss_per_step"]}
- Command: `jaxspec-train firp {command_flags(args)}`

Test-split agreement with the base model's greedy tokens ({args.test_seqs} ShareGPT test
conversations, the model's own answers), top-1..5:

| step | layer | top-1 | top-2 | top-3 | top-4 | top-5 |
|---|---|---|---|---|---|---|
{rows}
"""


def main(argv=None) -> None:
    train(argv)
