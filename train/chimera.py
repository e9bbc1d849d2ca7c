"""jaxspec-train chimera: Chimera's trigram encoder, full-context encoder and residual
heads on a frozen base model (paper §3.3).

1. Data: the base model's own greedy answers to ShareGPT train-split prompts and their
   last-layer states (shared with the other trainers, cached).
2. Each step takes --batch sequences and --rows answer positions in each; head d at row i
   guesses token i+1 from real states <= i-d and trigrams <= i (`training_logits`, the
   masks drafting uses). Targets: the base model's next-token distribution at row i
   (`--targets kl`, the default), its greedy token (`self`) or the data token (`data`);
   head d weighted decay**d; `--distill W` adds the paper's MSE between the lag-1 encoder
   output and the model's own state at the row (normed), weight W.
3. Orbax checkpoints every --save-every steps; a rerun resumes.
4. Evaluation on the test split: per-head top-1..5 accuracy (against the greedy token,
   earlier chain tokens being the true ones), searched trees; the drafter and its card;
   its accepted tokens per step (train/acceptance.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.cli import nonnegative_float, nonnegative_int, positive_float, positive_int
from jaxspec.drafters.chimera import (
    BOTTOMS,
    ChimeraDrafter,
    ChimeraSettings,
    encoder_outputs,
    training_logits,
)
from jaxspec.llama import final_norm, lm_logits
from jaxspec.tree import searched_trees

from . import skeleton
from .args import parse, trainer_parser
from .checkpoints import command_flags, started_from
from .optim import apply_grads
from .skeleton import Result, Trainer


def parse_args(argv):
    p = trainer_parser("chimera", __doc__, can_init=True)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--ngram", type=positive_int, default=3, help="tokens per n-gram (paper: 3)")
    p.add_argument(
        "--bottom",
        choices=BOTTOMS,
        default="ngram",
        help="bottom encoder: the n-gram MLP, or one decoder layer over the embeddings "
        "(trainable or the model's frozen first layer; Table 7 ablation, cannot draft)",
    )
    p.add_argument(
        "--no-residual", action="store_true", help="heads see only the encoder (Fig. 6 ablation)"
    )
    p.add_argument(
        "--full-heads", action="store_true", help="each head a full Linear(2D->V) (large)"
    )
    p.add_argument("--rows", type=positive_int, default=32, help="answer positions per sequence")
    p.add_argument(
        "--decay", type=positive_float, default=0.8, help="loss weight of head d is decay**d"
    )
    p.add_argument("--targets", choices=("kl", "self", "data"), default="kl")
    p.add_argument("--distill", type=nonnegative_float, default=0.0, help="weight of the MSE term")
    p.add_argument(
        "--draft-vocab",
        type=nonnegative_int,
        default=8192,
        help="the heads draft among this many most frequent answer tokens (0: all)",
    )
    p.add_argument(
        "--cache-prefill",
        type=nonnegative_int,
        default=4096,
        help="store this many most frequent answer n-grams to pre-fill the trigram cache",
    )
    return parse(p, argv)


def row_range(features: dict, n: int, K: int) -> tuple[int, int]:
    """Answer rows [low, high) of sequence n: K <= i and token i+1 in the answer."""
    starts = features.get("starts", np.ones_like(features["lengths"]))
    low = max(int(starts[n]) - 1, K)
    return low, max(int(features["lengths"][n]) - 1, low + 1)


def sample_rows(features: dict, seqs: np.ndarray, n_rows: int, K: int, rng,
                within: int = 0) -> np.ndarray:  # fmt: skip
    """-> rows [len(seqs), n_rows] drawn from each sequence's answer rows (within > 0: from
    its first `within` only)."""

    def drawn(n):
        low, high = row_range(features, n, K)
        return rng.integers(low, min(high, low + within) if within else high, n_rows)

    return np.stack([drawn(n) for n in seqs])


def batch_arrays(features: dict, seqs: np.ndarray, rows: np.ndarray, targets: str):
    """-> tokens [B,n], hidden [B,n,D] float32, rows [B,R], token labels [B,R]."""
    tokens = features["tokens"][seqs]
    if targets == "data":
        labels = np.take_along_axis(tokens, rows + 1, 1)
    else:
        labels = np.take_along_axis(features["predicted"][seqs], rows, 1)
    hidden = jnp.asarray(features["hidden"][seqs], jnp.float32)
    return jnp.asarray(tokens), hidden, jnp.asarray(rows), jnp.asarray(labels)


def answer_tokens(features: dict) -> np.ndarray:
    """Every answer's tokens, one after another."""
    starts = features.get("starts", np.ones_like(features["lengths"]))
    return np.concatenate([row[s:length] for row, s, length in zip(
        features["tokens"], starts, features["lengths"], strict=True)])  # fmt: skip


def vocab_coverage(features: dict, vocab) -> float:
    """The fraction of the answers' tokens that are in `vocab`."""
    return round(float(np.isin(answer_tokens(features), vocab).mean()), 4)


