"""A model's weights fingerprint: which weights a drafter was trained for, and whose data a
training folder holds, when two models share a name (a fine-tune's config.json often keeps
its base's)."""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxspec.layers import OutIn, PlainProducts

SAMPLE = 32  # elements taken from each end of a weight
# the config's sizes (its constants differ by file format: a GGUF's float32 norm_eps, its
# RoPE frequency factors where HF names the llama3 scaling)
SHAPE = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim")


def fingerprint(model) -> str:
    """The model's (cfg, params) sizes and the first and last SAMPLE elements of every weight
    as bfloat16 bits: the same for one model in either dtype, from any file format, on any
    mesh or process group; different for other weights."""
    shape = {k: getattr(model.cfg, k) for k in SHAPE}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode())
    flat = jax.tree_util.tree_flatten_with_path(
        model.params, is_leaf=lambda x: isinstance(x, (OutIn, PlainProducts))
    )[0]
    paths = [jax.tree_util.keystr(path) for path, _ in flat]
    samples = [  # a weight split over processes: each process gathers its whole sample
        s if s.is_fully_addressable else multihost_utils.process_allgather(s, tiled=True)
        for s in _samples([leaf for _, leaf in flat])
    ]
    for path, sample in zip(paths, samples, strict=True):
        digest.update(path.encode())
        digest.update(np.asarray(sample).view(np.uint16).tobytes())
    return digest.hexdigest()[:20]


@jax.jit
def _samples(leaves: list) -> list[jax.Array]:
    """Each weight's first SAMPLE and last SAMPLE elements in its [in,out] order, as
    bfloat16 [<= 2*SAMPLE] (an OutIn stores [out,in])."""
    out = []
    for leaf in leaves:
        while isinstance(leaf, PlainProducts):
            leaf = leaf.w
        if isinstance(leaf, OutIn):
            w = leaf.w  # [out,in]
            first, last = w[:SAMPLE, 0], w[-SAMPLE:, -1]
        elif leaf.ndim == 0:
            first = last = leaf[None]
        else:
            corner = (0,) * (leaf.ndim - 1)
            first, last = leaf[corner][:SAMPLE], leaf[tuple(-1 for _ in corner)][-SAMPLE:]
        out.append(jnp.concatenate([first, last]).astype(jnp.bfloat16))
    return out
