"""Meshes: "data=D,model=M" -> a jax.sharding.Mesh, and where each array of a model lives
on it.

Tensor parallel in Megatron's layout, decided by the parameter table's logical axes alone
(`RULES`): q/k/v and gate/up split over `model` by output columns (heads, MLP), o/down by
rows, the embedding and lm_head by vocabulary; q/k/v biases like their columns; norms
replicated. The KV cache [B,K,S,H] is
split by kv heads over `model` and by rows over `data`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.config import LlamaConfig
from jaxspec.errors import JaxspecError, option
from jaxspec.param_table import entries, logical_axes

MESH_AXES = ("data", "model")
# logical axis -> mesh axis (None: replicated)
RULES = {"vocab": "model", "heads": "model", "kv_heads": "model", "mlp": "model", "embed": None,
         "head_dim": None}  # fmt: skip
# LlamaConfig sizes that `model` splits, by the logical axis they span
SPLIT_SIZES = {
    "n_heads": "heads",
    "n_kv_heads": "kv_heads",
    "ffn_dim": "mlp",
    "vocab_size": "vocab",
}


MAX_MESH_DEVICES = 1 << 16  # far past any machine (a TPU v5p pod: 8960 chips)


def parse_mesh(text: str) -> dict[str, int]:
    """ "data=2,model=4" (either may be left out: 1) -> {"data": 2, "model": 4}."""
    shape, given = dict.fromkeys(MESH_AXES, 1), []
    parts = [p.strip() for p in text.split(",") if p.strip()]  # a trailing comma: as typed
    for name, _, size in (part.partition("=") for part in parts):
        if name not in MESH_AXES or not size.isdigit() or int(size) < 1 or name in given:
            break
        given.append(name)
        shape[name] = int(size)
    if not parts or len(given) < len(parts):
        raise JaxspecError(
            f"{option('mesh')} {text!r}: expected AXIS=N pairs, each AXIS of "
            f"{', '.join(MESH_AXES)} at most once and N >= 1, e.g. data=1,model=2"
        )
    if (n := math.prod(shape.values())) > MAX_MESH_DEVICES:
        raise JaxspecError(
            f"{option('mesh')} {text!r} asks for {n} devices; a mesh holds at most "
            f"{MAX_MESH_DEVICES}: pick smaller axes"
        )
    return shape


def as_mesh(mesh) -> Mesh | None:
    """A mesh from "data=D,model=M", a Mesh with axes ("data", "model") as given, None as
    None (one device)."""
    if isinstance(mesh, str):
        return make_mesh(parse_mesh(mesh))
    if mesh is None or (isinstance(mesh, Mesh) and mesh.axis_names == MESH_AXES):
        return mesh
    got = f"a Mesh with axes {mesh.axis_names}" if isinstance(mesh, Mesh) else type(mesh).__name__
    raise JaxspecError(
        f'{option("mesh")} is "data=D,model=M" or a jax Mesh with axes {MESH_AXES}, got {got}'
    )


def make_mesh(shape: dict[str, int], devices=None) -> Mesh:
    """The mesh of shape {"data": D, "model": M} (a missing axis: 1) over the first D*M
    devices."""
    shape = {**dict.fromkeys(MESH_AXES, 1), **shape}
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


def mesh_of(params) -> Mesh | None:
    """The mesh of data x model shape that `params` are placed on (load_model(mesh=...)),
    None for arrays on one device."""
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None) if params else None
    mesh = getattr(sharding, "mesh", None)
    return mesh if isinstance(mesh, Mesh) and mesh.axis_names == MESH_AXES else None


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
    return place(params, param_specs(cfg), mesh)


def table_specs(cfg: LlamaConfig, tree) -> object:
    """Any params tree (a drafter's, or the model's already cast for compute) -> its tree
    of PartitionSpecs: a leaf named like a parameter of the table, with the table's shape,
    is split by the table's rules (Chimera's encoder layer, a copy of a decoder layer, is
    split like the model's layers); an OutIn leaf (the [out,in] transpose, layers.OutIn)
    likewise with its axes swapped; every other leaf is replicated."""
    table = {p.name: (shape, p.axes) for p, shape in entries(cfg)}

    def spec(path, x) -> PartitionSpec:
        transposed = bool(path) and isinstance(path[-1], jax.tree_util.GetAttrKey)
        key = path[-2] if transposed and len(path) > 1 else (path[-1] if path else None)
        shape, axes = table.get(getattr(key, "key", None), (None, None))
        if axes is None or getattr(x, "shape", None) is None:
            return PartitionSpec()
        if transposed:
            shape, axes = shape[::-1], axes[::-1]
        return PartitionSpec(*(RULES[a] for a in axes)) if x.shape == shape else PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec, tree)


def place(tree, specs, mesh: Mesh):
    """Each leaf of `tree` put on `mesh` by its PartitionSpec in `specs` (a matching tree)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a generation's arrays live on `mesh` for a batch of `batch` rows: rows over
    `data` (replicated when `data` does not divide the batch), keys/values [B,K,S,H] also
    by kv heads over `model`."""

    mesh: Mesh
    batch: int

    def sharding(self, *axes) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*axes))

    @property
    def data_axis(self) -> str | None:
        return "data" if self.batch % self.mesh.shape["data"] == 0 else None

    @property
    def rows(self) -> NamedSharding:
        """Per-row arrays [B, ...] (tokens, lengths, candidates)."""
        return self.sharding(self.data_axis)

    @property
    def replicated(self) -> NamedSharding:
        return self.sharding()

    @property
    def kv(self) -> NamedSharding:
        """Keys or values [B,K,S,H]: rows over `data`, kv heads over `model`."""
        return self.sharding(self.data_axis, "model", None, None)

    def kv_tree(self, tree):
        """A KVCache or KVBlock (or None) -> its tree of shardings."""
        return jax.tree.map(lambda x: self.kv if x.ndim == 4 else self.rows, tree)

    def placed(self, tree):
        """A tree of arrays already on this mesh -> the tree of their shardings."""
        return jax.tree.map(lambda x: x.sharding, tree)
