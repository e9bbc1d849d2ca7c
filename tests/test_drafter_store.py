"""Drafter folders (jaxspec.drafters.store): the names tensors are stored by, float16 kept
half size, and one-line errors for a folder that is missing, corrupt or for another model."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxspec.checkpoint import load_checkpoint
from jaxspec.drafters.firp import FirpDrafter, FirpSettings
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.drafters.store import (
    DATA,
    META,
    WEIGHTS,
    flatten,
    load_drafter,
    save_drafter,
    unflatten,
)
from jaxspec.errors import JaxspecError

ACCURACY = np.arange(6.0).reshape(2, 3) / 10  # [K, k]


@pytest.fixture
def folder(tiny_ckpt, tmp_path):
    """A FIRP drafter of two maps ({"maps": [{w, b}, {w, b}]}) for the tiny checkpoint."""
    cfg, _ = load_checkpoint(tiny_ckpt[0])
    settings = FirpSettings(layers=(1, 2), chains=2)
    weights = FirpDrafter(cfg, settings.layers).init()
    save_drafter(tmp_path, "firp", settings, weights, cfg, "card", {"test_topk_accuracy": ACCURACY})
    return tmp_path, cfg, settings, weights


def raises_one_line(call, *texts):
    """call() raises a JaxspecError of one line holding every text (conftest's one_line_error
    runs a CLI instead)."""
    with pytest.raises(JaxspecError) as e:
        call()
    assert "\n" not in str(e.value) and all(t in str(e.value) for t in texts), str(e.value)


def test_flatten_names_lists_by_index_and_unflatten_inverts_it():
    x, y, z = (np.full(2, v, np.float32) for v in (1, 2, 3))
    tree = {"a": [{"b": x}, [y, z]], "m": {"0": x, "k": y}}
    flat = flatten(tree)
    assert set(flat) == {"a.0.b", "a.1.0", "a.1.1", "m.0", "m.k"}
    back = unflatten(flat)
    assert isinstance(back["a"], list) and isinstance(back["a"][1], list)
    assert isinstance(back["m"], dict)  # "0" beside "k": a dict, not a list
    assert [back["a"][0]["b"][0], back["a"][1][0][0], back["a"][1][1][0]] == [1, 2, 3]
    assert flat["m.k"] is back["m"]["k"]


def test_weights_round_trip_float16_stays_half_size_and_loads_in_the_asked_dtype(folder):
    path, cfg, settings, weights = folder
    stored = load_drafter(path, "firp", cfg)
    assert isinstance(stored.params["maps"], list) and len(stored.params["maps"]) == 2
    for got, want in zip(stored.params["maps"], weights["maps"], strict=True):
        np.testing.assert_array_equal(got["w"], want["w"])
        np.testing.assert_array_equal(got["b"], want["b"])
    half = {"maps": [{"w": np.asarray(m["w"], np.float16), "b": np.float64([1.5] * cfg.dim)}
                     for m in weights["maps"]]}  # fmt: skip
    save_drafter(path, "firp", settings, half, cfg, "card")
    kinds = {k: v.dtype for k, v in load_file(str(path / WEIGHTS)).items()}
    assert kinds["maps.0.w"] == np.float16 and kinds["maps.0.b"] == np.float32
    stored = load_drafter(path, "firp", cfg, dtype=jnp.bfloat16)
    assert {m[k].dtype for m in stored.params["maps"] for k in "wb"} == {jnp.dtype(jnp.bfloat16)}
    # written again without data: no stale data file is left to load
    assert not (path / DATA).exists() and stored.data == {}


def test_a_data_array_of_any_memory_order_is_stored(folder):
    path, cfg, settings, weights = folder
    save_drafter(path, "firp", settings, weights, cfg, "", {"test_topk_accuracy": ACCURACY.T})
    np.testing.assert_array_equal(load_drafter(path, "firp", cfg).data["test_topk_accuracy"],
                                  ACCURACY.T)  # fmt: skip


@pytest.mark.parametrize("field", ["vocab_size", "dim", "n_layers"])
def test_a_drafter_for_another_model_is_refused_naming_both(folder, field):
    path, cfg, _, _ = folder
    other = dataclasses.replace(cfg, **{field: getattr(cfg, field) + 1}, name="other")
    raises_one_line(
        lambda: load_drafter(path, "firp", other),
        f"was trained for {cfg.name!r}",
        f"{field}={getattr(cfg, field)}",
        "not for 'other'",
    )


def test_missing_and_corrupt_folders_are_one_line_errors(folder):
    path, cfg, _, _ = folder
    (path / DATA).write_bytes(b"\x08\x00\x00")
    load = lambda: load_drafter(path, "firp", cfg)  # noqa: E731
    raises_one_line(load, "corrupt drafter data", str(path / DATA))
    (path / WEIGHTS).write_bytes((path / WEIGHTS).read_bytes()[:40])
    raises_one_line(lambda: load_drafter(path, "firp", cfg), "corrupt drafter weights")
    (path / WEIGHTS).unlink()
    raises_one_line(lambda: load_drafter(path, "firp", cfg), f"no drafter at {path}")
    (path / META).write_bytes(b'{"method": "firp\xff"}')
    raises_one_line(lambda: load_drafter(path, "eagle", cfg), "jaxspec-train eagle")
    (path / WEIGHTS).write_bytes(b"")
    raises_one_line(lambda: load_drafter(path, "firp", cfg), str(path / META), "not valid JSON")


def test_a_drafter_of_another_method_is_refused(folder):
    path, cfg, _, _ = folder
    raises_one_line(lambda: load_drafter(path, "eagle", cfg), "holds a 'firp' drafter, not 'eagle'")


def test_list_indices_with_a_gap_are_a_corrupt_drafter(folder):
    path, cfg, _, _ = folder
    flat = load_file(str(path / WEIGHTS))
    save_file({k.replace("maps.1.", "maps.2."): v for k, v in flat.items()}, str(path / WEIGHTS))
    raises_one_line(lambda: load_drafter(path, "firp", cfg), str(path / WEIGHTS),
                   "retrain the drafter")  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Typed(DrafterSettings):
    flag: bool = False
    rate: float = 0.5


@pytest.mark.parametrize(
    "raw, error",
    [
        ({"flag": True, "rate": 1}, None),  # a whole number is a float in JSON
        ({"flag": 1}, "setting 'flag' must be bool"),
        ({"rate": True}, "setting 'rate' must be float"),
        ({"rate": "0.5"}, "setting 'rate' must be float"),
    ],
)
def test_bool_and_float_settings_take_only_their_json_kinds(raw, error):
    if error is None:
        assert Typed.from_json(raw, "f.json") == Typed(**raw)
    else:
        raises_one_line(lambda: Typed.from_json(raw, "f.json"), "f.json: " + error)
