"""Meshes: "data=D,model=M" -> a jax.sharding.Mesh, and where each array of a model lives
on it.

Tensor parallel in Megatron's layout, decided by the parameter table's logical axes alone
(`RULES`): q/k/v and gate/up split over `model` by output columns (heads, MLP), o/down by
rows, the embedding and lm_head by vocabulary; norms replicated. The KV cache [B,K,S,H] is
split by kv heads over `model` and by rows over `data`.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.config import LlamaConfig
from jaxspec.errors import JaxspecError
from jaxspec.param_table import logical_axes

MESH_AXES = ("data", "model")
# logical axis -> mesh axis (None: replicated)
RULES = {"vocab": "model", "heads": "model", "kv_heads": "model", "mlp": "model", "embed": None}
# LlamaConfig sizes that `model` splits, by the logical axis they span
SPLIT_SIZES = {
    "n_heads": "heads",
    "n_kv_heads": "kv_heads",
    "ffn_dim": "mlp",
    "vocab_size": "vocab",
}


def parse_mesh(text: str) -> dict[str, int]:
    """ "data=2,model=4" (either may be left out: 1) -> {"data": 2, "model": 4}."""
    shape = dict.fromkeys(MESH_AXES, 1)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition("=")
        if name not in MESH_AXES or not size.isdigit() or int(size) < 1:
            raise JaxspecError(
                f"--mesh {text!r}: expected AXIS=N pairs with AXIS in {', '.join(MESH_AXES)} "
                "and N >= 1, e.g. --mesh data=1,model=2"
            )
        shape[name] = int(size)
    return shape


def as_mesh(mesh) -> Mesh | None:
    """A mesh from "data=D,model=M", a Mesh as given, None as None (one device)."""
    return make_mesh(parse_mesh(mesh)) if isinstance(mesh, str) else mesh


def make_mesh(shape: dict[str, int], devices=None) -> Mesh:
    """The mesh of shape {"data": D, "model": M} over the first D*M devices."""
    devices = list(devices if devices is not None else jax.devices())
    need = math.prod(shape[a] for a in MESH_AXES)
    if need > len(devices):
        raise JaxspecError(
            f"a mesh of data={shape['data']},model={shape['model']} needs {need} devices, "
            f"{len(devices)} found; on CPU set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={need} before jax starts"
        )
    grid = [devices[i * shape["model"] : (i + 1) * shape["model"]] for i in range(shape["data"])]
    return Mesh(grid, MESH_AXES)


def check_divides(cfg: LlamaConfig, mesh: Mesh) -> None:
    """Every size the `model` axis splits must divide by it; else one error naming them
    and the model sizes that would work."""
    m = mesh.shape["model"]
    sizes = {field: getattr(cfg, field) for field in SPLIT_SIZES}
    bad = [f"{field} {n}" for field, n in sizes.items() if n % m]
    if bad:
        valid = [d for d in range(1, max(sizes.values()) + 1)
                 if all(n % d == 0 for n in sizes.values())]  # fmt: skip
        raise JaxspecError(
            f"model={m} does not divide {', '.join(bad)} of {cfg.name}; model sizes that "
            f"divide every split size: {', '.join(map(str, valid))}"
        )


def param_specs(cfg: LlamaConfig) -> dict:
    """The params tree of PartitionSpecs (RULES applied to each leaf's logical axes)."""
    return jax.tree.map(
        lambda axes: PartitionSpec(*(RULES[a] for a in axes)),
        logical_axes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def shard_params(params: dict, cfg: LlamaConfig, mesh: Mesh) -> dict:
    """The model's params (as stored: [in,out] arrays) placed on the mesh."""
    check_divides(cfg, mesh)
    return jax.tree.map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params, param_specs(cfg)
    )


def cache_spec() -> PartitionSpec:
    """A cache layer's keys or values [B,K,S,H]."""
    return PartitionSpec("data", "model", None, None)


def rows_spec() -> PartitionSpec:
    """Per-row arrays [B, ...] (tokens, lengths)."""
    return PartitionSpec("data")


def shard_cache(cache, mesh: Mesh):
    """A KVCache placed on the mesh: keys/values by rows and kv heads, lengths by rows."""

    def put(x):
        spec = cache_spec() if x.ndim == 4 else rows_spec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(put, cache)
