"""The one table of methods: for each name, its drafter class, whether it drafts a tree,
how its generator is built, and the options only it takes (as `Generator` keywords and as
jaxspec-bench row syntax). Nothing outside this table branches on method names.

Light on purpose (no jax import): `jaxspec.METHODS` comes from here."""

from __future__ import annotations

import dataclasses
import importlib

from jaxspec.errors import JaxspecError, is_whole
from jaxspec.errors import option as option_name

# SDSAT's loops: the paper's draft step then verify step (the default), or adaptive chains
# in the verify step (jaxspec.drafters.sdsat).
SDSAT_LOOPS = ("two-forward", "one-forward")


def _whole(at_least: int, at_most: int | None = None):
    return lambda v: is_whole(v) and at_least <= v <= (v if at_most is None else at_most)


MAX_PPD_K = 16  # PPD runs k + 1 copies of the model, one a stage
LOOPS = ", ".join(SDSAT_LOOPS)
# option -> (how a bench row writes it (None: no row syntax), what a value must be, its
# check): one table for `Generator`'s keywords and the bench's row text
OPTIONS = {
    "tree": ("@TREE (a tree preset or one the drafter ships)", "a tree's name",
             lambda v: isinstance(v, str) and bool(v)),
    "firp_chains": ("/N (FIRP's pseudo chains on N nodes, N >= 0)", "a whole number >= 0",
                    _whole(0)),
    "sdsat_loop": (f"/LOOP (one of {LOOPS})", f"one of {LOOPS}", lambda v: v in SDSAT_LOOPS),
    "ppd_layer": ("@LAYER (the early-prediction layer, a number)", "a whole number >= 1",
                  _whole(1)),
    "ppd_k": (None, f"a whole number from 1 to {MAX_PPD_K}", _whole(1, MAX_PPD_K)),
    "retrieval": ("+R (R >= 1 retrieved continuations joining a dynamic tree)",
                  "a whole number >= 1", _whole(1)),
}  # fmt: skip


def row_value(option: str, text: str):
    """A bench row's text for `option` -> its value, or None when it is not one."""
    value = int(text) if text.isascii() and text.isdigit() else text
    return value if OPTIONS[option][2](value) else None


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    builder: str  # "module:function" building its generator (jaxspec.methods)
    drafter: str | None = None  # "module:Class" of its Drafter
    settings: str | None = None  # "module:Class" of its folder's settings (DrafterSettings)
    drafter_folder: bool = False  # loads a drafter folder (shipped or --drafter)
    tree: bool = False  # verifies a draft tree (--tree applies)
    options: tuple[str, ...] = ()  # Generator keywords only this method takes
    row_at: str | None = None  # what METHOD@X sets in a bench row
    row_slash: str | None = None  # what METHOD/X sets

    def load(self, target: str):
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)

    def drafter_class(self):
        return self.load(self.drafter)

    def settings_class(self):
        return self.load(self.settings)


def _speculative(name: str, cls: str, options: tuple[str, ...] = (), slash: str | None = None):
    """A method of a Drafter class `cls` with its settings class `cls`Settings beside it."""
    module = f"jaxspec.drafters.{name}:{cls}"
    return Method(name, "jaxspec.methods:build_speculative", module + "Drafter",
                  module + "Settings", True, True, options, "tree", slash)  # fmt: skip


REGISTRY = {
    m.name: m
    for m in (
        Method("ar", "jaxspec.methods:build_ar"),
        _speculative("medusa", "Medusa", ("retrieval",)),
        _speculative("firp", "Firp", ("firp_chains", "retrieval"), "firp_chains"),
        _speculative("chimera", "Chimera", ("retrieval",)),
        _speculative("eagle", "Eagle", ("retrieval",)),
        _speculative("sdsat", "Sdsat", ("sdsat_loop",), "sdsat_loop"),
        Method(
            "lookup",
            "jaxspec.methods:build_lookup",
            "jaxspec.drafters.lookup:LookupDrafter",
            "jaxspec.drafters.lookup:LookupSettings",
            tree=True,
            row_at="tree",
        ),  # fmt: skip
        Method(
            "ppd",
            "jaxspec.methods:build_ppd",
            settings="jaxspec.ppd:PpdSettings",
            drafter_folder=True,
            options=("ppd_k", "ppd_layer"),
            row_at="ppd_layer",
        ),  # fmt: skip
    )
}
METHODS = tuple(REGISTRY)


def method(name: str) -> Method:
    if not isinstance(name, str) or name not in REGISTRY:
        raise JaxspecError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return REGISTRY[name]


def owners(option: str) -> str:
    return ", ".join(m.name for m in REGISTRY.values() if option in m.options)


def check_options(m: Method, tree=None, drafter=None, **options) -> None:
    """Options that `m` would silently ignore are errors (None: not given)."""
    if tree is not None and not m.tree:
        raise JaxspecError(f"{option_name('tree')} picks a draft tree; method {m.name!r} has none")
    if drafter is not None and not m.drafter_folder:
        raise JaxspecError(
            f"{option_name('drafter')} applies to speculative methods; method {m.name!r} has none"
        )
    for option, value in options.items():
        flag = option_name(option)
        if value is not None and option not in m.options:
            raise JaxspecError(f"{flag} applies to method {owners(option)} only")
        if value is not None and not OPTIONS[option][2](value):
            raise JaxspecError(f"{flag} must be {OPTIONS[option][1]}, got {value!r}")


def row_source(row: str) -> str:
    """The part of a bench row that names its drafter: METHOD, or METHOD#LABEL for a row
    that `--drafter METHOD#LABEL=DIR` gives a drafter of its own."""
    return row.partition(":")[0].partition("+")[0].partition("/")[0].partition("@")[0]


def parse_row(row: str) -> tuple[str, dict, str]:
    """A bench row METHOD[#LABEL][@X][/Y][+R][:DTYPE] -> (method, its options, dtype or "")."""
    spec, _, dtype = row.partition(":")
    spec, plus, chains = spec.partition("+")
    spec, slash, extra = spec.partition("/")
    name, at, option = spec.partition("@")
    name, hash_, label = name.partition("#")
    if hash_ and not label.strip():
        raise JaxspecError(f"{row}: a label expected after #, e.g. {name}#mine")
    m = method(name)
    options = {}
    if at and m.row_at is None:
        raise JaxspecError(f"{row}: {name} decodes without a draft tree; drop @{option}")
    if slash and m.row_slash is None:
        takes = [(t.row_slash, t.name) for t in REGISTRY.values() if t.row_slash]
        raise JaxspecError(
            f"{row}: " + "; ".join(f"{OPTIONS[o][0]} applies to {n} rows only" for o, n in takes)
        )
    if plus and "retrieval" not in m.options:
        raise JaxspecError(
            f"{row}: {OPTIONS['retrieval'][0]} applies to {owners('retrieval')} rows"
        )
    targets = ((at, option, m.row_at), (slash, extra, m.row_slash), (plus, chains, "retrieval"))
    for given, text, target in targets:
        if given:
            value = row_value(target, text)
            if value is None:
                raise JaxspecError(f"{row}: {OPTIONS[target][0]} expected, got {text!r}")
            options[target] = value
    return name, options, dtype
