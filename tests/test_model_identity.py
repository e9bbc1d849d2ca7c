"""A model's identity on disk: the folder name its name gives (never a path that leaves
drafters/ or $JAXSPEC_HOME), and the stamp that keeps one model's cached training data from
another of the same name (train/model_stamp.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import LlamaConfig, plain_name, preset
from jaxspec.convert.hf import read_hf_config
from jaxspec.errors import JaxspecError
from jaxspec.fingerprint import fingerprint
from jaxspec.llama import compute_params, init_params
from jaxspec.mesh import make_mesh, shard_params
from jaxspec.methods import DRAFTERS_DIR, shipped_drafter
from jaxspec.models import LoadedModel
from train.model_stamp import STAMP, claim, claimed_folder, training_folder

CFG = dataclasses.replace(preset("tiny-gqa"), vocab_size=96)  # splits over model=2


@pytest.mark.parametrize(
    ("name", "plain"),
    [
        ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
        ("meta-llama/Llama-3.1-8B", "Llama-3.1-8B"),
        ("/home/me/ckpt/run 3/", "run-3"),
        ("C:\\models\\qwen", "qwen"),
        ("..", ""),
        ("", ""),
    ],
)
def test_a_name_is_one_folder_name(name, plain):
    assert plain_name(name) == plain
    assert LlamaConfig(**{**CFG.to_dict(), "name": name}).folder_name == (plain or CFG.family)


def test_a_path_for_a_name_stays_inside_drafters_and_the_home(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_HOME", str(tmp_path / "home"))
    cfg = LlamaConfig(**{**CFG.to_dict(), "name": str(tmp_path / "victim")})
    assert training_folder(cfg) == tmp_path / "home" / "train" / "victim"
    assert shipped_drafter(cfg, "medusa") == DRAFTERS_DIR / "victim" / "medusa"


def write_hf(folder: Path, **extra) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**CFG.to_hf_dict(), **extra}))
    return folder


def test_an_hf_folders_name_is_its_configs_else_the_folders(tmp_path):
    named = read_hf_config(write_hf(tmp_path / "a", _name_or_path="/tmp/elsewhere/victim"))
    assert (named.name, named.folder_name) == ("/tmp/elsewhere/victim", "victim")
    assert read_hf_config(write_hf(tmp_path / "my-model")).name == "my-model"
    snapshot = write_hf(tmp_path / "models--org--Tiny-7B" / "snapshots" / "0123abcd")
    assert read_hf_config(snapshot).name == "Tiny-7B"


def model(key: int = 0, params=None, path="m") -> LoadedModel:
    params = init_params(CFG, jax.random.key(key)) if params is None else params
    return LoadedModel(Path(path), CFG, params, tokenizer=object())


def test_a_fingerprint_is_the_weights_not_their_dtype_layout_or_mesh():
    base = model()
    same = [
        model(params=compute_params(base.params, jnp.bfloat16)),  # OutIn: [out,in] weights
        model(params=shard_params(base.params, CFG, make_mesh({"data": 1, "model": 2}))),
    ]
    assert {fingerprint(m) for m in same} == {fingerprint(base)}
    layers = [dict(p) for p in base.params["layers"]]
    layers[1]["input_layernorm"] = layers[1]["input_layernorm"] * 1.01  # a fine-tune's change
    other = [model(key=1), model(params={**base.params, "layers": layers})]
    assert len({fingerprint(m) for m in [base, *other]}) == 3


def test_a_folder_is_stamped_once_and_refused_to_other_weights(tmp_path):
    folder = tmp_path / "train" / "tiny"
    claim(folder, model(path="first"))
    assert json.loads((folder / STAMP).read_text())["source"] == "first"
    claim(folder, model(path="copy-of-first"))  # the same weights from elsewhere
    with pytest.raises(JaxspecError, match=r"of another model .*first.*--work-dir"):
        claim(folder, model(key=1, path="second"))
    assert json.loads((folder / STAMP).read_text())["source"] == "first"


def test_the_studies_claim_the_folder_they_read(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_HOME", str(tmp_path))
    assert claimed_folder(model()) == training_folder(CFG)
    with pytest.raises(JaxspecError, match="another model"):
        claimed_folder(model(key=1))


def test_a_folder_from_before_stamps_is_stamped_by_its_next_run(tmp_path):
    (tmp_path / "self-train-8-p128-n192.npz").write_bytes(b"answers")
    claim(tmp_path, model())
    assert json.loads((tmp_path / STAMP).read_text())["fingerprint"] == fingerprint(model())


def test_train_claims_its_shared_folder_and_needs_a_tokenizer(tmp_path, monkeypatch):
    from tests.test_train_plumbing import Counting
    from train import skeleton
    from train.args import parse, trainer_parser

    seen = []
    monkeypatch.setattr(skeleton, "load_model", lambda path, mesh: model(key=len(seen)))
    monkeypatch.setattr(Counting, "run", lambda self, work, out: seen.append(work) or "ran")
    argv = ["--work-dir", str(tmp_path / "work")]
    assert skeleton.train(Counting, parse(trainer_parser("medusa", None), argv)) == "ran"
    assert (tmp_path / "work" / STAMP).is_file()
    with pytest.raises(JaxspecError, match="another model"):
        skeleton.train(Counting, parse(trainer_parser("medusa", None), argv))
    assert seen == [tmp_path / "work"]
    bare = dataclasses.replace(model(), tokenizer=None)
    monkeypatch.setattr(skeleton, "load_model", lambda path, mesh: bare)
    with pytest.raises(JaxspecError, match="has no tokenizer, and training encodes prompts"):
        skeleton.train(
            Counting, parse(trainer_parser("medusa", None), ["--work-dir", str(tmp_path / "w2")])
        )


def test_a_shipped_drafter_for_other_weights_of_its_name_is_a_warning(tiny_ckpt, monkeypatch,
                                                                       tmp_path):  # fmt: skip
    """The drafter found by the model's name was trained for other weights (another model of
    that name): a warning (the tokens stay exact); none for its own weights, for a folder
    the user chose, or for a folder from before fingerprints."""
    import warnings

    import jaxspec
    from jaxspec import methods
    from jaxspec.checkpoint import load_checkpoint
    from jaxspec.drafters.medusa import MedusaDrafter, MedusaSettings
    from jaxspec.drafters.store import base_weights, save_drafter
    from jaxspec.models import load_model

    monkeypatch.setattr(methods, "DRAFTERS_DIR", tmp_path)
    loaded = load_model(tiny_ckpt[0])
    cfg, params = load_checkpoint(tiny_ckpt[0])
    folder = shipped_drafter(cfg, "medusa")
    heads = MedusaDrafter(cfg, 2).init(params, jax.random.key(0))
    other = fingerprint(SimpleNamespace(cfg=cfg, params=init_params(cfg, jax.random.key(9))))

    def build(**kw):
        return jaxspec.Generator(loaded, "medusa", tree="chain-1", **kw)

    for trained_for in (other, loaded.fingerprint, None):
        save_drafter(
            folder, "medusa", MedusaSettings(n_heads=2), heads, cfg, "", base_weights=trained_for
        )
        assert base_weights(folder) == trained_for
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            build(drafter=folder)  # the user's choice
            if trained_for != other:
                build()
    with pytest.warns(RuntimeWarning, match=r"shipped medusa drafter .* trained for other weights"):
        save_drafter(
            folder, "medusa", MedusaSettings(n_heads=2), heads, cfg, "", base_weights=other
        )
        build()
    with pytest.warns(RuntimeWarning, match="trained for other weights"):
        jaxspec.load_drafter(loaded, "medusa")
    from jaxspec.ppd import PpdSettings

    identity = {"w": np.eye(cfg.dim, dtype=np.float32), "b": np.zeros(cfg.dim, np.float32)}
    save_drafter(shipped_drafter(cfg, "ppd"), "ppd", PpdSettings(layers=(1,), default_layer=1),
                 {"heads": {"layer1": identity}}, cfg, "", base_weights=other)  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"shipped ppd drafter .* trained for other weights"):
        jaxspec.Generator(loaded, "ppd")


def test_the_shipped_drafters_name_the_weights_of_one_model():
    """Every drafter shipped for the default model names the same weights (the slow
    tests/test_default_model.py checks they are the default model's)."""
    from jaxspec.drafters.store import base_weights

    folders = [p.parent for p in DRAFTERS_DIR.glob("SmolLM2-135M-Instruct/*/drafter.json")]
    assert len(folders) == 6
    stamps = {base_weights(folder) for folder in folders}
    assert len(stamps) == 1 and None not in stamps