def frequent_tokens(features: dict, n: int, always: tuple[int, ...]) -> list[int]:
    """The n most frequent tokens of the answers (and the `always` ids), sorted."""
    counts = np.bincount(answer_tokens(features), minlength=1)
    top = np.argsort(-counts, kind="stable")[:n]
    return sorted(set(top[counts[top] > 0].tolist()) | set(always))


def most_frequent(size: int, asked: int, flag: str) -> str:
    """A card's words for a draft vocabulary of `size` tokens that `flag asked` chose."""
    if size < asked:  # the answers hold fewer distinct tokens than asked for
        return f"all {size} tokens of the training answers (fewer than {flag} {asked})"
    return f"the training answers' {asked} most frequent tokens"


def frequent_ngrams(features: dict, n: int, count: int) -> list[list[int]]:
    """The `count` most frequent n-grams ending in the answers, most frequent first (ties in
    first-seen order)."""
    starts = features.get("starts", np.ones_like(features["lengths"]))
    grams = [
        np.lib.stride_tricks.sliding_window_view(row[max(s - n + 1, 0) : length], n)
        for row, s, length in zip(features["tokens"], starts, features["lengths"], strict=True)
    ]
    unique, first, counts = np.unique(
        np.concatenate(grams), axis=0, return_index=True, return_counts=True
    )
    order = np.lexsort((first, -counts))[:count]
    return unique[order].tolist()


def losses_fn(drafter, base, params, tokens, hidden, rows, labels, targets, distill):
    """-> per-head losses [K] and the distillation MSE."""
    logits = training_logits(drafter, base, params, tokens, hidden, rows)  # [B,R,K,V]
    at_rows = jnp.take_along_axis(hidden, rows[..., None], 1)  # [B,R,D]
    if targets == "kl":
        teacher = jax.nn.softmax(lm_logits(base, drafter.cfg, at_rows), -1)[:, :, None]
        losses = optax.softmax_cross_entropy(logits, teacher).mean((0, 1))
    else:
        lab = jnp.broadcast_to(labels[:, :, None], logits.shape[:3])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, lab).mean((0, 1))
    mse = jnp.float32(0.0)
    if distill:
        encoded = encoder_outputs(drafter, base, params, tokens, hidden, rows, lag=1)
        norm = partial(final_norm, base, drafter.cfg)
        mse = jnp.mean((norm(encoded) - norm(at_rows)) ** 2)
    return losses, mse


@partial(jax.jit, static_argnames=("drafter", "optimizer", "targets", "distill"))
def train_step(state, base, tokens, hidden, rows, labels, weights, *, drafter, optimizer, targets,
               distill):  # fmt: skip
    def loss_fn(params):
        losses, mse = losses_fn(
            drafter, base, params, tokens, hidden, rows, labels, targets, distill
        )
        return (losses * weights).sum() + distill * mse, (losses, mse)

    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    return apply_grads(state, grads, optimizer), aux


@partial(jax.jit, static_argnames=("drafter",))
def topk_hits(base, params, tokens, hidden, rows, labels, valid, *, drafter):
    """-> [K,5] hits at top-1..5 per head, counting rows where valid [B,R]."""
    logits = training_logits(drafter, base, params, tokens, hidden, rows)  # [B,R,K,V]
    ranks = jax.lax.top_k(logits, 5)[1]
    hit = jnp.cumsum(ranks == labels[:, :, None, None], axis=-1) > 0
    return (hit & valid[:, :, None, None]).sum((0, 1))


def evaluate(drafter, base, params, features) -> np.ndarray:
    """Top-1..5 accuracy per head [K,5] over every answer row of every test sequence."""
    hits, total = np.zeros((drafter.n_heads, 5)), 0
    width = features["tokens"].shape[1]  # rows padded to one shape: one compilation
    for n in range(len(features["tokens"])):
        low, high = row_range(features, n, drafter.n_heads)
        rows = np.minimum(np.arange(low, low + width), high - 1)[None]
        valid = jnp.asarray(np.arange(low, low + width) < high)[None]
        tokens, hidden, rows, labels = batch_arrays(features, np.array([n]), rows, "self")
        hits += np.asarray(
            topk_hits(base, params, tokens, hidden, rows, labels, valid, drafter=drafter)
        )
        total += int(valid.sum())
    return hits / total


