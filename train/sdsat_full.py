"""SDSAT mode (a), the paper's full fine-tuning (`jaxspec-train sdsat --mode full`).

The vocabulary is extended with the adaptive ids (jaxspec.drafters.sdsat.extend_vocabulary)
and every weight trains on the paper's two sequence types (§2.2): the standard sequence
(next-token cross-entropy f(Y_hat, Y) over the answer) and the same sequence with spans
replaced in place by adaptive tokens (about `--mask-rate` of the answer positions start a
span, its length uniform in 1..L; f(M_hat, Y_M) at the replaced positions only), combined
as 1/2 (f(Y_hat, Y) + w f(M_hat, Y_M)); `--loss basic` trains Appendix A's baseline
instead, f(M_hat, Y_M) over every answer target of the mixed sequence. Output: a full
jaxspec checkpoint (`--out`, not committed) whose model both drafts and verifies, with its
drafter folder `sdsat/` (rank 0: the adaptive rows only). Generation with it is lossless
against the *fine-tuned* model.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.checkpoint import jaxspec_home, save_checkpoint
from jaxspec.drafters.sdsat import SdsatDrafter, SdsatSettings, extend_vocabulary
from jaxspec.drafters.store import save_drafter
from jaxspec.kv_cache import causal_mask
from jaxspec.llama import forward

from .checkpoints import resume_training
from .optim import apply_grads
from .sdsat import Sdsat
from .skeleton import Result


def inplace_spans(starts, lengths, S: int, L: int, rate: float, rng):
    """-> masked [B,S] bool and offset [B,S] (index inside its span): each answer position
    starts a span with probability `rate`, of length uniform in 1..L, kept inside the
    sequence (its last token is never replaced: it has no target). A span follows an
    ordinary token: starts inside an earlier span are skipped."""
    B = len(starts)
    masked, offset = np.zeros((B, S), bool), np.zeros((B, S), np.int32)
    for b in range(B):
        stop = 0
        for i in np.flatnonzero(rng.random(S) < rate):
            if not max(starts[b] - 1, stop) <= i < lengths[b] - 2:
                continue
            stop = min(i + 1 + int(rng.integers(1, L + 1)), lengths[b] - 1)
            masked[b, i + 1 : stop] = True
            offset[b, i + 1 : stop] = np.arange(stop - i - 1)
    return masked, offset


def token_losses(params, cfg, tokens, labels=None):
    """Next-token cross-entropy [B,S-1] of the model run on tokens [B,S], each position's
    target the next token of `labels` [B,S] (default: tokens; a mixed sequence's labels are
    the clean tokens)."""
    B, S = tokens.shape
    logits, _, _ = forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(S), (B, S)), None,
                           causal_mask(B, S))  # fmt: skip
    labels = tokens if labels is None else labels
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels[:, 1:])


def weighted_mean(ce, weights):
    return (ce * weights).sum() / jnp.maximum(weights.sum(), 1)


@partial(
    jax.jit, static_argnames=("cfg", "optimizer", "n_ids", "w", "loss"), donate_argnames=("state",)
)
def full_step(state, tokens, answer, masked, offset, *, cfg, optimizer, n_ids, w, loss):
    """tokens [B,S]; answer [B,S-1]: targets inside the answer; masked/offset [B,S].
    -> (state, (loss, standard-token loss, adaptive-token loss)). `loss` "improved" (Eq. 9):
    1/2 (f(Y_hat, Y) + w f(M_hat, Y_M) M_mask), its standard tokens those of the clean
    sequence; "basic" (Eq. 8): f(M_hat, Y_M) over every answer target of the mixed sequence,
    its standard tokens the mixed sequence's ordinary inputs (Appendix A's Fig. 5)."""
    adaptive_ids = cfg.vocab_size - n_ids + jnp.minimum(offset, n_ids - 1)
    mixed = jnp.where(masked, adaptive_ids, tokens)
    at_adaptive = answer * masked[:, :-1]  # targets whose input is an adaptive token

    def loss_fn(params):
        mixed_ce = token_losses(params, cfg, mixed, tokens)  # Y_M: never an adaptive id
        adapted = weighted_mean(mixed_ce, at_adaptive)
        if loss == "basic":
            standard = weighted_mean(mixed_ce, answer - at_adaptive)
            return weighted_mean(mixed_ce, answer), (standard, adapted)
        standard = weighted_mean(token_losses(params, cfg, tokens), answer)
        return 0.5 * (standard + w * adapted), (standard, adapted)

    (value, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    new = apply_grads(state, grads, optimizer)
    return new, (value, *parts)


@partial(jax.jit, static_argnames=("cfg",))
def clean_loss(params, tokens, answer, *, cfg):
    """The sums of next-token cross-entropy over the answer targets and their count."""
    return (token_losses(params, cfg, tokens) * answer).sum(), answer.sum()


def answer_targets(starts, lengths, S: int) -> np.ndarray:
    """[B,S-1] float32: 1 where the target token (position 1..S-1) is inside the answer."""
    target = np.arange(1, S)[None]
    return ((target >= starts[:, None]) & (target < lengths[:, None])).astype(np.float32)


def clean_answer_loss(params, cfg, data: dict, batch: int = 4) -> float:
    """Mean next-token cross-entropy of the clean test answers (no adaptive token anywhere:
    the model's quality as inference uses it on ordinary tokens)."""
    total = count = 0.0
    S = data["tokens"].shape[1]
    for start in range(0, len(data["tokens"]), batch):
        rows = slice(start, start + batch)
        answer = answer_targets(data["starts"][rows], data["lengths"][rows], S)
        s, n = clean_loss(params, data["tokens"][rows], answer, cfg=cfg)
        total, count = total + float(s), count + float(n)
    return total / count


class FullSdsat(Sdsat):
    """Mode (a): every weight of the model with the vocabulary extended (no --init)."""

    folder, desc = "sdsat-full", "train sdsat (full)"
    data_parallel = False  # its step trains the whole model, in one piece
    wrote = "wrote the fine-tuned model to {out} (its drafter: {out}/sdsat)"

    def default_out(self) -> Path:
        return jaxspec_home() / "models" / f"{self.cfg.folder_name}-sdsat-full"  # repro.sdsat_study

    def prepare(self) -> None:
        """The answers and the model with the adaptive ids' rows (the mean embedding)."""
        self.train_data, self.test_data = self.answers()
        rows = SdsatDrafter(self.cfg, 0, self.args.ids).init(
            self.model.params, jax.random.key(self.args.seed)
        )["embed"]
        self.tuned_cfg, self.extended = extend_vocabulary(self.cfg, self.model.params, rows)
        # before training: the training state shares (and donates) the original's arrays
        self.original_loss = clean_answer_loss(self.model.params, self.cfg, self.test_data)

    def start(self):
        """From the extended model (--init is an adapter's: not for this mode)."""
        manager, state = resume_training(self.work, self.args, self.extended, self.optimizer)
        self.curve = []  # this invocation's (standard, adaptive) losses per step
        return manager, self.replicated(state)

    def step(self, state, step):
        args, data = self.args, self.train_data
        rng = np.random.default_rng([args.seed, step])
        seqs = rng.integers(0, len(data["tokens"]), args.batch)
        starts, lengths = data["starts"][seqs], data["lengths"][seqs]
        S = data["tokens"].shape[1]
        masked, offset = inplace_spans(starts, lengths, S, args.window, args.mask_rate, rng)
        state, aux = full_step(
            state, data["tokens"][seqs], answer_targets(starts, lengths, S), masked, offset,
            cfg=self.tuned_cfg, optimizer=self.optimizer, n_ids=args.ids, w=1.0, loss=args.loss,
        )  # fmt: skip
        self.curve.append(aux[1:])
        return state, aux

    def loss_curve(self, every: int = 10) -> dict:
        """This invocation's standard and adaptive training losses, averaged over windows of
        `every` steps (a resumed run's curve starts where it resumed)."""
        losses = np.asarray([[float(x) for x in step] for step in self.curve])  # [steps,2]
        windows = [losses[i : i + every].mean(0) for i in range(0, len(losses), every)]
        return {
            "from_step": self.first_step,
            "every": every,
            "standard": [round(float(w[0]), 4) for w in windows],
            "adaptive": [round(float(w[1]), 4) for w in windows],
        }

    def shown(self, aux):
        return {}  # the bar shows steps only

    def finish(self, state, aux) -> Result:
        """The fine-tuned model (kept for `save`) and its drafter: the adaptive rows."""
        args = self.args
        record = self.record(lambda: {
            "final_loss": round(float(aux[0]), 4),
            "final_standard_loss": round(float(aux[1]), 4),
            "final_adaptive_loss": round(float(aux[2]), 4),
            "loss_curve": self.loss_curve(),
        }, minutes=False)  # fmt: skip
        self.tuned = state["params"]
        drafter = SdsatDrafter(self.tuned_cfg, 0, args.ids)
        dparams = {"embed": self.tuned["embed_tokens"][self.cfg.vocab_size :]}
        evaluation = self.evaluate_test(drafter, self.tuned, dparams)
        evaluation["standard_loss"] = round(clean_answer_loss(self.tuned, self.tuned_cfg,
                                                               self.test_data), 4)  # fmt: skip
        evaluation["standard_loss_original"] = round(self.original_loss, 4)
        report = {"steps": int(state["step"]), **record, "test": evaluation}
        settings = SdsatSettings(rank=0, n_ids=args.ids, window=args.window,
                                 cpu_tree=args.cpu_tree, gpu_tree="comb-8-4")  # fmt: skip
        card = (
            f"# SDSAT mode (a) drafter: the adaptive rows of the fine-tuned model in {self.out}\n"
        )
        return Result(report, settings, dparams, card)

    def save(self, result: Result) -> None:
        """The whole fine-tuned checkpoint in --out, its drafter in --out/sdsat."""
        tuned = jax.tree.map(lambda x: x.astype(jnp.float32), self.tuned)
        save_checkpoint(self.out, self.tuned_cfg, tuned, self.model.tokenizer)
        save_drafter(self.out / "sdsat", "sdsat", result.settings, result.params, self.tuned_cfg,
                     result.card)  # fmt: skip
