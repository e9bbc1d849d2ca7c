"""jaxspec-train sdsat: adaptive tokens and their adapter (SDSAT mode b) on a frozen model.

1. Data: the base model's own greedy answers to ShareGPT train-split first turns (shared
   with the other trainers, train/selfdata.py): greedy verification checks drafts against
   exactly these tokens.
2. Span masking (paper §2.2): in each sequence, `--spans` answer positions i are drawn
   uniformly; after each, adaptive tokens A_1..A_L sit at positions i+1..i+L and A_j learns
   the token at i+j+1. A span sees the ordinary tokens 0..i (the base model's keys and
   values, computed once per batch without gradients) and its own earlier adaptive tokens,
   exactly what drafting sees after `current` = token i. The paper's window length w ~
   U{1..L} keeps rows j < w; since a row never sees later rows, we compute all L rows and
   weight row j by P(w > j) = (L - j) / L, the paper's expected loss at no wasted compute.
3. Loss: the paper's 1/2 (f(Y_hat, Y) + w f(M_hat, Y_M) M_mask) with f = cross-entropy. In
   mode (b) ordinary positions never see adaptive tokens and keep the base weights, so
   f(Y_hat, Y) is a constant: only the adaptive term is trained (weight w = 1).
4. AdamW (beta2 0.95) with warm-up and cosine decay as the paper; resumable orbax
   checkpoints; evaluation on the test split: per-depth top-1 accuracy and the mean number
   of leading correct drafts (the greedy chain's accepted adaptive drafts) per span; the
   written drafter's tokens per loop (train/acceptance.py).
"""

from __future__ import annotations

import argparse
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.cli import nonnegative_int, positive_int, probability
from jaxspec.drafters.sdsat import LORA_TARGETS, SdsatDrafter, SdsatSettings
from jaxspec.errors import JaxspecError
from jaxspec.kv_cache import KVCache, causal_mask
from jaxspec.llama import embed, run_layers
from jaxspec.tree import DynamicTree, searched_trees, tree_preset

from . import skeleton
from .args import parse, trainer_parser
from .checkpoints import command_flags, started_from
from .optim import apply_grads, paper_schedule
from .skeleton import Result, Trainer

SEARCHED_SIZES = (4, 6, 8, 16)  # the trees searched for a trained adapter: searched-N


def tree_name(text: str) -> str:
    """A tree the adapter will ship (searched-N) or a preset (jaxspec.tree.tree_preset)."""
    if text in {f"searched-{n}" for n in SEARCHED_SIZES}:
        return text
    try:
        tree = tree_preset(text)
    except JaxspecError as e:
        searched = ", ".join(f"searched-{n}" for n in SEARCHED_SIZES)
        raise argparse.ArgumentTypeError(f"{e}, {searched}") from None
    if isinstance(tree, DynamicTree):
        raise argparse.ArgumentTypeError(
            f"{text}: sdsat drafts fixed trees; pick chain-N, comb-D-W or searched-N"
        )
    return text


def parse_args(argv):
    p = trainer_parser("sdsat", __doc__, train_seqs=800, steps=300, save_every=25, can_init=True)
    p.add_argument(
        "--mode",
        choices=("adapter", "full"),
        default="adapter",
        help="adapter: mode (b), lossless against the original model (shipped); full: mode "
        "(a), the paper's full fine-tuning, writes a whole checkpoint to --out (default: "
        "$JAXSPEC_HOME/models/<model>-sdsat-full)",
    )
    p.add_argument("--mask-rate", type=probability, default=0.1, help="full mode: span start rate")
    p.add_argument(
        "--loss",
        choices=("improved", "basic"),
        default="improved",
        help="full mode: improved, the paper's loss (Eq. 9: clean sequence + adaptive positions); "
        "basic, its Appendix A baseline (Eq. 8: cross-entropy over the whole mixed sequence)",
    )
    p.add_argument("--rank", type=nonnegative_int, default=16, help="LoRA rank of the adapter")
    p.add_argument("--ids", type=positive_int, default=1, help="distinct adaptive token ids")
    p.add_argument("--window", type=positive_int, default=8, help="max mask window L")
    p.add_argument("--spans", type=positive_int, default=24, help="spans per sequence")
    p.add_argument(
        "--cpu-tree", type=tree_name, default="chain-2", help="the tree generation uses on CPU"
    )
    return parse(p, argv)


