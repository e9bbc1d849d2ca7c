"""Drafter settings: one frozen dataclass per method (beside its drafter), saved in
drafter.json by field name and read back checked, field by field.

Settings say how to build and use a drafter. What training measured or derived from data
(FIRP's test accuracies, Chimera's draft vocabulary) are arrays in the folder's data file,
named by the class's `DATA`, not settings.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar

from jaxspec.errors import JaxspecError

TreePaths = list[list[int]]  # a tree as its non-root nodes' paths of ranks (TreeSpec(paths))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterSettings:
    """What every drafter may carry: its own searched trees (name -> node paths) and the
    tree measured fastest on CPUs and on accelerators (None: the backend's default)."""

    trees: dict[str, TreePaths] = dataclasses.field(default_factory=dict)
    cpu_tree: str | None = None
    gpu_tree: str | None = None

    DATA: ClassVar[tuple[str, ...]] = ()  # names of the data arrays the drafter may carry

    def to_json(self) -> dict[str, Any]:
        """Fields by name; None (unset) left out, tuples as lists."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> DrafterSettings:
        """The settings a drafter.json holds; unknown, missing or mistyped fields are one
        error naming the file (`where`)."""
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        missing = [
            name
            for name, f in fields.items()
            if name not in raw
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if unknown or missing:
            what = [f"unknown {', '.join(unknown)}"] if unknown else []
            what += [f"missing {', '.join(missing)}"] if missing else []
            raise JaxspecError(
                f"{where}: settings do not fit {cls.__name__} ({'; '.join(what)}); "
                "retrain the drafter"
            )
        values = {}
        for name, value in raw.items():
            if not _fits(value, hints[name]):
                raise JaxspecError(
                    f"{where}: setting {name!r} must be {_describe(hints[name])}, got "
                    f"{value!r:.60}; retrain the drafter"
                )
            values[name] = tuple(value) if _origin(hints[name]) is tuple else value
        return cls(**values)


def _origin(kind) -> Any:
    return typing.get_origin(kind) or kind


def _fits(value, kind) -> bool:
    """Whether a JSON value fits a field's type (int, bool, str, float, X | None,
    tuple[int, ...], list[...], dict[str, ...])."""
    origin, args = _origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in args)
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if origin in (tuple, list):
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _fits(v, args[1]) for k, v in value.items()
        )
    raise TypeError(f"settings fields of type {kind} are not supported")


def _describe(kind) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
