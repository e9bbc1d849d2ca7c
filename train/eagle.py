"""jaxspec-train eagle: the EAGLE-class drafter (one decoder layer, or --blocks of them, on
fused low/middle/high states, jaxspec/drafters/eagle.py) on a frozen base model, by EAGLE-3's
training-time test.

1. Data: the base model's own greedy answers to ShareGPT train-split prompts (shared with
   the other trainers; `--answers sharegpt`: the conversations' own replies, which cost no
   generation) and its states after the fused layers and the last one at every
   position: cached beside them (--states cached, 1.5 MB a sequence at 135M), or computed
   from each batch's tokens at every step (--states live: on a GPU, for more answers
   than a disk holds the states of; always for ShareGPT's replies; --live-products plain:
   in one bfloat16 pass per product). The targets are the model's own distributions
   either way; the test split is always the model's answers, its states exact.
2. Each step takes --batch whole sequences; --ttt steps of the drafter run over each
   answer's window (`training_outputs`: the masks drafting uses at depth k-1; the prompt
   enters as committed entries), step k feeding each position step k-1's output as its
   feature. At --rows answer positions per sequence every step's guess
   is scored against the base model's next-token distribution there, restricted to the
   draft vocabulary (cross-entropy; --loss-top K: against its K most probable tokens only),
   step k weighted --decay**(k-1); --feature-noise perturbs the model's fused states
   (training only).
3. Orbax checkpoints every --save-every steps; a rerun resumes. --init a one-block drafter
   with --blocks N: blocks 2..N start as the identity (zero output projections), so the
   grown drafter starts where that one ended.
4. Evaluation on the test split: top-1..5 accuracy per step against the greedy token
   (earlier path tokens the true ones), searched trees; the same on as many of the training
   answers ("seen": the gap to the test split is what the drafter memorised, not learned);
   --eval-every N: top-1 on both before the first step and every N steps, kept in the
   run's record; the drafter and its card; its accepted tokens per step
   (train/acceptance.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxspec.cli import nonnegative_float, nonnegative_int, positive_float, positive_int
from jaxspec.drafters.eagle import (
    DEFAULT_DEPTH,
    EagleDrafter,
    EagleSettings,
    fused_layers,
    shifted,
    training_outputs,
)
from jaxspec.drafters.store import load_drafter
from jaxspec.errors import JaxspecError
from jaxspec.llama import compute_params, draft_vocab, lm_logits, plain_products
from jaxspec.tree import searched_trees

from . import skeleton
from .args import parse, prompt_set_text, trainer_parser
from .checkpoints import command_flags, run_record, started_from
from .chimera import frequent_tokens, most_frequent, row_range, sample_rows, vocab_coverage
from .features import (
    layer_features,
    live_states,
    self_answers,
    sharegpt_replies,
    stored_layers,
    with_states,
)
from .optim import apply_grads
from .selfdata import TURNS, prompt_set, question_answers
from .skeleton import Result, Trainer

STATES = ("cached", "live")  # where the training answers' states come from
ANSWERS = ("self", "sharegpt")  # whose answers the drafter trains on
LIVE_PRODUCTS = ("exact", "plain")  # the frozen model's products for live states


EVAL_PER_CATEGORY = 5  # --eval-questions' questions per category


def parse_args(argv):
    p = trainer_parser("eagle", __doc__, can_init=True, steps=600)
    p.add_argument("--ttt", type=positive_int, default=4, help="training-time test steps")
    p.add_argument(
        "--depth", type=positive_int, default=DEFAULT_DEPTH, help="deepest dynamic tree drafted"
    )
    p.add_argument("--rows", type=positive_int, default=48, help="scored positions per sequence")
    p.add_argument(
        "--rows-within",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="draw the scored positions from each answer's first N tokens only (its start, "
        "where the drafter guesses worst and answers repeat themselves least; 0: anywhere)",
    )
    p.add_argument(
        "--blocks",
        type=positive_int,
        default=1,
        help="decoder blocks in the drafter (EAGLE's: 1; each extra block costs one more block "
        "call per drafted depth, one more pass over each training sequence, and ~7 MB at 135M "
        "in float16)",
    )
    p.add_argument(
        "--decay", type=positive_float, default=0.8, help="loss weight of step k is decay**(k-1)"
    )
    p.add_argument(
        "--loss-top",
        type=nonnegative_int,
        default=0,
        metavar="K",
        help="score each guess against the model's K most probable tokens only, -sum of p "
        "log q over them (HASS's top-K distillation: the drafter is not asked to match the "
        "tail; 1: the greedy token weighted by the model's confidence; 0: the whole "
        "distribution)",
    )
    p.add_argument(
        "--feature-noise",
        type=nonnegative_float,
        default=0.0,
        metavar="SIGMA",
        help="training only: each element of the model's fused states times 1 + SIGMA * "
        "N(0,1) (EAGLE's data noise, in proportion: the drafter cannot key on the exact "
        "states of the answers it has seen; 0: none)",
    )
    p.add_argument(
        "--turns",
        choices=TURNS,
        default="first",
        help="training prompts: first user turns, every user turn with the conversation "
        "before it (more prompts; raise --prompt-len, e.g. 1024), every turn but the first "
        "(later: new prompts for a drafter trained on first turns), a conversation's first "
        "reply handed back with a request to summarise it or answer from it (grounded: "
        "answers that copy from the prompt, as in summarisation and RAG; raise --prompt-len, "
        "e.g. 768), or user turns the model writes itself (written: no dataset read, prompts "
        "of every kind it was tuned on); the test split's stay ShareGPT's first turns",
    )
    p.add_argument(
        "--skip-prompts",
        metavar="TURNS:N:LEN",
        type=prompt_set_text,
        help="leave out of the training prompts those among the first N --turns TURNS "
        "prompts of <= LEN tokens, e.g. the ones the --init drafter trained on (its card's "
        "command: first:6400:128 for --train-seqs 6400 --prompt-len 128), so that the answers "
        "made and the steps go to prompts new to it",
    )
    p.add_argument(
        "--answers",
        choices=ANSWERS,
        default="self",
        help="training answers: the model's own greedy ones (self), or the conversations' "
        "replies (sharegpt: no generation, states live)",
    )
    p.add_argument(
        "--states",
        choices=STATES,
        default=None,
        help="the model's states of the training answers: computed once and kept on disk "
        "(cached, the default for self answers), or from each batch's tokens at every step "
        "(live: a GPU, many answers; ShareGPT's replies)",
    )
    p.add_argument(
        "--live-products",
        choices=LIVE_PRODUCTS,
        default="exact",
        help="the frozen model's products for --states live: exact (as decoding computes), "
        "or plain (one bfloat16 pass accumulated in float32: a faster pass, states within "
        "~1%% of exact)",
    )
    p.add_argument(
        "--guess-vocab",
        type=nonnegative_int,
        default=8192,
        help="the drafter guesses (and trains) among this many most frequent answer tokens "
        "(0: all)",
    )
    p.add_argument(
        "--keep-vocab",
        action="store_true",
        help="with --init: guess among that drafter's draft vocabulary (--guess-vocab unused)",
    )
    p.add_argument(
        "--eval-questions",
        metavar="SOURCE",
        help="also score top-1 on the model's answers to the first turns of the first "
        f"{EVAL_PER_CATEGORY} questions of each category of SOURCE (what jaxspec-bench "
        "--questions takes, e.g. a Spec-Bench .jsonl), at the end also by category: how the "
        "drafter carries to that text",
    )
    p.add_argument(
        "--eval-every",
        type=nonnegative_int,
        default=0,
        help="every N steps, top-1 per step on the test answers and on as many training "
        "answers, printed and kept in the report (0: at the end only)",
    )
    args = parse(p, argv)
    if args.keep_vocab and args.init is None:
        p.error("--keep-vocab keeps the --init drafter's vocabulary: add --init DIR")
    if args.answers == "sharegpt" and args.turns in ("written", "grounded"):
        p.error(f"--answers sharegpt trains on ShareGPT's replies to its own prompts, which "
                f"--turns {args.turns} does not use: drop one")  # fmt: skip
    if args.skip_prompts and (args.answers == "sharegpt" or args.turns == "written"):
        p.error("--skip-prompts leaves ShareGPT prompts out of the model's own answers to "
                "them: drop it, or --answers sharegpt / --turns written")  # fmt: skip
    if args.answers == "sharegpt" and args.states == "cached":
        p.error("--answers sharegpt computes states live: leave out --states cached")
    args.states = args.states or ("live" if args.answers == "sharegpt" else "cached")
    if args.live_products == "plain" and args.states == "cached":
        p.error("--live-products plain is for states computed live: add --states live")
    return args


def fused_and_last(states, stored: tuple[int, ...], layers: tuple[int, ...]):
    """states [B,T,L,D] after the `stored` layers (the last one last) -> the fused layers'
    states [B,T,3,D] and the last layer's [B,T,D], float32."""
    states = jnp.asarray(states, jnp.float32)
    return states[:, :, [stored.index(n) for n in layers]], states[:, :, -1]