def span_starts(starts, lengths, n_spans: int, rng) -> np.ndarray:
    """-> [B,n_spans] positions i, uniform over each answer (target i+2 inside it)."""
    low = np.maximum(starts - 1, 0)
    high = np.maximum(lengths - 2, low + 1)
    return (low[:, None] + rng.random((len(starts), n_spans)) * (high - low)[:, None]).astype(
        np.int32
    )


def span_layout(spans: jax.Array, L: int, S: int):
    """spans [B,n] -> rows of n spans x L adaptive tokens: positions [B,R] (R = n*L),
    depth j [R], context mask [B,R,S] (ordinary tokens 0..i), mask among rows [R,R] (the
    same span, earlier rows and itself).

    E.g. L = 2, spans [[1, 3]], S = 5:
        row  pos  j  context (slots 0..4)   rows
        0    2    0  1 1 0 0 0              1 0 0 0
        1    3    1  1 1 0 0 0              1 1 0 0
        2    4    0  1 1 1 1 0              0 0 1 0
        3    5    1  1 1 1 1 0              0 0 1 1
    """
    n = spans.shape[1]
    j = jnp.tile(jnp.arange(L), n)  # [R]
    start = jnp.repeat(spans, L, axis=1)  # [B,R]
    positions = start + 1 + j
    context = jnp.arange(S)[None, None, :] <= start[:, :, None]
    span = jnp.repeat(jnp.arange(n), L)
    rows = (span[:, None] == span[None, :]) & (j[None, :] <= j[:, None])
    return positions, j, context, rows


def span_logits(drafter, params, dparams, tokens, spans, L: int):
    """tokens [B,S], spans [B,n] -> the adaptive rows' logits [B,R,V], depth j [R],
    their positions [B,R]. The ordinary tokens run through the untouched model once."""
    B, S = tokens.shape
    positions, j, context, rows = span_layout(spans, L, S)
    R = positions.shape[1]
    ordinary = jnp.broadcast_to(jnp.arange(S), (B, S))
    _, block, _ = run_layers(params, drafter.cfg, embed(params, tokens), ordinary, None,
                             causal_mask(B, S))  # fmt: skip
    block = jax.lax.stop_gradient(block)
    cache = KVCache(block.keys, block.values, jnp.zeros((B,), jnp.int32))
    h = jnp.broadcast_to(drafter.adaptive_embeddings(dparams, L)[j], (B, R, drafter.cfg.dim))
    adaptive = jnp.ones((B, R), bool)
    new_mask = jnp.broadcast_to(rows, (B, R, R))
    logits = drafter.adapted_logits(
        params, dparams, h, positions, cache, new_mask, adaptive, context
    )
    return logits, j, positions


def span_targets(tokens, lengths, positions):
    """-> labels [B,R] (the token after each row's position) and valid [B,R]."""
    target = positions + 1
    valid = target < lengths[:, None]
    labels = jnp.take_along_axis(tokens, jnp.minimum(target, tokens.shape[1] - 1), axis=1)
    return labels, valid


@partial(jax.jit, static_argnames=("drafter", "optimizer", "L"), donate_argnames=("state",))
def train_step(state, params, tokens, lengths, spans, *, drafter, optimizer, L):
    def loss_fn(dparams):
        logits, j, positions = span_logits(drafter, params, dparams, tokens, spans, L)
        labels, valid = span_targets(tokens, lengths, positions)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # [B,R]
        weight = valid * ((L - j) / L)[None]
        per_depth = (ce * valid).reshape(*ce.shape[:1], -1, L).sum((0, 1)) / jnp.maximum(
            valid.reshape(*ce.shape[:1], -1, L).sum((0, 1)), 1
        )
        return (ce * weight).sum() / weight.sum(), per_depth

    (loss, per_depth), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    new = apply_grads(state, grads, optimizer)
    return new, (loss, per_depth)


