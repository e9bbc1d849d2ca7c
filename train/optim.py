"""What the drafter trainers share around the optimizer."""

from __future__ import annotations

import optax


def paper_schedule_adamw(lr: float, steps: int):
    """SDSAT's recipe: AdamW (beta2 0.95), warm-up over the first fifth, cosine to lr/5."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(steps // 5, 1), steps, end_value=lr / 5
    )
    return optax.adamw(schedule, b2=0.95, weight_decay=0.0)


def apply_grads(state: dict, grads, optimizer) -> dict:
    """One optimizer update of a {"params", "opt_state", "step"} training state."""
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return {
        "params": optax.apply_updates(state["params"], updates),
        "opt_state": opt_state,
        "step": state["step"] + 1,
    }
