"""Building a generator for any method (`drafters.registry` names them): its shipped (or
a given) drafter, its default tree, its own options."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from jaxspec.config import LlamaConfig
from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.base import default_tree, resolve_tree
from jaxspec.drafters.registry import SDSAT_LOOPS, check_options, method
from jaxspec.drafters.retrieval import RetrievalDrafter
from jaxspec.errors import JaxspecError, given_path, option
from jaxspec.llama import compute_params
from jaxspec.models import LoadedModel
from jaxspec.sampling import Sampling
from jaxspec.tree import DynamicTree, TreeSpec

__all__ = ["SDSAT_LOOPS", "build_generator", "default_tree", "resolve_tree"]


def shipped_drafters() -> Path:
    """The drafters shipped with jaxspec (`<model>/<method>/`): package data in an
    installed jaxspec, else the source checkout's drafters/ (a clone, an editable install)."""
    package = Path(__file__).resolve().parent
    installed = package / "shipped_drafters"
    return installed if installed.is_dir() else package.parent / "drafters"


DRAFTERS_DIR = shipped_drafters()


def shipped_drafter(cfg, method: str) -> Path:
    """drafters/<model>/<method>/: the drafter shipped for a model (LlamaConfig `cfg`)."""
    return DRAFTERS_DIR / cfg.folder_name / method


def chosen_drafter_folder(model: LoadedModel, method: str, given: Path | None) -> Path:
    """The given drafter folder, else the one shipped for the model's name. A shipped
    drafter trained for other weights (another model of that name: a fine-tune's config
    often keeps its base's) is a warning: the tokens stay exact, fewer drafts are accepted."""
    from jaxspec.drafters.store import META, base_weights

    if given is not None:
        return given
    folder = shipped_drafter(model.cfg, method)
    trained_for = base_weights(folder) if (folder / META).is_file() else None
    if trained_for and trained_for != model.fingerprint:
        warnings.warn(
            f"the shipped {method} drafter for {model.cfg.folder_name!r} ({folder}) was trained "
            f"for other weights than {model.path}: the tokens stay exact, but fewer drafts "
            f"may be accepted; pass a drafter folder as {option('drafter')} or train one with "
            f"`jaxspec-train {method}`",
            RuntimeWarning,
            stacklevel=1,
        )
    return folder


PPD_K = 3


