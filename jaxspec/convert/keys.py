"""The HF <-> jaxspec key table: HF name -> (jaxspec flat name, transposed?)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxspec.checkpoint import check_params, unflatten_params
from jaxspec.config import LlamaConfig
from jaxspec.errors import JaxspecError
from jaxspec.param_table import entries

# jaxspec name -> (HF name, stored [out, in] in HF?) for each parameter of a block.
_LAYER_KEYS = {
    "input_layernorm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_proj": ("self_attn.k_proj.weight", True),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_proj": ("self_attn.v_proj.weight", True),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "post_attention_layernorm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
}
_TOP_KEYS = {
    "embed_tokens": ("model.embed_tokens.weight", False),
    "norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
# Present in some HF checkpoints and derivable, so never an error.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_key_table(cfg: LlamaConfig) -> dict[str, tuple[str, bool]]:
    """HF name -> (jaxspec flat name, transposed?) for every parameter `cfg` holds (the
    parameter table says which: biases for Qwen2, q/k norms for Qwen3, no lm_head if tied)."""
    table = {}
    for p, _ in entries(cfg):
        if p.per_layer:
            hf, transposed = _LAYER_KEYS[p.name]
            for i in range(cfg.n_layers):
                table[f"model.layers.{i}.{hf}"] = (f"layers.{i}.{p.name}", transposed)
        else:
            hf, transposed = _TOP_KEYS[p.name]
            table[hf] = (p.name, transposed)
    return table


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: LlamaConfig, source: str) -> dict:
    """HF-named tensors ([out, in] linears) -> jaxspec params; one error lists all problems."""
    table = hf_key_table(cfg)
    ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unexpected = [
        k
        for k in tensors
        if k not in table and k not in ignorable and not k.endswith(_IGNORED_SUFFIXES)
    ]
    missing = [k for k in table if k not in tensors]
    if missing or unexpected:
        problems = [f"missing {k}" for k in missing] + [f"unexpected {k}" for k in unexpected]
        shown = "; ".join(problems[:12]) + (
            f"; ... {len(problems) - 12} more" if len(problems) > 12 else ""
        )
        raise JaxspecError(
            f"{source} does not hold a {cfg.family} checkpoint of its config: {shown}"
        )
    flat = {}
    for hf, (ours, transposed) in table.items():
        w = tensors[hf]
        flat[ours] = w.T if transposed else w
    params = unflatten_params(flat, cfg.n_layers)
    check_params(params, cfg)
    return params


def params_to_hf(flat: Mapping[str, np.ndarray], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """jaxspec flat params -> HF-named tensors ([out, in] linears)."""
    return {
        hf: np.ascontiguousarray(flat[ours].T if transposed else flat[ours])
        for hf, (ours, transposed) in hf_key_table(cfg).items()
    }