class Chimera(Trainer):
    method = "chimera"
    data_parallel = True

    def prepare(self) -> None:
        """Features (in the shared training folder) and the drafter."""
        args = self.args
        self.train_f, self.test_f = self.answers(features=True)
        self.drafter = ChimeraDrafter(
            self.cfg, args.heads, args.ngram, not args.no_residual, full_heads=args.full_heads,
            bottom=args.bottom,
        )  # fmt: skip
        self.weights = jnp.asarray(args.decay ** np.arange(1, args.heads + 1), jnp.float32)

    def fresh(self):
        return self.drafter.init(self.model.params)

    def step(self, state, step):
        args = self.args
        rng = np.random.default_rng([args.seed, step])  # a resumed run sees the same batches
        seqs = rng.integers(0, len(self.train_f["tokens"]), args.batch)
        rows = sample_rows(self.train_f, seqs, args.rows, args.heads, rng)
        batch = self.split_batch(*batch_arrays(self.train_f, seqs, rows, args.targets))
        return train_step(
            state, self.model.params, *batch,
            self.weights, drafter=self.drafter, optimizer=self.optimizer, targets=args.targets,
            distill=args.distill,
        )  # fmt: skip

    def shown(self, aux):
        losses, mse = aux
        shown = {"loss": " ".join(f"{x:.2f}" for x in np.asarray(losses))}
        return {**shown, **({"mse": f"{float(mse):.3f}"} if self.args.distill else {})}

    def finish(self, state, aux) -> Result:
        """Evaluation; settings with the searched trees, the draft vocabulary and the
        trigram cache's pre-fill; weights in float16."""
        args, cfg, train_f, test_f = self.args, self.cfg, self.train_f, self.test_f
        record = self.record(lambda: {
            "final_loss_per_head": [round(float(x), 4) for x in np.asarray(aux[0])],
            "final_distill_mse": round(float(aux[1]), 4),
        })  # fmt: skip
        accuracy = evaluate(self.drafter, self.model.params, state["params"], test_f)
        settings = ChimeraSettings(
            n_heads=args.heads, ngram=args.ngram, residual=not args.no_residual,
            full_heads=args.full_heads, bottom=args.bottom, trees=searched_trees(accuracy),
        )  # fmt: skip
        coverage, data = None, {}
        if args.draft_vocab:
            vocab = frequent_tokens(train_f, args.draft_vocab, tuple(cfg.eos_token_ids))
            data["draft_vocab"] = np.asarray(vocab, np.int32)
            coverage = vocab_coverage(test_f, vocab)
        if args.cache_prefill and args.bottom == "ngram":
            grams = frequent_ngrams(train_f, args.ngram, args.cache_prefill)
            data["cache_prefill"] = np.asarray(grams, np.int32).reshape(-1, args.ngram)
        report = {
            "steps": int(state["step"]),
            **record,
            "draft_vocab_size": len(data["draft_vocab"]) if args.draft_vocab else None,
            "draft_vocab_test_coverage": coverage,
            "test_topk_accuracy": [[round(float(x), 4) for x in row] for row in accuracy],
        }
        params16 = jax.tree.map(lambda x: np.asarray(x, np.float16), state["params"])
        drafts = args.bottom == "ngram"  # the transformer-bottom ablation cannot draft
        return Result(report, settings, params16, card(args, cfg, report),
                      test_f if drafts else None, data)  # fmt: skip


def train(argv) -> dict:
    return skeleton.train(Chimera, parse_args(argv))


def card(args, cfg, report) -> str:
    rows = "\n".join(
        f"| {k + 1} | " + " | ".join(f"{x:.3f}" for x in acc) + " |"
        for k, acc in enumerate(report["test_topk_accuracy"])
    )
    return f"""# Chimera drafter for {cfg.name}

- {
        f"{args.ngram}-gram encoder (ResBlock + Linear to D)"
        if args.bottom == "ngram"
        else f"bottom encoder: {args.bottom} (one decoder layer over the embeddings; "
        "a training-only ablation that cannot draft)"
    }, full-context encoder (one Llama
  decoder layer, initialised from the base model's last layer), {args.heads} heads on
  {"the encoder's output" if args.no_residual else "[h ; encoder output] (residual)"},
  {"each a full Linear to V" if args.full_heads else "each a Linear to D + the frozen lm_head"}.
  Weights stored in float16.
- Data: the base model's own greedy answers to the first user turns of {args.train_seqs}
  ShareGPT train-split conversations (prompts <= {args.prompt_len} tokens, answers
  <= {args.new_tokens}).
- Training: {report["steps"]} steps of {args.batch} sequences x {args.rows} answer rows,
  targets `{args.targets}`, AdamW lr {args.lr} cosine, head weights {args.decay}**d,
  distillation weight {args.distill}; {report.get("train_minutes")} minutes of training on
  the machine that trained it.
- Final training loss per head: {report.get("final_loss_per_head")}
- Draft vocabulary: {
        f"{most_frequent(report['draft_vocab_size'], args.draft_vocab, '--draft-vocab')}, covering "
        f"{report['draft_vocab_test_coverage']:.1%} of the test answers' tokens"
        if args.draft_vocab
        else "the whole vocabulary"
    } (the accuracy below is over the whole vocabulary).
{started_from(args)}- Command: `jaxspec-train chimera {command_flags(args)}`

Test-split accuracy ({args.test_seqs} ShareGPT test conversations), top-1..5 against the
base model's greedy tokens (earlier chain tokens the true ones):

| head | top-1 | top-2 | top-3 | top-4 | top-5 |
|---|---|---|---|---|---|
{rows}
"""


def main(argv=None) -> None:
    train(argv)
