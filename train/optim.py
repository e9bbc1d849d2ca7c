"""What the drafter trainers share around the optimizer."""

from __future__ import annotations

import optax


def paper_schedule(lr: float, steps: int):
    """SDSAT's learning rate: warm-up over the first fifth of the steps (at least one, none
    in a one-step run, which would otherwise train at lr 0), then cosine to lr/5."""
    warmup = min(max(steps // 5, 1), steps - 1)
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr / 5)


def apply_grads(state: dict, grads, optimizer) -> dict:
    """One optimizer update of a {"params", "opt_state", "step"} training state."""
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return {
        "params": optax.apply_updates(state["params"], updates),
        "opt_state": opt_state,
        "step": state["step"] + 1,
    }
