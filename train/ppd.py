"""jaxspec-train ppd: early-prediction heads for PPD, one per chosen layer, on a frozen model.

Each head is h + SiLU(h W + b) (W, b zero-initialised: the untrained early exit) followed
by the model's own final norm and lm_head, trained so that its distribution at layer d̄
matches the model's final one (KL self-distillation, our adaptation of the paper's
Table 4 recipe to a frozen shared lm_head) on the model's own greedy answers to ShareGPT
train-split prompts. Evaluation: p_correct (the final greedy token among the early
top-k) per layer, untrained and trained, on the test split. The drafter's default layer
maximises the expected saving (d - d̄) p_correct(k=3) per token (Theorem 4.1).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.cli import positive_int
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import causal_mask
from jaxspec.llama import embed, lm_logits, run_layers
from jaxspec.ppd import PpdSettings, early_logits, head_name

from . import skeleton
from .args import int_list, parse, trainer_parser
from .checkpoints import command_flags
from .optim import apply_grads
from .skeleton import Result, Trainer

KS = (1, 3, 5)


def parse_args(argv):
    p = trainer_parser("ppd", __doc__, train_seqs=800, steps=150, save_every=25)
    p.add_argument(
        "--layers",
        type=int_list,
        default="10,15,20,25,28",
        help="layers with a head, at least one of them at or above half the model's depth",
    )
    p.add_argument("--rows", type=positive_int, default=64, help="answer positions per sequence")
    return parse(p, argv)


def drafting_layers(layers, n_layers: int) -> list[int]:
    """The layers PPD can draft from (d_bar): from half the depth to below the top."""
    return [layer for layer in layers if n_layers <= 2 * layer < 2 * n_layers]


def head_layers(text: str, n_layers: int) -> tuple[int, ...]:
    """--layers, inside the model, at least one of them a layer PPD can draft from."""
    layers = tuple(int(x) for x in text.split(","))
    if max(layers) > n_layers:
        raise JaxspecError(f"--layers {text}: this model has layers 1..{n_layers}")
    if not drafting_layers(layers, n_layers):
        raise JaxspecError(
            f"--layers {text}: PPD drafts from a layer at or above half the depth and below "
            f"the top; add one of {(n_layers + 1) // 2}..{n_layers - 1}"
        )
    return layers


@partial(jax.jit, static_argnames=("cfg", "layers"))
def layer_states(params, tokens, rows, *, cfg, layers):
    """tokens [B,S], rows [B,R] -> {layer: states [B,R,D]} and the final logits [B,R,V]."""
    B, S = tokens.shape
    collect = tuple(layers) + (cfg.n_layers,)
    _, _, states = run_layers(params, cfg, embed(params, tokens), jnp.arange(S)[None], None,
                              causal_mask(B, S), collect=collect)  # fmt: skip
    at = {i: jnp.take_along_axis(states[i], rows[..., None], 1) for i in collect}
    return {i: at[i] for i in layers}, lm_logits(params, cfg, at[cfg.n_layers])


@partial(jax.jit, static_argnames=("cfg", "optimizer"), donate_argnames=("state",))
def train_step(state, params, states, final_logits, valid, *, cfg, optimizer):
    teacher = jax.nn.softmax(final_logits, -1)

    def loss_fn(heads):
        losses = {}
        for layer, h in states.items():
            ce = optax.softmax_cross_entropy(early_logits(params, cfg, heads[head_name(layer)], h),
                                             teacher)  # fmt: skip
            losses[layer] = (ce * valid).sum() / valid.sum()
        return sum(losses.values()), losses

    (_, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    return apply_grads(state, grads, optimizer), losses


@partial(jax.jit, static_argnames=("cfg",))
def match_hits(params, heads, states, targets, *, cfg):
    """targets [B,R] (the tokens that came next) -> {layer: [2,B,R,len(KS)] bool}: target
    among the untrained (0) / trained (1) early top-k, for k in KS."""
    out = {}
    for layer, h in states.items():
        hits = []
        for head in (None, heads[head_name(layer)]):
            top = jax.lax.top_k(early_logits(params, cfg, head, h), max(KS))[1]
            hit = jnp.cumsum(top == targets[..., None], -1) > 0  # [B,R,5]
            hits.append(jnp.stack([hit[..., k - 1] for k in KS], -1))
        out[layer] = jnp.stack(hits)
    return out


def answer_rows(data, seqs, R, rng=None):
    """-> rows [B,R] inside each answer (sampled, or the first R when rng is None), valid."""
    starts, lengths = data["starts"][seqs], data["lengths"][seqs]
    if rng is None:
        rows = starts[:, None] - 1 + np.arange(R)[None]
    else:
        rows = starts[:, None] - 1 + (rng.random((len(seqs), R)) * (lengths - starts)[:, None])
    rows = rows.astype(np.int32)
    valid = rows < (lengths - 1)[:, None]
    return np.minimum(rows, data["tokens"].shape[1] - 1), valid


def evaluate(model, heads, data, layers) -> dict:
    """p_correct at top-1/3/5 per layer, untrained and trained, on every answer row."""
    hits, total = {layer: np.zeros((2, len(KS))) for layer in layers}, 0
    width = data["tokens"].shape[1]
    for n in range(len(data["tokens"])):
        rows, valid = answer_rows(data, np.array([n]), width)
        states, final = layer_states(model.params, data["tokens"][n : n + 1], rows,
                                     cfg=model.cfg, layers=layers)  # fmt: skip
        got = match_hits(model.params, heads, states, jnp.argmax(final, -1), cfg=model.cfg)
        for layer in layers:
            hits[layer] += np.asarray(got[layer] & valid[None, :, :, None]).sum((1, 2))
        total += int(valid.sum())
    return {
        head_name(layer): {
            name: {f"top{k}": round(float(x), 4) for k, x in zip(KS, hits[layer][i] / total,
                                                                  strict=True)}
            for i, name in enumerate(("untrained", "trained"))
        }
        for layer in layers
    }  # fmt: skip


class Ppd(Trainer):
    method = "ppd"
    wrote = "wrote the heads to {out}"

    def __init__(self, args, model):
        super().__init__(args, model)
        if model.mesh is not None:
            raise JaxspecError(
                "jaxspec-train ppd measures its heads in PPD's pipeline, which places itself "
                "on devices: drop --mesh"
            )
        self.layers = head_layers(args.layers, model.cfg.n_layers)

    def prepare(self) -> None:
        self.train_data, self.test_data = self.answers()

    def fresh(self):
        """Zero heads: each starts as the plain early exit."""
        D = self.cfg.dim
        return {head_name(layer): {"w": jnp.zeros((D, D)), "b": jnp.zeros((D,))}
                for layer in self.layers}  # fmt: skip

    def step(self, state, step):
        args, data = self.args, self.train_data
        rng = np.random.default_rng([args.seed, step])
        seqs = rng.integers(0, len(data["tokens"]), args.batch)
        rows, valid = answer_rows(data, seqs, args.rows, rng)
        states, final = layer_states(self.model.params, data["tokens"][seqs], rows, cfg=self.cfg,
                                     layers=self.layers)  # fmt: skip
        return train_step(state, self.model.params, states, final, valid, cfg=self.cfg,
                          optimizer=self.optimizer)  # fmt: skip

    def shown(self, losses):
        return {"loss": " ".join(f"{float(v):.2f}" for v in losses.values())}

    def finish(self, state, losses) -> Result:
        """p_correct per layer, the default drafting layer; heads in float16 (their accepted
        tokens are not measured here)."""
        cfg = self.cfg
        record = self.record(lambda: {
            "final_loss": {str(k): round(float(v), 4) for k, v in losses.items()},
        })  # fmt: skip
        match = evaluate(self.model, state["params"], self.test_data, self.layers)
        default = max(
            drafting_layers(self.layers, cfg.n_layers),
            key=lambda layer: (cfg.n_layers - layer) * match[head_name(layer)]["trained"]["top3"],
        )
        settings = PpdSettings(layers=tuple(self.layers), default_layer=default)
        report = {"steps": int(state["step"]), **record, "default_layer": default,
                  "p_correct": match}  # fmt: skip
        params16 = jax.tree.map(lambda x: np.asarray(x, np.float16), {"heads": state["params"]})
        return Result(report, settings, params16, card(self.args, cfg, report))


def train(argv) -> dict:
    return skeleton.train(Ppd, parse_args(argv))


def card(args, cfg, report) -> str:
    rows = "\n".join(
        f"| {layer} | " + " | ".join(
            f"{m['untrained'][f'top{k}']:.3f} / {m['trained'][f'top{k}']:.3f}" for k in KS
        ) + " |"
        for layer, m in report["p_correct"].items()
    )  # fmt: skip
    return f"""# PPD early-prediction heads for {cfg.name}

- One head per layer ({args.layers} of {cfg.n_layers}): h + SiLU(h W + b), then the model's
  own final norm and lm_head (shared, frozen). Weights stored in float16.
- Data: the base model's own greedy answers to {args.train_seqs} ShareGPT train-split
  first turns; KL to the model's final distribution at {args.rows} answer positions per
  sequence.
- Training: {report["steps"]} steps of {args.batch} sequences, AdamW lr {args.lr} cosine;
  {report.get("train_minutes")} minutes on the machine that trained it; final loss per
  layer {report.get("final_loss")}.
- Default layer: {report["default_layer"]} (largest (d - d̄) p_correct(k=3)).
- Command: `jaxspec-train ppd {command_flags(args)}`

p_correct on the test split ({args.test_seqs} conversations; the final greedy token among
the early top-k), untrained / trained:

| layer | k=1 | k=3 | k=5 |
|---|---|---|---|
{rows}
"""


def main(argv=None) -> None:
    train(argv)
