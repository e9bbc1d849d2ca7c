"""The Llama model's parameters, written once: name, shape, logical axes, initialiser.

`TABLE` below is the single source of the parameter layout. `llama.init_params` builds
params from it, `checkpoint.expected_shapes` and `LlamaConfig.n_params` derive from it, and
`logical_axes` gives the tree of logical axis names a sharding rule table maps to mesh
axes. Names mirror HF; linear weights are stored [in, out] (HF stores [out, in]). Shapes
are products of LlamaConfig size fields, drawn with the axis legend (V vocab_size, D dim,
N n_heads, K n_kv_heads, H head_dim, F ffn_dim, L n_layers). Per-layer entries sit in each
of the L dicts of params["layers"]. This docstring's layout is rendered from the table:
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only its fields are read: config.py imports this module
    from jaxspec.config import LlamaConfig

# Logical axis names (what a sharding rule table maps to mesh axes) and what each spans.
AXES: dict[str, str] = {
    "vocab": "V, the vocabulary",
    "embed": "D, the model (residual) dimension",
    "heads": "N*H, the query heads' outputs (heads x head dim, fused as stored)",
    "kv_heads": "K*H, the key/value heads' outputs (heads x head dim, fused as stored)",
    "mlp": "F, the MLP hidden dimension",
    "head_dim": "H, one head's dimension (the per-head q/k norms, shared by every head)",
}

# The axis legend's letter for each LlamaConfig size field a shape may name.
LETTERS: dict[str, str] = {
    "vocab_size": "V",
    "dim": "D",
    "n_heads": "N",
    "n_kv_heads": "K",
    "head_dim": "H",
    "ffn_dim": "F",
    "n_layers": "L",
}


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter. `dims`: per dimension, a "*"-joined product of LlamaConfig size fields;
    `axes`: per dimension, its logical axis name; `init`: "normal" (scale * N(0, 1), a
    weight), "ones" (a norm) or "zeros" (a bias); `absent_if` / `present_if`: a boolean
    LlamaConfig field that, when true / false, drops the parameter."""

    name: str
    dims: tuple[str, ...]
    axes: tuple[str, ...]
    per_layer: bool = False
    init: str = "normal"
    absent_if: str | None = None
    present_if: str | None = None

    def shape(self, cfg: LlamaConfig) -> tuple[int, ...]:
        return tuple(math.prod(getattr(cfg, f) for f in d.split("*")) for d in self.dims)

    def present(self, cfg: LlamaConfig) -> bool:
        absent = self.absent_if is not None and getattr(cfg, self.absent_if)
        return not absent and (self.present_if is None or getattr(cfg, self.present_if))


def _layer(name, dims, axes, init: str = "normal", present_if: str | None = None) -> Param:
    return Param(name, dims, axes, per_layer=True, init=init, present_if=present_if)


# Top level first, then one layer's entries, each in HF's order.
TABLE: tuple[Param, ...] = (
    Param("embed_tokens", ("vocab_size", "dim"), ("vocab", "embed")),
    Param("norm", ("dim",), ("embed",), init="ones"),
    Param("lm_head", ("dim", "vocab_size"), ("embed", "vocab"), absent_if="tie_embeddings"),
    _layer("input_layernorm", ("dim",), ("embed",), init="ones"),
    _layer("q_proj", ("dim", "n_heads*head_dim"), ("embed", "heads")),
    _layer("q_bias", ("n_heads*head_dim",), ("heads",), "zeros", present_if="qkv_bias"),
    _layer("k_proj", ("dim", "n_kv_heads*head_dim"), ("embed", "kv_heads")),
    _layer("k_bias", ("n_kv_heads*head_dim",), ("kv_heads",), "zeros", present_if="qkv_bias"),
    _layer("v_proj", ("dim", "n_kv_heads*head_dim"), ("embed", "kv_heads")),
    _layer("v_bias", ("n_kv_heads*head_dim",), ("kv_heads",), "zeros", present_if="qkv_bias"),
    _layer("o_proj", ("n_heads*head_dim", "dim"), ("heads", "embed")),
    _layer("q_norm", ("head_dim",), ("head_dim",), "ones", present_if="qk_norm"),
    _layer("k_norm", ("head_dim",), ("head_dim",), "ones", present_if="qk_norm"),
    _layer("post_attention_layernorm", ("dim",), ("embed",), init="ones"),
    _layer("gate_proj", ("dim", "ffn_dim"), ("embed", "mlp")),
    _layer("up_proj", ("dim", "ffn_dim"), ("embed", "mlp")),
    _layer("down_proj", ("ffn_dim", "dim"), ("mlp", "embed")),
)


def entries(cfg: LlamaConfig) -> Iterator[tuple[Param, tuple[int, ...]]]:
    """(entry, shape) of every parameter `cfg` holds: the top level's, then one layer's."""
    for p in TABLE:
        if p.present(cfg):
            yield p, p.shape(cfg)


def build(cfg: LlamaConfig, leaf: Callable[[Param, tuple[int, ...]], Any]) -> dict:
    """A tree shaped like params: {top-level name: leaf, ..., "layers": [{name: leaf}] * L}."""
    tree = {p.name: leaf(p, shape) for p, shape in entries(cfg) if not p.per_layer}
    tree["layers"] = [
        {p.name: leaf(p, shape) for p, shape in entries(cfg) if p.per_layer}
        for _ in range(cfg.n_layers)
    ]
    return tree


def param_shapes(cfg: LlamaConfig) -> dict:
    """The params tree with each leaf's shape tuple in its place."""
    return build(cfg, lambda _, shape: shape)


def logical_axes(cfg: LlamaConfig) -> dict:
    """The params tree with each leaf's logical axis names (a tuple, one name per dimension,
    from AXES) in its place. Tuples are pytree nodes: map with params as the first tree,
    `jax.tree.map(f, params, logical_axes(cfg))`, or pass `is_leaf=lambda x:
    isinstance(x, tuple)`."""
    return build(cfg, lambda p, _: p.axes)


def param_count(cfg: LlamaConfig) -> int:
    """Number of scalars in the params."""
    return sum(math.prod(shape) * (cfg.n_layers if p.per_layer else 1) for p, shape in entries(cfg))


def layout() -> str:
    """The table drawn as the params tree, with logical axes and conditions as comments."""

    def line(p: Param, indent: str) -> str:
        shape = ", ".join("*".join(LETTERS[f] for f in d.split("*")) for d in p.dims)
        notes = [", ".join(p.axes)]
        if p.init != "normal":
            notes.append(p.init)
        if p.absent_if:
            notes.append(f"absent when {p.absent_if}")
        if p.present_if:
            notes.append(f"only when {p.present_if}")
        return f'{indent}"{p.name}": [{shape}],'.ljust(48) + "  # " + "; ".join(notes)

    top = [line(p, "    ") for p in TABLE if not p.per_layer]
    layer = [line(p, "        ") for p in TABLE if p.per_layer]
    return "\n".join(
        ["params = {", *top, '    "layers": [{  # L dicts, one per layer', *layer, "    }],", "}"]
    )


__doc__ = f"{__doc__}\n{layout()}\n"