def noisy(fused3, sigma: float, seed):
    """fused3 [B,T,3,D], each element times 1 + sigma * N(0, 1) (seed: a uint32 scalar, the
    step's): noise in proportion to each element, since a few of the residual stream's
    elements are ~100x the rest; sigma 0: fused3 itself."""
    if sigma == 0:
        return fused3
    return fused3 * (1 + sigma * jax.random.normal(jax.random.key(seed), fused3.shape))


def cached_fused_and_last(features: dict, seqs, layers: tuple[int, ...]):
    """fused_and_last of sequences `seqs` of a layer_features cache."""
    stored = tuple(features["layers"].tolist())
    return fused_and_last(features["states"][seqs], stored, layers)


def step_logits(drafter, base, params, tokens, fused3, rows, steps, width):
    """-> guess logits [B,R,K,V'] of each training-time-test step at rows [B,R]; the layer
    runs on a window of `width` positions per sequence that ends at or after its last row
    and starts steps-1 before its first (`window_width`)."""
    states = {n: fused3[:, :, i] for i, n in enumerate(drafter.layers)}
    features = shifted(drafter.fuse(params, states))
    first = jnp.clip(rows.min(1) - (steps - 1), 0, tokens.shape[1] - width)  # [B]
    outputs = training_outputs(drafter, base, params, tokens, features, steps, first, width)
    at = lambda y: jnp.take_along_axis(y, (rows - first[:, None])[..., None], axis=1)  # noqa: E731
    return jnp.stack([drafter.logits(base, params, at(y)) for y in outputs], axis=2)


