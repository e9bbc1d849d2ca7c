"""AR decode speed as a fraction of the memory-bandwidth floor, at any preset's shapes.

Random weights (speed does not depend on their values), made on the device. The floor is
the time to read every parameter and the live cache once per token at the given
bandwidth. Steps are dispatched back to back without a host round trip per token.

    python -m infer.roofline --preset llama-2-7b --bandwidth-gbs 3350   # H100 SXM HBM3
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoint import default_dtype
from jaxspec.config import preset
from jaxspec.decode import NoDrafter, speculative_step
from jaxspec.kv_cache import commit, init_cache
from jaxspec.llama import init_params
from jaxspec.sampling import Sampling
from jaxspec.tree import TreeSpec


def measure(cfg, bandwidth_gbs: float, context: int, steps: int, dtype) -> dict:
    params = init_params(cfg, jax.random.key(0), dtype)
    cache = init_cache(cfg, 1, context + steps + 1)  # activations and cache: float32
    cache = cache.replace(lengths=jnp.array([context], jnp.int32))
    token, key = jnp.zeros((1,), jnp.int32), jax.random.key(0)
    no_candidates = jnp.zeros((1, 0), jnp.int32)
    static = dict(cfg=cfg, sampling=Sampling(), tree=TreeSpec(()), drafter=NoDrafter())

    def run(n, cache, token):  # plain AR: the empty tree
        for _ in range(n):
            _, one, token, _, block, _ = speculative_step(
                params, None, cache, token, no_candidates, key, None, **static
            )
            cache = commit(cache, block, one)
        jax.block_until_ready(token)
        return cache, token

    cache, token = run(3, cache, token)  # compile and warm up
    start = time.perf_counter()
    run(steps, cache, token)
    seconds = (time.perf_counter() - start) / steps
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (context + steps / 2) * 4
    floor = (cfg.n_params * itemsize + kv_bytes) / (bandwidth_gbs * 1e9)
    return {
        "model": cfg.name,
        "dtype": str(np.dtype(dtype)),
        "device": str(jax.devices()[0].device_kind),
        "context": context,
        "ms_per_token": seconds * 1e3,
        "floor_ms_per_token": floor * 1e3,
        "fraction_of_floor": floor / seconds,
        "tokens_per_s": 1 / seconds,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m infer.roofline", description=__doc__)
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--bandwidth-gbs", type=float, required=True, help="device memory bandwidth")
    p.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: by backend")
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype) if args.dtype else default_dtype()
    result = measure(preset(args.preset), args.bandwidth_gbs, args.context, args.steps, dtype)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
