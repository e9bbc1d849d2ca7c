"""The methods: building a generator for any of them with its shipped (or a given) drafter,
its default tree and its options."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from jaxspec import METHODS
from jaxspec.config import LlamaConfig
from jaxspec.decode import SpeculativeGenerator
from jaxspec.errors import JaxspecError
from jaxspec.llama import compute_params
from jaxspec.models import LoadedModel
from jaxspec.sampling import Sampling
from jaxspec.tree import TreeSpec, tree_preset

DRAFTERS_DIR = Path(__file__).resolve().parent.parent / "drafters"
CPU_TREE = "chain-1"
# SDSAT's loops: the paper's draft step then verify step (the default), or adaptive chains
# in the verify step (jaxspec.drafters.sdsat), whose default tree is chain-1 (the faster of
# chain-1/2 on CPU; not measured on GPU).
SDSAT_LOOPS = ("two-forward", "one-forward")


def provide_devices(n: int) -> None:
    """Ask for n virtual CPU devices (PPD's k + 1 processes) unless XLA_FLAGS already sets a
    count; only effective before jax starts its backends, which it does on first use. On
    CPU the virtual devices share the machine's cores."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def check_method(method: str) -> None:
    if method not in METHODS:
        raise JaxspecError(
            f"unknown or not yet available method {method!r}; available: {', '.join(METHODS)}"
        )


def default_tree(settings: dict) -> str:
    """On CPU the tree measured fastest for the drafter (its `cpu_tree` setting, from a
    BENCHMARKS.md sweep; else a 1-deep chain: larger trees cost more than their extra
    accepted tokens gain there); on accelerators its `gpu_tree`, else its own 64-node
    searched tree when it ships one."""
    if jax.default_backend() == "cpu":
        return settings.get("cpu_tree", CPU_TREE)
    if "gpu_tree" in settings:
        return settings["gpu_tree"]
    return "searched-64" if "searched-64" in settings.get("trees", {}) else "gpu-63"


def resolve_tree(name: str, settings: dict) -> TreeSpec:
    """A tree the drafter ships (its settings["trees"]) or a preset."""
    own = settings.get("trees", {})
    if name in own:
        return TreeSpec.from_paths(own[name])
    try:
        return tree_preset(name)
    except JaxspecError as e:
        if not own:
            raise
        raise JaxspecError(f"{e}; this drafter's own: {', '.join(own)}") from None


def make_drafter(method: str, cfg: LlamaConfig, settings: dict, sdsat_loop: str | None = None):
    if method == "medusa":
        from jaxspec.drafters.medusa import MedusaDrafter

        return MedusaDrafter(cfg, settings["n_heads"], settings.get("own_lm_head", False))
    if method == "sdsat":
        from jaxspec.drafters.sdsat import SdsatDrafter

        one_forward = sdsat_loop == "one-forward"
        return SdsatDrafter(cfg, settings["rank"], settings.get("n_ids", 1), one_forward)
    if method == "chimera":
        from jaxspec.drafters.chimera import ChimeraDrafter

        return ChimeraDrafter(
            cfg,
            settings["n_heads"],
            settings.get("ngram", 3),
            settings.get("residual", True),
            settings.get("cache_size", 0),
            settings.get("full_heads", False),
            settings.get("bottom", "ngram"),
        )
    from jaxspec.drafters.firp import FirpDrafter

    return FirpDrafter(cfg, tuple(settings["layers"]))


def place_firp_chains(drafter, tree: TreeSpec, settings: dict, n_chains: int | None):
    """FIRP with pseudo chains on the n_chains nodes of `tree` likeliest to end a step (None:
    the drafter's `chains` setting; 0 or absent: every node)."""
    n_chains = settings.get("chains", 0) if n_chains is None else n_chains
    if n_chains < 0:
        raise JaxspecError(f"--firp-chains must be >= 0 (0 = every node), got {n_chains}")
    if 0 < n_chains < tree.n_nodes and "test_topk_accuracy" not in settings:
        raise JaxspecError(
            "this FIRP drafter has no measured accuracies to place chains with; "
            "retrain it or use --firp-chains 0 (every node)"
        )
    return drafter.with_chains(tree, settings.get("test_topk_accuracy"), n_chains)


def check_ppd_heads(params: dict, dim: int, folder: Path) -> None:
    """A PPD drafter's params: {"heads": {"layerN": {"w" [D,D], "b" [D]}}}."""
    want = {"w": (dim, dim), "b": (dim,)}
    heads = params.get("heads") if isinstance(params, dict) else None
    bad = [
        name
        for name, head in (heads or {}).items()
        if not isinstance(head, dict)
        or {k: getattr(v, "shape", None) for k, v in head.items()} != want
    ]
    if not heads or bad:
        raise JaxspecError(
            f"PPD heads in {folder} do not fit this model (each needs w [{dim},{dim}] and "
            f"b [{dim}]{'; wrong: ' + ', '.join(bad) if bad else ', none found'}); retrain them"
        )


def build_ppd(model: LoadedModel, drafter_dir: Path | None, sampling, max_len, k, layer):
    """PPD with the shipped early-prediction head for `layer` when there is one (else the
    untrained early exit); layer None: the shipped default, else ceil(d/2)."""
    from jaxspec.drafters.store import load_drafter
    from jaxspec.ppd import PpdGenerator, head_name

    if sampling is not None and not sampling.greedy:
        raise JaxspecError("ppd decodes greedily: drop --temperature (or set it to 0)")
    drafter_dir = drafter_dir or DRAFTERS_DIR / model.cfg.name / "ppd"
    settings, heads = {}, {}
    if drafter_dir.is_dir():
        settings, params = load_drafter(drafter_dir, "ppd", model.cfg)
        check_ppd_heads(params, model.cfg.dim, drafter_dir)
        heads = compute_params(params["heads"], model.weight_dtype)
    layer = layer or settings.get("default_layer") or (model.cfg.n_layers + 1) // 2
    head = heads.get(head_name(layer))
    return PpdGenerator(model.cfg, model.params, k, layer, head, max_len)


def build_generator(
    model: LoadedModel,
    method: str,
    drafter_dir: Path | None = None,
    tree: str | None = None,
    sampling: Sampling | None = None,
    max_len: int | None = None,
    ppd_k: int = 3,
    ppd_layer: int | None = None,
    firp_chains: int | None = None,
    sdsat_loop: str | None = None,
) -> SpeculativeGenerator:
    check_method(method)
    if sampling is not None:
        sampling.check_vocabulary(model.cfg.vocab_size)
    if method == "ppd":
        return build_ppd(model, drafter_dir, sampling, max_len, ppd_k, ppd_layer)
    if method == "ar":
        return SpeculativeGenerator(model.cfg, model.params, sampling=sampling, max_len=max_len)
    from jaxspec.drafters.store import check_weights, load_drafter

    drafter_dir = drafter_dir or DRAFTERS_DIR / model.cfg.name / method
    settings, drafter_params = load_drafter(drafter_dir, method, model.cfg)
    try:
        drafter = make_drafter(method, model.cfg, settings, sdsat_loop)
    except (KeyError, TypeError, ValueError) as e:
        raise JaxspecError(
            f"the settings in {drafter_dir / 'drafter.json'} are incomplete or invalid "
            f"({type(e).__name__}: {e}); retrain the drafter"
        ) from None
    check_weights(drafter, model.params, drafter_params, drafter_dir)
    drafter_params = compute_params(drafter_params, model.weight_dtype)
    drafter_params = drafter.prepare(model.params, drafter_params, settings)
    if method == "sdsat" and drafter.one_forward:  # the other trees are the two-step loop's
        if tree in settings.get("trees", {}):
            raise JaxspecError(
                f"tree {tree!r} was searched for sdsat's two-step loop (its depth 1 is the "
                "model's own token); with the one-forward loop pick a preset: chain-N, comb-D-W"
            )
        tree, settings = tree or CPU_TREE, {}
    spec = resolve_tree(tree or default_tree(settings), settings)
    if method == "firp":
        drafter = place_firp_chains(drafter, spec, settings, firp_chains)
    return SpeculativeGenerator(
        model.cfg, model.params, drafter, drafter_params, spec, sampling, max_len
    )
