"""SDSAT mode (a), the paper's full fine-tuning (`jaxspec-train sdsat --mode full`).

The vocabulary is extended with the adaptive ids (jaxspec.drafters.sdsat.extend_vocabulary)
and every weight trains on the paper's two sequence types (§2.2): the standard sequence
(next-token cross-entropy f(Y_hat, Y) over the answer) and the same sequence with spans
replaced in place by adaptive tokens (about `--mask-rate` of the answer positions start a
span, its length uniform in 1..L; f(M_hat, Y_M) at the replaced positions only), combined
as 1/2 (f(Y_hat, Y) + w f(M_hat, Y_M)). Output: a full jaxspec checkpoint (`--out`, not
committed) whose model both drafts and verifies, with its drafter folder `sdsat/` (rank 0:
the adaptive rows only). Generation with it is lossless against the *fine-tuned* model.
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


def sequence_loss(params, cfg, tokens, weights):
    """Mean next-token cross-entropy of tokens [B,S] where weights [B,S-1] (the target's)."""
    B, S = tokens.shape
    logits, _, _ = forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(S), (B, S)), None,
                           causal_mask(B, S))  # fmt: skip
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
    return (ce * weights).sum() / jnp.maximum(weights.sum(), 1)


@partial(jax.jit, static_argnames=("cfg", "optimizer", "n_ids", "w"), donate_argnames=("state",))
def full_step(state, tokens, answer, masked, offset, *, cfg, optimizer, n_ids, w):
    """tokens [B,S]; answer [B,S-1]: targets inside the answer; masked/offset [B,S]."""
    adaptive_ids = cfg.vocab_size - n_ids + jnp.minimum(offset, n_ids - 1)
    mixed = jnp.where(masked, adaptive_ids, tokens)

    def loss_fn(params):
        standard = sequence_loss(params, cfg, tokens, answer)
        adapted = sequence_loss(params, cfg, mixed, answer * masked[:, :-1])
        return 0.5 * (standard + w * adapted), (standard, adapted)

    (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    new = apply_grads(state, grads, optimizer)
    return new, (loss, *parts)


class FullSdsat(Sdsat):
    """Mode (a): every weight of the model with the vocabulary extended (no --init)."""

    folder, desc = "sdsat-full", "train sdsat (full)"
    data_parallel = False  # its step trains the whole model, in one piece
    wrote = "wrote the fine-tuned model to {out} (its drafter: {out}/sdsat)"

    def default_out(self) -> Path:
        return jaxspec_home() / "models" / f"{self.cfg.name}-sdsat-full"  # repro.sdsat_study

    def prepare(self) -> None:
        """The answers and the model with the adaptive ids' rows (the mean embedding)."""
        self.train_data, self.test_data = self.answers()
        rows = SdsatDrafter(self.cfg, 0, self.args.ids).init(
            self.model.params, jax.random.key(self.args.seed)
        )["embed"]
        self.tuned_cfg, self.extended = extend_vocabulary(self.cfg, self.model.params, rows)

    def start(self):
        """From the extended model (--init is an adapter's: not for this mode)."""
        manager, state = resume_training(self.work, self.args, self.extended, self.optimizer)
        return manager, self.replicated(state)

    def step(self, state, step):
        args, data = self.args, self.train_data
        rng = np.random.default_rng([args.seed, step])
        seqs = rng.integers(0, len(data["tokens"]), args.batch)
        starts, lengths = data["starts"][seqs], data["lengths"][seqs]
        S = data["tokens"].shape[1]
        target = np.arange(1, S)[None]
        answer = (target >= starts[:, None]) & (target < lengths[:, None])
        masked, offset = inplace_spans(starts, lengths, S, args.window, args.mask_rate, rng)
        return full_step(
            state, data["tokens"][seqs], answer.astype(np.float32), masked, offset,
            cfg=self.tuned_cfg, optimizer=self.optimizer, n_ids=args.ids, w=1.0,
        )  # fmt: skip

    def shown(self, aux):
        return {}  # the bar shows steps only

    def finish(self, state, aux) -> Result:
        """The fine-tuned model (kept for `save`) and its drafter: the adaptive rows."""
        args = self.args
        record = self.record(lambda: {
            "final_loss": round(float(aux[0]), 4),
            "final_standard_loss": round(float(aux[1]), 4),
            "final_adaptive_loss": round(float(aux[2]), 4),
        }, minutes=False)  # fmt: skip
        self.tuned = state["params"]
        drafter = SdsatDrafter(self.tuned_cfg, 0, args.ids)
        dparams = {"embed": self.tuned["embed_tokens"][self.cfg.vocab_size :]}
        evaluation = self.evaluate_test(drafter, self.tuned, dparams)
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