def window_width(data: dict, steps: int) -> int:
    """The window step_logits needs for any rows of `data`'s answers (row_range): the
    longest answer's rows and the steps-1 positions before them."""
    ranges = [row_range(data, n, steps) for n in range(len(data["tokens"]))]
    return min(max(high - low for low, high in ranges) + steps - 1, data["tokens"].shape[1])


def teacher(base, cfg, last, rows, vocab, top: int = 0):
    """The model's next-token distribution at rows [B,R], over the draft vocabulary
    (renormalised) -> [B,R,1,V']; top > 0: zero but its `top` most probable tokens."""
    logits = lm_logits(base, cfg, jnp.take_along_axis(last, rows[..., None], axis=1))
    if vocab is not None:
        logits = logits[..., vocab["ids"]]
    return top_only(jax.nn.softmax(logits, -1), top)[:, :, None]


def check_loss_top(args, vocab_size: int) -> None:
    if args.loss_top > vocab_size:
        raise JaxspecError(f"--loss-top {args.loss_top} is more tokens than the draft "
                           f"vocabulary's {vocab_size}: give at most {vocab_size}")  # fmt: skip


def top_only(p: jax.Array, top: int) -> jax.Array:
    """p [...,V] with all but its `top` largest entries zeroed (any tied with the last of
    them kept too); top 0: p unchanged."""
    if not top:
        return p
    return jnp.where(p >= jax.lax.top_k(p, top)[0][..., -1:], p, 0.0)


