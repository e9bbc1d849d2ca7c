"""The HF <-> jaxspec key table: HF name -> (jaxspec flat name, transposed?)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxspec.checkpoint import check_params, unflatten_params
from jaxspec.config import LlamaConfig
from jaxspec.errors import JaxspecError

_LAYER_KEYS = {
    "input_layernorm.weight": ("input_layernorm", False),
    "self_attn.q_proj.weight": ("q_proj", True),
    "self_attn.k_proj.weight": ("k_proj", True),
    "self_attn.v_proj.weight": ("v_proj", True),
    "self_attn.o_proj.weight": ("o_proj", True),
    "post_attention_layernorm.weight": ("post_attention_layernorm", False),
    "mlp.gate_proj.weight": ("gate_proj", True),
    "mlp.up_proj.weight": ("up_proj", True),
    "mlp.down_proj.weight": ("down_proj", True),
}
# Present in some HF checkpoints and derivable, so never an error.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_key_table(cfg: LlamaConfig) -> dict[str, tuple[str, bool]]:
    table = {
        "model.embed_tokens.weight": ("embed_tokens", False),
        "model.norm.weight": ("norm", False),
    }
    if not cfg.tie_embeddings:
        table["lm_head.weight"] = ("lm_head", True)
    for i in range(cfg.n_layers):
        for hf, (ours, transposed) in _LAYER_KEYS.items():
            table[f"model.layers.{i}.{hf}"] = (f"layers.{i}.{ours}", transposed)
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
        raise JaxspecError(f"{source} does not hold a Llama checkpoint of its config: {shown}")
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