@partial(jax.jit, static_argnames=("drafter", "L"))
def span_hits(params, dparams, tokens, lengths, spans, *, drafter, L):
    """-> label within the top-1..5 [B,n,L,5] and valid [B,n,L] for every span's rows."""
    logits, _, positions = span_logits(drafter, params, dparams, tokens, spans, L)
    labels, valid = span_targets(tokens, lengths, positions)
    ranks = jax.lax.top_k(logits, 5)[1]  # [B,R,5]
    hits = jnp.cumsum(ranks == labels[..., None], axis=-1) > 0
    B = tokens.shape[0]
    return hits.reshape(B, -1, L, 5), valid.reshape(B, -1, L)


def evaluate(drafter, params, dparams, data, L: int, stride: int = 4) -> dict:
    """Spans at every `stride`-th answer position of every test sequence: top-1..5 accuracy
    per depth and the mean leading run of correct drafts (spans with all L rows inside)."""
    hits_sum, valid_sum, runs = np.zeros((L, 5)), np.zeros(L), []
    width = data["tokens"].shape[1] // stride  # spans padded to one shape: one compilation
    for n in range(len(data["tokens"])):
        start, length = int(data["starts"][n]), int(data["lengths"][n])
        spans = np.arange(start - 1, start - 1 + width * stride, stride)
        spans = np.minimum(spans, max(length - 2, 0))[None].astype(np.int32)
        hits, valid = map(np.asarray, span_hits(
            params, dparams, data["tokens"][n : n + 1], data["lengths"][n : n + 1], spans,
            drafter=drafter, L=L,
        ))  # fmt: skip
        keep = np.concatenate([[True], spans[0, 1:] != spans[0, :-1]])  # padded spans repeat
        hits, valid = hits[0, keep], valid[0, keep]
        hits_sum += (hits & valid[..., None]).sum(0)
        valid_sum += valid.sum(0)
        full = valid.all(1)
        runs += np.cumprod(hits[full, :, 0], axis=1).sum(1).tolist()
    topk = hits_sum / np.maximum(valid_sum, 1)[:, None]
    return {
        "top1_per_depth": [round(float(x), 4) for x in topk[:, 0]],
        "topk_per_depth": [[round(float(x), 4) for x in row] for row in topk],
        "mean_leading_correct": round(float(np.mean(runs)), 3) if runs else None,
        "spans": len(runs),
    }


def sdsat_trees(topk_per_depth, sizes=SEARCHED_SIZES) -> dict[str, list[list[int]]]:
    """Trees searched from adaptive token j's measured top-1..5 accuracy [L,5] at depth j+1;
    depth 1 is the model's own next token, always right at rank 0."""
    certain = np.array([[1.0] * 5])
    return searched_trees(np.concatenate([certain, np.asarray(topk_per_depth)]), sizes)