@partial(jax.jit, static_argnames=("drafter", "optimizer", "steps", "width", "noise", "top"))
def train_step(state, base, tokens, fused3, last, rows, weights, vocab, seed, *, drafter,
               optimizer, steps, width, noise, top):  # fmt: skip
    target = teacher(base, drafter.cfg, last, rows, vocab, top)
    fused3 = noisy(fused3, noise, seed)

    def loss_fn(params):
        p = params if vocab is None else {**params, "vocab": vocab}
        logits = step_logits(drafter, base, p, tokens, fused3, rows, steps, width)
        losses = optax.softmax_cross_entropy(logits, target).mean((0, 1))  # [K]
        return (losses * weights).sum(), losses

    (_, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    return apply_grads(state, grads, optimizer), losses


@partial(jax.jit, static_argnames=("drafter", "steps", "width"))
def topk_hits(base, params, tokens, fused3, rows, labels, valid, *, drafter, steps, width):
    """-> [K,5] hits at top-1..5 per step, counting rows where valid [B,R]."""
    logits = step_logits(drafter, base, params, tokens, fused3, rows, steps, width)
    guesses = drafter.to_tokens(params, jax.lax.top_k(logits, 5)[1])
    hit = jnp.cumsum(guesses == labels[:, :, None, None], axis=-1) > 0
    return (hit & valid[:, :, None, None]).sum((0, 1))


def evaluate(drafter, base, params, features, steps: int) -> np.ndarray:
    """Top-1..5 accuracy per step [K,5] over every answer row of every test sequence."""
    hits, rows = sequence_hits(drafter, base, params, features, steps)
    return hits.sum(0) / rows.sum()


def by_category(hits: np.ndarray, rows: np.ndarray, categories: np.ndarray) -> dict:
    """sequence_hits of sequences in `categories` [N] -> {category: top-1 per step [K]}, by
    name."""
    return {c: hits[categories == c, :, 0].sum(0) / rows[categories == c].sum()
            for c in sorted(set(categories.tolist()))}  # fmt: skip


def sequence_hits(drafter, base, params, features, steps: int):
    """-> (hits at top-1..5 per step [N,K,5], answer rows scored [N]) of each sequence."""
    hits, rows_scored = [], []
    width = window_width(features, steps)
    R = width - (steps - 1)  # rows padded to one shape: one compilation
    for n in range(len(features["tokens"])):
        low, high = row_range(features, n, steps)
        rows = np.minimum(np.arange(low, low + R), high - 1)[None]
        valid = jnp.asarray(np.arange(low, low + R) < high)[None]
        fused3, _ = cached_fused_and_last(features, np.array([n]), drafter.layers)
        labels = jnp.asarray(np.take_along_axis(features["predicted"][[n]], rows, 1))
        hits.append(np.asarray(topk_hits(
            base, params, jnp.asarray(features["tokens"][[n]]), fused3, jnp.asarray(rows),
            labels, valid, drafter=drafter, steps=steps, width=width,
        )))  # fmt: skip
        rows_scored.append(int(valid.sum()))
    return np.stack(hits), np.array(rows_scored)


def first_answers(model, data: dict, n: int, layers: tuple[int, ...], batch: int) -> dict:
    """The first n sequences of a training set with what `evaluate` reads: their states
    after `layers` (stored_layers) and the model's greedy tokens, sliced from a cache or
    computed."""
    if "states" in data:
        return {k: v if k == "layers" else v[:n] for k, v in data.items()}
    return with_states(model, {k: data[k][:n] for k in ("tokens", "lengths", "starts")},
                       layers, batch)  # fmt: skip


def kept_vocab(args, cfg) -> np.ndarray:
    """The --init drafter's draft vocabulary (--keep-vocab)."""
    ids = load_drafter(args.init, "eagle", cfg).data.get("draft_vocab")
    if ids is None:
        raise JaxspecError(f"--keep-vocab: the drafter at {args.init} has no draft vocabulary; "
                           "leave out --keep-vocab")  # fmt: skip
    return ids


class Eagle(Trainer):
    method = "eagle"
    grown = ("upper",)  # --init from a drafter of one block: blocks 2.. start silent

    def __init__(self, args, model):
        super().__init__(args, model)
        if model.cfg.n_layers < 2:
            raise JaxspecError("EAGLE fuses states of several layers: the model has only one")

    def prepare(self) -> None:
        args, cfg = self.args, self.cfg
        self.drafter = EagleDrafter(cfg, fused_layers(cfg), args.depth, args.blocks)
        kept = np.asarray(kept_vocab(args, cfg), np.int32) if args.keep_vocab else None
        check_loss_top(args, len(kept) if args.keep_vocab else args.guess_vocab or cfg.vocab_size)

        def load(split: str, n: int, turns: str = "first", skip: str | None = None) -> dict:
            return layer_features(self.model, self.shared, split, n, args.prompt_len,
                                  args.new_tokens, self.drafter.layers,
                                  answer_batch=args.answer_batch, turns=turns,
                                  skip=skip)  # fmt: skip

        self.stored = stored_layers(cfg, self.drafter.layers)
        self.frozen = self.model.params  # what computes live states
        if args.live_products == "plain":
            self.frozen = plain_products(compute_params(self.model.params, "bfloat16"))
        if args.answers == "sharegpt":  # their states are made batch by batch
            self.train_f = sharegpt_replies(
                self.model, self.shared, "train", args.train_seqs, args.prompt_len,
                args.new_tokens, args.turns,
            )  # fmt: skip
        elif args.states == "live":  # answers only; their states are made batch by batch
            self.train_f = self_answers(
                self.model, self.shared, "train", args.train_seqs, args.prompt_len,
                args.new_tokens, args.answer_batch, args.turns, args.skip_prompts,
            )  # fmt: skip
        else:
            self.train_f = load("train", args.train_seqs, args.turns, args.skip_prompts)
        self.test_f = load("test", args.test_seqs)
        self.vocab_ids = kept
        if not args.keep_vocab and args.guess_vocab:
            ids = frequent_tokens(self.train_f, args.guess_vocab, tuple(cfg.eos_token_ids))
            self.vocab_ids = np.asarray(ids, np.int32)
        if self.vocab_ids is not None:  # fewer distinct answer tokens than --guess-vocab
            check_loss_top(args, len(self.vocab_ids))
        self.vocab = None if self.vocab_ids is None else draft_vocab(
            self.model.params, cfg, self.vocab_ids)  # fmt: skip
        self.weights = jnp.asarray(args.decay ** np.arange(args.ttt), jnp.float32)
        self.width = window_width(self.train_f, args.ttt)
        if args.rows_within:  # the rows lie within rows_within of each other
            self.width = min(self.width, args.rows_within + args.ttt - 1)
        n_seen = min(args.test_seqs, len(self.train_f["tokens"]))
        self.seen_f = first_answers(self.model, self.train_f, n_seen, self.stored, args.batch)
        self.questions_f = None
        if args.eval_questions:
            answers = question_answers(self.model, self.shared, args.eval_questions,
                                       EVAL_PER_CATEGORY, args.new_tokens,
                                       args.answer_batch)  # fmt: skip
            self.questions_f = with_states(self.model, answers, self.stored, args.batch)

    def accuracy(self, params, categories: bool = False) -> dict:
        """Top-1..5 per step [K,5] on the test answers, the first training ones and
        (--eval-questions) the answers to those questions; categories: also their top-1 per
        step [K] by question category ("questions_by_category")."""
        scored = params if self.vocab is None else {**params, "vocab": self.vocab}
        result = {split: evaluate(self.drafter, self.model.params, scored, data, self.args.ttt)
                  for split, data in (("test", self.test_f), ("seen", self.seen_f))}  # fmt: skip
        if self.questions_f is not None:
            hits, rows = sequence_hits(self.drafter, self.model.params, scored,
                                       self.questions_f, self.args.ttt)  # fmt: skip
            result["questions"] = hits.sum(0) / rows.sum()
            if categories:
                result["questions_by_category"] = by_category(
                    hits, rows, self.questions_f["categories"])  # fmt: skip
        return result

    def log_accuracy(self, step: int, accuracy: dict) -> list[dict]:
        """Top-1 per step at `step` into the run's record -> the record's history."""
        entry = {split: [round(float(x), 4) for x in acc[:, 0]] for split, acc in accuracy.items()}
        history = {e["step"]: e for e in run_record(self.work, self.args).get("history", [])}
        history[step] = {"step": step, **entry}
        history = [history[k] for k in sorted(history)]
        run_record(self.work, self.args, {"history": history})
        shown = ", ".join(f"{split} {top1}" for split, top1 in entry.items())
        tqdm.write(f"step {step}: top-1 per step {shown}")
        return history

    def fresh(self):
        return self.drafter.init(self.model.params)

    def step(self, state, step):
        args = self.args
        if args.eval_every and step == 0:  # where it starts (--init: the drafter's own)
            self.log_accuracy(0, self.accuracy(state["params"]))
        rng = np.random.default_rng([args.seed, step])  # a resumed run sees the same batches
        seqs = rng.integers(0, len(self.train_f["tokens"]), args.batch)
        rows = sample_rows(self.train_f, seqs, args.rows, args.ttt, rng, args.rows_within)
        tokens = jnp.asarray(self.train_f["tokens"][seqs])
        if args.states == "live":
            states = live_states(self.frozen, tokens, cfg=self.cfg, layers=self.stored)
            fused3, last = fused_and_last(states, self.stored, self.drafter.layers)
        else:
            fused3, last = cached_fused_and_last(self.train_f, seqs, self.drafter.layers)
        state, aux = train_step(
            state, self.model.params, tokens, fused3, last, jnp.asarray(rows), self.weights,
            self.vocab, jnp.uint32(rng.integers(1 << 32)), drafter=self.drafter,
            optimizer=self.optimizer, steps=args.ttt, width=self.width, noise=args.feature_noise,
            top=args.loss_top,
        )  # fmt: skip
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            self.log_accuracy(step + 1, self.accuracy(state["params"]))
        return state, aux

    def shown(self, aux):
        return {"loss": " ".join(f"{x:.2f}" for x in np.asarray(aux))}

    def finish(self, state, aux) -> Result:
        args, cfg = self.args, self.cfg
        record = self.record(lambda: {
            "final_loss_per_step": [round(float(x), 4) for x in np.asarray(aux)],
        })  # fmt: skip
        params = state["params"]
        both = self.accuracy(params, categories=True)
        categories = both.pop("questions_by_category", None)
        accuracy = both["test"]
        history = record.get("history", [])  # --eval-every's, of every invocation
        if args.eval_every:
            history = self.log_accuracy(int(state["step"]), both)
        settings = EagleSettings(
            layers=self.drafter.layers, depth=args.depth, blocks=args.blocks,
            trees=searched_trees(accuracy),
            cpu_tree="chain-1", gpu_tree="dynamic-64",
        )  # fmt: skip
        data, coverage = {}, None
        if self.vocab_ids is not None:
            data["draft_vocab"] = self.vocab_ids
            coverage = vocab_coverage(self.test_f, self.vocab_ids)
        report = {
            "steps": int(state["step"]),
            **record,
            "draft_vocab_size": None if self.vocab_ids is None else len(self.vocab_ids),
            "draft_vocab_test_coverage": coverage,
            "test_topk_accuracy": [[round(float(x), 4) for x in row] for row in accuracy],
            "seen_topk_accuracy": [[round(float(x), 4) for x in row] for row in both["seen"]],
            "seen_answers": len(self.seen_f["tokens"]),
            "draws_per_answer": round(
                int(state["step"]) * args.batch / len(self.train_f["tokens"]), 2
            ),
            "history": history,
        }
        if self.questions_f is not None:
            report["questions"] = args.eval_questions
            report["questions_answers"] = len(self.questions_f["tokens"])
            report["questions_topk_accuracy"] = [[round(float(x), 4) for x in row]
                                                 for row in both["questions"]]  # fmt: skip
            report["questions_top1_by_category"] = {
                c: [round(float(x), 4) for x in top1] for c, top1 in categories.items()
            }
        params16 = jax.tree.map(lambda x: np.asarray(x, np.float16), params)
        return Result(report, settings, params16, card(args, cfg, self.drafter, report),
                      self.test_f, data)  # fmt: skip


def train(argv) -> dict:
    return skeleton.train(Eagle, parse_args(argv))


def card(args, cfg, drafter, report) -> str:
    rows = "\n".join(
        f"| {k + 1} | " + " | ".join(f"{x:.3f}" for x in acc) + " |"
        for k, acc in enumerate(report["test_topk_accuracy"])
    )
    seen = " / ".join(f"{acc[0]:.3f}" for acc in report["seen_topk_accuracy"])
    questions = ""
    if "questions_topk_accuracy" in report:
        top1 = " / ".join(f"{acc[0]:.3f}" for acc in report["questions_topk_accuracy"])
        questions = (f"\nTop-1 per step on the base model's answers to the first turns of "
                     f"{report['questions_answers']} questions of {report['questions']}\n"
                     f"(`--eval-questions`): {top1}; at step 1 by category: "
                     + ", ".join(f"{c} {acc[0]:.3f}"
                                 for c, acc in report["questions_top1_by_category"].items())
                     + ".\n")  # fmt: skip
    history = ""
    if report["history"]:
        lines = "".join(
            f"| {e['step']} | {' / '.join(f'{x:.3f}' for x in e['test'])} | "
            f"{' / '.join(f'{x:.3f}' for x in e['seen'])} |\n"
            for e in report["history"]
        )
        history = ("\nTop-1 per step during training (`--eval-every`):\n\n"
                   f"| step | test | seen |\n|---|---|---|\n{lines}")  # fmt: skip
    prompts = {
        "first": f"the first user turns of {args.train_seqs}\n  ShareGPT train-split conversations",
        "every": f"{args.train_seqs} user turns of ShareGPT train-split conversations,\n  each "
        "with the conversation before it",
        "later": f"{args.train_seqs} user turns after the first of ShareGPT train-split\n  "
        "conversations, each with the conversation before it",
        "grounded": f"{args.train_seqs} ShareGPT train-split conversations' first replies, each "
        "handed\n  back with a request to summarise it or answer the first turn from it",
        "written": f"{args.train_seqs} user turns the model wrote itself (train/written.py)",
    }[args.turns]
    skipped = ""
    if args.skip_prompts:
        turns, n, prompt_len = prompt_set(args.skip_prompts)
        skipped = (f";\n  left out: those among the first {n} '{turns}' prompts of <= "
                   f"{prompt_len} tokens (`--skip-prompts`)")  # fmt: skip
    answers = (
        "the base model's own greedy answers"
        if args.answers == "self"
        else "the conversations' own (ChatGPT's) replies"
    )
    within = f" (of each answer's first {args.rows_within})" if args.rows_within else ""
    noise = ""
    if args.feature_noise:
        noise = f", the fused states' elements times 1 + {args.feature_noise:g} N(0,1)"
    target = "next-token distribution"
    if args.loss_top:
        target = f"{args.loss_top} most probable next tokens (the rest zeroed)"
    vocab = "the whole vocabulary"
    if args.keep_vocab or args.guess_vocab:
        source = (
            "that of the drafter it started from"
            if args.keep_vocab
            else most_frequent(report["draft_vocab_size"], args.guess_vocab, "--guess-vocab")
        )
        share = report["draft_vocab_test_coverage"]
        vocab = f"{source}, covering {share:.1%} of the test answers' tokens"
    blocks = "One decoder layer (initialised from the base model's last layer)"
    if args.blocks > 1:
        blocks = (f"{args.blocks} decoder layers in turn (initialised from the base model's last "
                  "layer,\n  those past the first with zero output projections)")  # fmt: skip
    return f"""# EAGLE-class drafter for {cfg.name}

- {blocks} on
  [norm(token embedding) ; norm(feature)] -> Linear(2D->D); the feature of a committed
  token fuses the model's states after layers {", ".join(map(str, drafter.layers))} (Linear(3D->D)),
  a drafted token's is the drafter's own output at its parent. Own final norm, the model's
  frozen lm_head over the draft vocabulary. Weights stored in float16.
- Data: {answers} to {prompts} (prompts <= {args.prompt_len}
  tokens, answers <= {args.new_tokens}){skipped}.
- Training: {report["steps"]} steps of {args.batch} sequences, training-time test over
  {args.ttt} steps, {args.rows} scored positions per sequence{within}, cross-entropy to the model's
  {target} over the draft vocabulary, step weights {args.decay}**(k-1), AdamW
  lr {args.lr} cosine{noise}; {report.get("train_minutes")} minutes of training on the machine
  that trained it.
- Final training loss per step: {report.get("final_loss_per_step")}
- Draft vocabulary: {vocab}.
{started_from(args)}- Command: `jaxspec-train eagle {command_flags(args)}`

Test-split accuracy ({args.test_seqs} ShareGPT test conversations), top-1..5 against the
base model's greedy tokens (earlier path tokens the true ones); step k = depth k:

| step | top-1 | top-2 | top-3 | top-4 | top-5 |
|---|---|---|---|---|---|
{rows}

Top-1 per step on the first {report["seen_answers"]} training answers (a training answer was
drawn {report["draws_per_answer"]} times on average): {seen}. Its margin over the test split's
is what the drafter remembers of the answers it trained on rather than what carries over.
{questions}{history}"""


def main(argv=None) -> None:
    train(argv)
