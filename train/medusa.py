"""jaxspec-train medusa: Medusa heads on a frozen base model, trained on ShareGPT.

1. Data: `--data self` (default) is the base model's own greedy answers to the first user
   turns of N train and M test conversations (train/selfdata.py), loss on answer positions
   only; `--data sharegpt` is the conversations themselves (chat template), all positions.
   Features (last hidden states, the base model's greedy predictions) are cached.
2. Heads train on them: head k at position t learns the token k+1 positions ahead:
   the base model's own greedy prediction there (`--targets self`, the default:
   what greedy verification checks against), the data token (`--targets data`), or the base
   model's whole next-token distribution there (`--targets kl`: KL self-distillation).
   Loss per head weighted decay**k.
3. Orbax checkpoints every --save-every steps; a rerun resumes from the last one.
4. Evaluation: per-head top-1..5 accuracy on the test split, and each head's calibration
   for dynamic trees (train/calibration.py); the drafter and its card
   are written to --out, then its accepted tokens per step are measured (train/acceptance.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.cli import positive_float, positive_int
from jaxspec.data.sources import sharegpt_split, split_tag
from jaxspec.drafters.medusa import MedusaDrafter, MedusaSettings
from jaxspec.llama import lm_logits
from jaxspec.tree import searched_trees

from . import skeleton
from .args import parse, trainer_parser
from .calibration import fit_calibration
from .checkpoints import command_flags, started_from
from .features import answer_features, extract
from .optim import apply_grads
from .skeleton import Result, Trainer

CALIBRATION_WIDTH = 8  # guesses per head the calibration is fitted on (dynamic trees' default)


def parse_args(argv):
    p = trainer_parser("medusa", __doc__, batch=256, batch_help="positions per step", can_init=True)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--data", choices=("self", "sharegpt"), default="self")
    p.add_argument(
        "--seq-len", type=positive_int, default=256, help="sharegpt data: tokens per sequence"
    )
    p.add_argument(
        "--decay", type=positive_float, default=0.8, help="loss weight of head k is decay**k"
    )
    p.add_argument("--targets", choices=("self", "data", "kl"), default="self")
    p.add_argument(
        "--own-lm-head",
        action="store_true",
        help="each head its own vocabulary projection, initialised from the base lm_head "
        "(Medusa-1's form; V*D weights per head) instead of the shared frozen one",
    )
    return parse(p, argv)


def samples(features: dict, K: int, targets: str) -> tuple[np.ndarray, np.ndarray]:
    """-> (sequence, position) pairs [N,2] with all K targets inside the sequence (and, for
    self data, inside the answer), and token targets [N,K]: head k (1-based) at position t
    targets token t+k+1 (the base model's greedy guess for it sits at t+k)."""
    starts = features.get("starts", np.ones_like(features["lengths"]))
    pairs, labels = [], []
    for n, (start, length) in enumerate(zip(starts, features["lengths"], strict=True)):
        t = np.arange(start - 1, length - K - 1)
        pairs.append(np.stack([np.full_like(t, n), t], 1))
        if targets == "data":
            labels.append(np.stack([features["tokens"][n, t + k + 1] for k in range(1, K + 1)], 1))
        else:
            labels.append(np.stack([features["predicted"][n, t + k] for k in range(1, K + 1)], 1))
    return np.concatenate(pairs), np.concatenate(labels)


def gather(features: dict, pairs: np.ndarray, K: int, with_future: bool):
    """-> hidden [N,D] at the pairs and, if with_future, [N,K,D] at positions t+1..t+K (the
    base model's distributions for the heads' targets)."""
    h = jnp.asarray(features["hidden"][pairs[:, 0], pairs[:, 1]], jnp.float32)
    if not with_future:
        return h, None
    future = pairs[:, 1:] + np.arange(1, K + 1)[None]
    return h, jnp.asarray(features["hidden"][pairs[:, :1], future], jnp.float32)


def head_losses(drafter, base, params, h, labels, h_future):
    """Cross-entropy per head [K] against token labels [N,K] or, when h_future [N,K,D] is
    given, against the base model's distributions there (KL up to a constant)."""
    logits = drafter.head_logits(base, params, h)  # [N,K,V]
    if h_future is None:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(0)
    teacher = jax.nn.softmax(lm_logits(base, drafter.cfg, h_future), -1)  # [N,K,V]
    return optax.softmax_cross_entropy(logits, teacher).mean(0)


@partial(jax.jit, static_argnames=("drafter", "optimizer"))
def train_step(state, base, h, labels, h_future, weights, *, drafter, optimizer):
    def loss_fn(params):
        losses = head_losses(drafter, base, params, h, labels, h_future)
        return (losses * weights).sum(), losses

    (_, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    return apply_grads(state, grads, optimizer), losses


@partial(jax.jit, static_argnames=("drafter", "width"))
def head_guesses(base, params, h, *, drafter, width):
    """-> each head's top-`width` guesses: log probabilities and tokens [N,K,w]. (Not
    topology.top_log_probs: XLA:CPU aborts compiling its barrier inside data-parallel
    training on a mesh.)"""
    logits = drafter.head_logits(base, params, h)
    lp, guess = jax.lax.top_k(logits, width)
    return lp - jax.nn.logsumexp(logits, -1, keepdims=True), guess


def evaluate(drafter, base, params, features, targets, batch=512):
    """-> top-1..5 accuracy per head against the `targets` labels [K,5], and the heads'
    calibration (train/calibration.py) against the model's greedy tokens, which are what
    verification accepts, whatever the heads trained on."""
    pairs, labels = samples(features, drafter.n_heads, targets)
    _, greedy = samples(features, drafter.n_heads, "self")  # the same pairs
    lps, guesses = [], []
    for i in range(0, len(pairs), batch):
        h, _ = gather(features, pairs[i : i + batch], drafter.n_heads, False)
        lp, guess = head_guesses(base, params, h, drafter=drafter, width=CALIBRATION_WIDTH)
        lps.append(np.asarray(lp))
        guesses.append(np.asarray(guess))
    lp, guess = np.concatenate(lps), np.concatenate(guesses)
    accuracy = np.cumsum(guess[..., :5] == labels[..., None], -1).clip(0, 1).mean(0)  # [K,5]
    return accuracy, fit_calibration(lp, guess == greedy[..., None])


class Medusa(Trainer):
    method = "medusa"
    data_parallel = True

    def prepare(self) -> None:
        """Features (cached per split, count and lengths: reruns reuse them), the training
        pairs and the drafter."""
        args = self.args
        self.train_f = self.features("train", args.train_seqs)
        self.test_f = self.features("test", args.test_seqs)
        self.pairs, self.labels = samples(self.train_f, args.heads, args.targets)
        self.drafter = MedusaDrafter(self.cfg, args.heads, args.own_lm_head)
        self.weights = jnp.asarray(args.decay ** np.arange(1, args.heads + 1), jnp.float32)
        self.order = np.random.default_rng(args.seed).permutation(len(self.pairs))

    def features(self, split: str, n: int) -> dict:
        args = self.args
        if args.data == "sharegpt":
            file = self.work / f"{split_tag(split)}-{n}x{args.seq_len}.npz"
            return extract(self.model, sharegpt_split(split), n, args.seq_len, file)
        return answer_features(self.model, self.shared, split, n, args.prompt_len, args.new_tokens,
                               args.answer_batch)  # fmt: skip

    def fresh(self):
        return self.drafter.init(self.model.params)

    def step(self, state, step):
        args = self.args
        idx = self.order[(step * args.batch + np.arange(args.batch)) % len(self.order)]
        h, h_future = gather(self.train_f, self.pairs[idx], args.heads, args.targets == "kl")
        h, labels, h_future = self.split_batch(h, self.labels[idx], h_future)
        return train_step(
            state, self.model.params, h, labels, h_future, self.weights,
            drafter=self.drafter, optimizer=self.optimizer,
        )  # fmt: skip

    def shown(self, losses):
        return {"loss": " ".join(f"{x:.2f}" for x in np.asarray(losses))}

    def finish(self, state, losses) -> Result:
        args = self.args
        record = self.record(lambda: {
            "final_loss_per_head": [round(float(x), 4) for x in np.asarray(losses)],
        })  # fmt: skip
        accuracy, calibration = evaluate(self.drafter, self.model.params, state["params"],
                                         self.test_f, args.targets)  # fmt: skip
        settings = MedusaSettings(
            n_heads=args.heads, own_lm_head=args.own_lm_head, trees=searched_trees(accuracy),
            calibration=calibration,
        )  # fmt: skip
        report = {
            "steps": int(state["step"]),
            **record,
            "test_topk_accuracy": [[round(float(x), 4) for x in row] for row in accuracy],
            "calibration": [list(pair) for pair in calibration],
            "train_positions": int(len(self.pairs)),
        }
        return Result(report, settings, state["params"], card(args, self.cfg, report), self.test_f)


def train(argv) -> dict:
    return skeleton.train(Medusa, parse_args(argv))


HEAD_PROJECTION = {
    False: "the frozen base lm_head",
    True: "its own vocabulary projection, initialised from the base lm_head",
}
TARGETS = {
    "self": "the base model's own greedy predictions",
    "data": "the data tokens",
    "kl": "the base model's next-token distributions, KL self-distillation",
}
DATA = {
    "self": "the base model's own greedy answers (loss on answer tokens only) to the first "
    "user turns of ShareGPT conversations",
    "sharegpt": "ShareGPT conversations (chat template), every position",
}


def card(args, cfg, report) -> str:
    rows = "\n".join(
        f"| {k + 1} | " + " | ".join(f"{x:.3f}" for x in acc) + " |"
        for k, acc in enumerate(report["test_topk_accuracy"])
    )
    return f"""# Medusa drafter for {cfg.name}

- Heads: {args.heads} (ResBlock + {HEAD_PROJECTION[args.own_lm_head]}), targets: `{args.targets}`
  ({TARGETS[args.targets]}).
- Data: {DATA[args.data]}, {args.train_seqs} train-split conversations:
  {report["train_positions"]} training positions.
- Training: {report["steps"]} steps of {args.batch} positions, AdamW lr {args.lr} cosine,
  head weights {args.decay}**k; {report.get("train_minutes")} minutes end to end on the
  machine that trained it.
- Final training loss per head: {report.get("final_loss_per_head")}
{started_from(args)}- Command: `jaxspec-train medusa {command_flags(args)}`

Test-split accuracy ({args.test_seqs} ShareGPT test conversations, same kind of data),
top-1..5 against the base model's greedy tokens:

| head | top-1 | top-2 | top-3 | top-4 | top-5 |
|---|---|---|---|---|---|
{rows}

Dynamic trees score a head's guess of probability p as min(1, exp(shift) * p**slope),
fitted on the same test answers (train/calibration.py); (slope, shift) per head:
{", ".join(f"({a}, {b})" for a, b in report["calibration"])}.
"""


def main(argv=None) -> None:
    train(argv)