class Sdsat(Trainer):
    """Mode (b): the adapter and the adaptive tokens' embeddings on the frozen model."""

    method, folder, show_every = "sdsat", "sdsat-adapter", 5
    data_parallel = True

    def prepare(self) -> None:
        """The answers (in the shared training folder) and the drafter."""
        self.train_data, self.test_data = self.answers()
        self.drafter = SdsatDrafter(self.cfg, self.args.rank, self.args.ids)

    adamw = {"b2": 0.95, "weight_decay": 0.0}  # the paper's

    def schedule(self):
        return paper_schedule(self.args.lr, self.args.steps)

    def fresh(self):
        return self.drafter.init(self.model.params, jax.random.key(self.args.seed))

    def step(self, state, step):
        args, data = self.args, self.train_data
        rng = np.random.default_rng([args.seed, step])  # a resumed run sees the same batches
        seqs = rng.integers(0, len(data["tokens"]), args.batch)
        lengths = data["lengths"][seqs]
        spans = span_starts(data["starts"][seqs], lengths, args.spans, rng)
        return train_step(
            state, self.model.params, *self.split_batch(data["tokens"][seqs], lengths, spans),
            drafter=self.drafter, optimizer=self.optimizer, L=args.window,
        )  # fmt: skip

    def shown(self, aux):
        return {"loss": f"{float(aux[0]):.3f}"}

    def evaluate_test(self, drafter, params, dparams) -> dict:
        """`evaluate` on the test answers."""
        return evaluate(drafter, params, dparams, self.test_data, self.args.window)

    def finish(self, state, aux) -> Result:
        """Evaluation, the searched trees; weights in float16."""
        args = self.args
        record = self.record(lambda: {
            "final_loss": round(float(aux[0]), 4),
            "final_loss_per_depth": [round(float(x), 3) for x in np.asarray(aux[1])],
        })  # fmt: skip
        evaluation = self.evaluate_test(self.drafter, self.model.params, state["params"])
        settings = SdsatSettings(rank=args.rank, n_ids=args.ids, window=args.window,
                                 cpu_tree=args.cpu_tree, gpu_tree="comb-8-4",
                                 trees=sdsat_trees(evaluation["topk_per_depth"]))  # fmt: skip
        report = {"steps": int(state["step"]), **record, "test": evaluation,
                  "trees": settings.trees}  # fmt: skip
        params16 = jax.tree.map(lambda x: np.asarray(x, np.float16), state["params"])
        return Result(report, settings, params16, card(args, self.cfg, report), self.test_data)


def train(argv) -> dict:
    args = parse_args(argv)
    if args.loss != "improved" and args.mode != "full":
        raise JaxspecError(f"--loss {args.loss} applies to --mode full only; add --mode full")
    if args.mode == "full" and args.init is not None:
        raise JaxspecError("--init starts an adapter from a drafter; --mode full fine-tunes the "
                           "model itself from its own weights: drop --init")  # fmt: skip
    if args.mode == "full":
        from .sdsat_full import FullSdsat  # builds on Sdsat (a module-level import would cycle)

        return skeleton.train(FullSdsat, args)
    return skeleton.train(Sdsat, args)


def card(args, cfg, report) -> str:
    test = report["test"]
    depths = " | ".join(f"{x:.3f}" for x in test["top1_per_depth"])
    return f"""# SDSAT adapter (mode b) for {cfg.name}

- {args.ids} adaptive token id(s) (input embeddings) and a rank-{args.rank} LoRA adapter
  on every linear map of every layer
  ({", ".join(LORA_TARGETS)}),
  active only at adaptive positions: the base model's outputs at ordinary tokens are
  untouched, and verification uses the base model itself. Weights stored in float16.
- Data: the base model's own greedy answers to the first user turns of {args.train_seqs}
  ShareGPT train-split conversations (prompts <= {args.prompt_len} tokens, answers
  <= {args.new_tokens}).
- Training: {report["steps"]} steps of {args.batch} sequences x {args.spans} spans of
  window L = {args.window} (row j weighted (L - j) / L, the paper's uniform window), AdamW
  lr {args.lr} (warm-up, cosine to lr/5, beta2 0.95); {report.get("train_minutes")}
  minutes of training on the machine that trained it.
- Final training loss: {report.get("final_loss")} (per depth {report.get("final_loss_per_depth")})
{started_from(args)}- Command: `jaxspec-train sdsat {command_flags(args)}`

Test split ({args.test_seqs} ShareGPT test conversations, {test["spans"]} spans): top-1
accuracy of adaptive token j against the base model's greedy token at depth j+1, and the
mean number of leading correct drafts of a {args.window}-token chain: **{
        test["mean_leading_correct"]
    }**.

| depth 2.. | {" | ".join(str(j + 2) for j in range(args.window))} |
|---|{"---|" * args.window}
| top-1 | {depths} |
| top-5 | {" | ".join(f"{row[-1]:.3f}" for row in test["topk_per_depth"])} |

Trees searched from the top-1..5 accuracy (`searched-N`, N nodes with the root):
{", ".join(f"{name} {paths}" for name, paths in report["trees"].items())}.
"""


def main(argv=None) -> None:
    train(argv)
