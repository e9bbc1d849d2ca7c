"""Forward time of a model against its cache vs the number of new rows T (1 = an AR step,
T = a verify step over a T-node tree), per weight dtype: what a tree may cost here.

    python -m infer.rowcost --dtype float32 bfloat16 bfloat16-in-out --rows 1 2 4 8 16

`bfloat16-in-out` keeps bfloat16 weights in the stored [in,out] order instead of the
[out,in] order decoding uses (`llama.compute_params`): the A/B behind that choice.
`--sdsat [DIR]` adds, per dtype, the same forwards with an SDSAT adapter (default: the
shipped one) acting on the second half of the rows (as in its one-forward loop: half tree
rows, half adaptive rows).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kv_cache import causal_mask, init_cache
from jaxspec.llama import compute_params, embed, forward
from jaxspec.models import DTYPES, load_model

IN_OUT = "bfloat16-in-out"


def forward_ms(cfg, params, rows: int, context: int, repeats: int, adapter=None) -> float:
    """Median ms of one forward (to the logits) of `rows` new tokens after `context`
    committed ones; adapter: (SdsatDrafter, its params) acting on the last rows // 2."""
    cache = init_cache(cfg, 1, context + rows).replace(lengths=jnp.array([context], jnp.int32))
    tokens = jnp.ones((1, rows), jnp.int32)
    positions = context + jnp.arange(rows)[None]
    mask = causal_mask(1, rows)
    if adapter is None:
        run = jax.jit(lambda p, t, c: forward(p, cfg, t, positions, c, mask)[0])
    else:
        drafter, dparams = adapter
        adaptive = jnp.arange(rows)[None] >= rows - rows // 2
        run = jax.jit(
            lambda p, t, c: drafter.adapted_logits(
                p, dparams, embed(p, t), positions, c, mask, adaptive
            )
        )
    run = run.lower(params, tokens, cache).compile()
    for _ in range(3):
        run(params, tokens, cache).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(params, tokens, cache).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def load_sdsat(model, folder: Path | None):
    """-> (the SDSAT drafter in `folder` (None: the shipped one), its stored params)."""
    from jaxspec.drafters.store import load_drafter
    from jaxspec.methods import make_drafter, shipped_drafter

    folder = folder or shipped_drafter(model.cfg, "sdsat")
    stored = load_drafter(folder, "sdsat", model.cfg)
    return make_drafter("sdsat", model.cfg, stored.settings), stored.params


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m infer.rowcost", description=__doc__)
    p.add_argument("--dtype", nargs="+", choices=(*DTYPES, IN_OUT), default=["float32"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--model", type=Path, help="a jaxspec checkpoint (default: the default model)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--sdsat",
        nargs="?",
        const="",
        metavar="DIR",
        help="also time with an SDSAT adapter (DIR; default: the shipped one)",
    )
    args = p.parse_args(argv)
    model = load_model(args.model)
    sdsat = None
    if args.sdsat is not None:  # "" (the flag alone): the shipped adapter
        sdsat = load_sdsat(model, Path(args.sdsat) if args.sdsat else None)
    result = {"model": model.cfg.name, "device": jax.devices()[0].device_kind, "ms": {}}
    for dtype in args.dtype:
        if dtype == IN_OUT:
            params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), model.params)
        else:
            params = compute_params(model.params, dtype)
        result["ms"][dtype] = {
            rows: round(forward_ms(model.cfg, params, rows, args.context, args.repeats), 1)
            for rows in args.rows
        }
        if sdsat is not None:
            drafter, dparams = sdsat
            adapter = drafter, compute_params(dparams, jax.tree.leaves(params)[0].dtype)
            result["ms"][f"{dtype}+sdsat"] = {
                rows: round(
                    forward_ms(model.cfg, params, rows, args.context, args.repeats, adapter), 1
                )
                for rows in args.rows
            }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