def provide_devices(n: int) -> None:
    """Ask for n virtual CPU devices (PPD's k + 1 processes) unless XLA_FLAGS already sets a
    count; only effective before jax starts its backends, which it does on first use. On
    CPU the virtual devices share the machine's cores."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def provide_devices_for(names, ppd_k: int | None = None, model_split: int = 1) -> None:
    """Virtual CPU devices for the methods among `names` that pipeline over ppd_k + 1
    stages (those taking the ppd_k option), of model_split devices each."""
    if any("ppd_k" in method(name).options for name in names):
        provide_devices(((ppd_k or PPD_K) + 1) * model_split)


def make_drafter(name: str, cfg: LlamaConfig, settings, sdsat_loop: str | None = None):
    """The method's drafter as its folder's settings describe it."""
    options = {"sdsat_loop": sdsat_loop} if sdsat_loop is not None else {}
    return method(name).drafter_class().from_settings(cfg, settings, **options)


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


def build_ar(model: LoadedModel, m, drafter_dir, tree, sampling, max_len, products, options):
    return SpeculativeGenerator(
        model.cfg, model.params, sampling=sampling, max_len=max_len, products=products,
        mesh=model.mesh,
    )  # fmt: skip


def build_ppd(model: LoadedModel, m, drafter_dir, tree, sampling, max_len, products, options):
    """PPD with the shipped early-prediction head for `ppd_layer` when there is one (else
    the untrained early exit); ppd_layer None: the shipped default, else ceil(d/2)."""
    from jaxspec.drafters.store import load_drafter
    from jaxspec.ppd import PpdGenerator, head_name

    if sampling is not None and not sampling.greedy:
        raise JaxspecError(f"ppd decodes greedily: set {option('temperature')} to 0")
    split = 1 if model.mesh is None else model.mesh.shape["model"]
    if model.mesh is not None and model.mesh.shape["data"] > 1:
        raise JaxspecError(
            f"ppd pipelines one sequence at a time: use {option('mesh')} data=1,model=M (each "
            "of its k + 1 stages then holds the model split M ways)"
        )
    drafter_dir = chosen_drafter_folder(model, m.name, drafter_dir)
    default_layer, heads = None, {}
    if drafter_dir.is_dir():
        stored = load_drafter(drafter_dir, m.name, model.cfg)
        check_ppd_heads(stored.params, model.cfg.dim, drafter_dir)
        heads = compute_params(stored.params["heads"], model.weight_dtype)
        default_layer = stored.settings.default_layer
    k = options.get("ppd_k") or PPD_K
    layer = options.get("ppd_layer") or default_layer
    layer = layer or (model.cfg.n_layers + 1) // 2
    return PpdGenerator(model.cfg, model.params, k, layer, heads.get(head_name(layer)), max_len,
                        model_split=split, products=products)  # fmt: skip


def build_lookup(model: LoadedModel, m, drafter_dir, tree, sampling, max_len, products, options):
    """Lookup drafts from the text itself: no drafter folder, its default tree per backend."""
    settings = m.settings_class()()
    drafter = m.drafter_class().from_settings(model.cfg, settings)
    return SpeculativeGenerator(
        model.cfg, model.params, drafter, drafter.init(), drafter.select_tree(tree, settings),
        sampling, max_len, products=products, mesh=model.mesh,
    )  # fmt: skip


def build_speculative(
    model: LoadedModel, m, drafter_dir, tree, sampling, max_len, products, options
):
    """A drafter method: its folder (shipped or given) loaded and checked against the
    model, its tree chosen, the drafter specialised for that tree."""
    from jaxspec.drafters.store import check_weights, load_drafter

    drafter_dir = chosen_drafter_folder(model, m.name, drafter_dir)
    settings, drafter_params, data = load_drafter(drafter_dir, m.name, model.cfg)
    retrieval = options.pop("retrieval", 0)
    drafter = m.drafter_class().from_settings(model.cfg, settings, **options)
    check_weights(drafter, model.params, drafter_params, drafter_dir)
    drafter_params = compute_params(drafter_params, model.weight_dtype)
    drafter_params = drafter.prepare(model.params, drafter_params, data)
    spec = drafter.select_tree(tree, settings)
    drafter = drafter.for_tree(spec, settings, data, **options)
    if retrieval:  # lookup's continuations join the dynamic tree's candidates
        drafter = RetrievalDrafter(drafter, retrieval)
    return SpeculativeGenerator(
        model.cfg, model.params, drafter, drafter_params, spec, sampling, max_len,
        products=products, mesh=model.mesh,
    )  # fmt: skip


def build_generator(
    model: LoadedModel,
    name: str,
    drafter_dir: Path | None = None,
    tree: str | TreeSpec | DynamicTree | None = None,
    sampling: Sampling | None = None,
    max_len: int | None = None,
    products: str | None = None,
    **options,
):
    """The generator of method `name`: drafter_dir None is the shipped drafter, tree None
    the drafter's default; products: how bfloat16 weights multiply (decode.PRODUCTS; None:
    the backend's default); options are the method's own (`registry.Method.options`:
    ppd_k, ppd_layer, firp_chains, sdsat_loop, retrieval), None meaning its default."""
    m = method(name)
    check_options(m, tree, drafter_dir, **options)
    if sampling is not None:
        sampling.check_vocabulary(model.cfg.vocab_size)
    options = {k: v for k, v in options.items() if v is not None}
    drafter_dir = given_path(drafter_dir, option("drafter"))
    return m.load(m.builder)(model, m, drafter_dir, tree, sampling, max_len, products, options)
