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
from tqdm import tqdm

from jaxspec.checkpoint import save_checkpoint
from jaxspec.drafters.sdsat import SdsatDrafter, extend_vocabulary
from jaxspec.drafters.store import save_drafter
from jaxspec.kv_cache import causal_mask
from jaxspec.llama import forward
from train.checkpoints import resume_training, run_record, save
from train.optim import apply_grads, paper_schedule_adamw


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


def train_full(args, model, train_data, work: Path, out: Path, evaluate) -> dict:
    """Fine-tune every weight; write the checkpoint and its rank-0 drafter to `out`."""
    base = SdsatDrafter(model.cfg, 0, args.ids)
    rows = base.init(model.params, jax.random.key(args.seed))["embed"]
    cfg, params = extend_vocabulary(model.cfg, model.params, rows)
    optimizer = paper_schedule_adamw(args.lr, args.steps)
    manager, state = resume_training(work, args, params, optimizer)
    first_step = int(state["step"])
    S = train_data["tokens"].shape[1]
    losses = (0.0, 0.0, 0.0)
    for step in tqdm(range(first_step, args.steps), desc="train sdsat (full)", unit="step"):
        rng = np.random.default_rng([args.seed, step])
        seqs = rng.integers(0, len(train_data["tokens"]), args.batch)
        starts, lengths = train_data["starts"][seqs], train_data["lengths"][seqs]
        target = np.arange(1, S)[None]
        answer = (target >= starts[:, None]) & (target < lengths[:, None])
        masked, offset = inplace_spans(starts, lengths, S, args.window, args.mask_rate, rng)
        state, losses = full_step(
            state, train_data["tokens"][seqs], answer.astype(np.float32), masked, offset,
            cfg=cfg, optimizer=optimizer, n_ids=args.ids, w=1.0,
        )  # fmt: skip
        save(manager, step + 1, state, last=step + 1 == args.steps)
    manager.wait_until_finished()
    record = run_record(work, args)
    if first_step < args.steps:
        record = run_record(work, args, {
            "final_loss": round(float(losses[0]), 4),
            "final_standard_loss": round(float(losses[1]), 4),
            "final_adaptive_loss": round(float(losses[2]), 4),
        })  # fmt: skip
    tuned = state["params"]
    drafter = SdsatDrafter(cfg, 0, args.ids)
    dparams = {"embed": tuned["embed_tokens"][model.cfg.vocab_size :]}
    report = {"steps": int(state["step"]), **record, "test": evaluate(drafter, tuned, dparams)}
    save_checkpoint(out, cfg, jax.tree.map(lambda x: x.astype(jnp.float32), tuned),
                    model.tokenizer)  # fmt: skip
    settings = {"rank": 0, "n_ids": args.ids, "window": args.window, "cpu_tree": args.cpu_tree,
                "gpu_tree": "comb-8-4", "mode": "full"}  # fmt: skip
    card = f"# SDSAT mode (a) drafter: the adaptive rows of the fine-tuned model in {out}\n"
    save_drafter(out / "sdsat", "sdsat", settings, dparams, cfg, card)
    return report
