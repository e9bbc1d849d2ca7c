"""AR decode speed as a fraction of the memory-bandwidth floor, at any preset's shapes, and
what a tree verify step costs next to it.

Random weights (speed does not depend on their values), made on the device. The floor is
the time to read every parameter and the live cache once per token at the given
bandwidth. Steps are dispatched back to back without a host round trip per token.
`--trees` also times full verify steps (forward of the tree against the cache, greedy
acceptance, Medusa heads drafting the next candidates, commit of the accepted path) and
reports each over the AR step.

    python -m infer.roofline --preset llama-2-7b --bandwidth-gbs 3350   # H100 SXM HBM3
    python -m infer.roofline --preset llama-2-7b --bandwidth-gbs 4800 --trees cpu-16 gpu-32 gpu-63
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoint import default_dtype
from jaxspec.config import preset
from jaxspec.device_bench.shapes import time_steps
from jaxspec.errors import JaxspecError
from jaxspec.llama import compute_params, init_params
from jaxspec.tree import DynamicTree, TreeSpec, tree_preset


def step_ms(cfg, params, tree: TreeSpec, context: int, steps: int, dtype) -> float:
    """Mean ms of one decode step with `tree` (the empty tree: an AR step), `context` tokens
    already in the cache, steps dispatched back to back."""
    return time_steps(cfg, params, dtype, tree, 1, context, steps)["ms_per_step"]


def measure(cfg, bandwidth_gbs: float, context: int, steps: int, dtype, trees=()) -> dict:
    params = compute_params(init_params(cfg, jax.random.key(0), dtype), dtype)
    ms = step_ms(cfg, params, TreeSpec(()), context, steps, dtype)
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (context + steps / 2) * 4
    floor = (cfg.n_params * itemsize + kv_bytes) / (bandwidth_gbs * 1e9)
    result = {
        "model": cfg.name,
        "dtype": str(np.dtype(dtype)),
        "device": str(jax.devices()[0].device_kind),
        "context": context,
        "ms_per_token": ms,
        "floor_ms_per_token": floor * 1e3,
        "fraction_of_floor": floor * 1e3 / ms,
        "tokens_per_s": 1e3 / ms,
    }
    if trees:
        result["verify"] = {}
    for name in trees:
        tree = tree_preset(name)
        verify = step_ms(cfg, params, tree, context, steps, dtype)
        result["verify"][name] = {
            "nodes": tree.n_nodes,
            "depth": tree.max_depth,
            "ms_per_step": verify,
            "over_ar_step": verify / ms,
        }
    return result


def static_tree(name: str) -> str:
    """A static tree preset's name (argparse type): roofline times fixed topologies."""
    try:
        tree = tree_preset(name)
    except JaxspecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if isinstance(tree, DynamicTree):
        raise argparse.ArgumentTypeError(
            f"{name}: roofline times static trees (a dynamic-N step verifies as many rows "
            "as a static N-node tree, plus choosing them): pass gpu-32, cpu-8, comb-D-W ..."
        )
    return name


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m infer.roofline", description=__doc__)
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--bandwidth-gbs", type=float, required=True, help="device memory bandwidth")
    p.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: by backend")
    p.add_argument(
        "--trees",
        nargs="*",
        default=[],
        help="tree presets to time verify steps of",
        type=static_tree,
    )
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype) if args.dtype else default_dtype()
    cfg = preset(args.preset)
    result = measure(cfg, args.bandwidth_gbs, args.context, args.steps, dtype, args.trees)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
