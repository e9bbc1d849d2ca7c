"""Drafter settings are typed and saved by name; data arrays live in their own file."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxspec.checkpoint import load_checkpoint
from jaxspec.drafters.chimera import ChimeraSettings
from jaxspec.drafters.firp import FirpDrafter, FirpSettings
from jaxspec.drafters.registry import METHODS, method
from jaxspec.drafters.settings import DrafterSettings
from jaxspec.drafters.store import DATA, META, load_drafter, save_drafter
from jaxspec.errors import JaxspecError
from jaxspec.methods import DRAFTERS_DIR

ACCURACY = np.array([[0.5, 0.6, 0.7], [0.3, 0.4, 0.45]])


@pytest.fixture
def firp_folder(tiny_ckpt, tmp_path):
    cfg, params = load_checkpoint(tiny_ckpt[0])
    settings = FirpSettings(layers=(1, 2), chains=2, trees={"searched-2": [[0], [1]]})
    weights = FirpDrafter(cfg, settings.layers).init(params, jax.random.key(0))
    save_drafter(tmp_path, "firp", settings, weights, cfg, "card", {"test_topk_accuracy": ACCURACY})
    return tmp_path, cfg, settings


def test_round_trip(firp_folder):
    folder, cfg, settings = firp_folder
    meta = json.loads((folder / META).read_text())
    assert meta["settings"] == {"trees": {"searched-2": [[0], [1]]}, "layers": [1, 2], "chains": 2}
    stored = load_drafter(folder, "firp", cfg)
    assert stored.settings == settings and isinstance(stored.settings.layers, tuple)
    np.testing.assert_array_equal(stored.data["test_topk_accuracy"], ACCURACY)
    assert stored.data["test_topk_accuracy"].dtype == np.float64  # stored exactly


def test_inline_data_of_older_folders_is_read_as_data(firp_folder):
    folder, cfg, settings = firp_folder
    meta = json.loads((folder / META).read_text())
    meta["settings"]["test_topk_accuracy"] = ACCURACY.tolist()
    (folder / META).write_text(json.dumps(meta))
    (folder / DATA).unlink()
    stored = load_drafter(folder, "firp", cfg)
    assert stored.settings == settings
    np.testing.assert_array_equal(stored.data["test_topk_accuracy"], ACCURACY)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"heads": 3}, r"do not fit FirpSettings \(unknown heads\)"),
        ({"layers": None}, "setting 'layers' must be tuple"),
        ({"layers": [1, "2"]}, "setting 'layers' must be tuple"),
        ({"chains": True}, "setting 'chains' must be int"),
        ({"cpu_tree": 3}, "setting 'cpu_tree' must be str | None"),
        ({"trees": {"a": [[0, "x"]]}}, "setting 'trees' must be dict"),
    ],
)
def test_bad_settings_are_one_line_errors(firp_folder, change, message):
    folder, cfg, _ = firp_folder
    meta = json.loads((folder / META).read_text())
    meta["settings"].update(change)
    (folder / META).write_text(json.dumps(meta))
    with pytest.raises(JaxspecError, match=message) as e:
        load_drafter(folder, "firp", cfg)
    assert str(folder / META) in str(e.value) and "\n" not in str(e.value)


def test_data_must_be_declared(tiny_ckpt, tmp_path):
    cfg, _ = load_checkpoint(tiny_ckpt[0])
    with pytest.raises(ValueError, match="carries no data named"):
        save_drafter(tmp_path, "chimera", ChimeraSettings(n_heads=1), {}, cfg, "", {"x": ACCURACY})


def test_every_folder_method_has_a_settings_class():
    for name in METHODS:
        m = method(name)
        if m.drafter_folder:
            assert issubclass(m.settings_class(), DrafterSettings)


@pytest.mark.parametrize("name", [m for m in METHODS if method(m).drafter_folder])
def test_shipped_settings_load_typed(name):
    folder = DRAFTERS_DIR / "SmolLM2-135M-Instruct" / name
    if not folder.is_dir():
        pytest.skip("no shipped drafter")
    from jaxspec.drafters.store import read_settings

    settings, inline = read_settings(folder, name)
    assert isinstance(settings, method(name).settings_class()) and inline == {}
