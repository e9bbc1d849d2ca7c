"""Meshes: parsing, the Megatron layout from the parameter table, and tensor/data-parallel
decoding giving one device's tokens (4 virtual CPU devices, tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxspec.config import preset
from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.medusa import MedusaDrafter
from jaxspec.errors import JaxspecError
from jaxspec.llama import init_params
from jaxspec.mesh import make_mesh, param_specs, parse_mesh, shard_params
from jaxspec.tree import tree_preset

# heads 4, kv heads 2, FFN 88, vocabulary 96: model=2 divides them all
CFG = dataclasses.replace(preset("tiny-gqa"), vocab_size=96, eos_token_ids=())
PROMPTS = [[5, 9, 7, 11, 3], [4, 8, 15, 16, 23, 42]]


def test_parse_mesh():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh("model=3") == {"data": 1, "model": 3}
    for bad in ("model=0", "tensor=2", "model=x", "model"):
        with pytest.raises(JaxspecError, match="expected AXIS=N pairs"):
            parse_mesh(bad)


def test_mesh_sizes_are_checked():
    with pytest.raises(JaxspecError, match="needs 16 devices, 4 found"):
        make_mesh({"data": 4, "model": 4})
    params = init_params(CFG, jax.random.key(0))
    with pytest.raises(JaxspecError, match="model=4 does not divide n_kv_heads 2 .* 1, 2$"):
        shard_params(params, CFG, make_mesh({"data": 1, "model": 4}))


def test_megatron_layout_comes_from_the_logical_axes():
    specs = param_specs(CFG)
    layer = specs["layers"][0]
    assert specs["embed_tokens"] == P("model", None) and specs["lm_head"] == P(None, "model")
    assert specs["norm"] == P(None) and layer["input_layernorm"] == P(None)
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert layer[name] == P(None, "model"), name  # split by output columns
    for name in ("o_proj", "down_proj"):
        assert layer[name] == P("model", None), name  # split by rows


@pytest.mark.parametrize("shape", [{"data": 1, "model": 2}, {"data": 2, "model": 2}])
def test_sharded_decoding_gives_one_devices_tokens(shape):
    params = init_params(CFG, jax.random.key(0), scale=0.3)
    mesh = make_mesh(shape)
    sharded = shard_params(params, CFG, mesh)
    q = sharded["layers"][0]["q_proj"]
    assert q.addressable_shards[0].data.shape == (CFG.dim, CFG.n_heads * CFG.head_dim // 2)
    drafter = MedusaDrafter(CFG, 2)
    heads = drafter.init(params, jax.random.key(1))
    tree = tree_preset("comb-2-3")
    for args in ((), (drafter, heads, tree)):
        one = SpeculativeGenerator(CFG, params, *args).generate_batch(PROMPTS, 20)
        got = SpeculativeGenerator(CFG, sharded, *args, mesh=mesh).generate_batch(PROMPTS, 20)
        assert [r.token_ids for r in got] == [r.token_ids for r in one]


def test_generate_on_a_mesh_gives_one_devices_tokens(tmp_path, tiny_ckpt, capsys):
    """jaxspec-generate --mesh: the same token ids, the weights split two ways."""
    from infer.generate import main
    from jaxspec.checkpoint import save_checkpoint
    from tests.conftest import one_line_error, tiny_tokenizer
    from tests.test_cli import run_ok

    cfg = dataclasses.replace(CFG, vocab_size=104, eos_token_ids=(2,), name="tiny-104")
    save_checkpoint(tmp_path / "m", cfg, init_params(cfg, jax.random.key(0)), tiny_tokenizer())
    argv = ["--model", str(tmp_path / "m"), "--json", "--max-new-tokens", "12", "w5 w9 w7"]
    one = json.loads(run_ok(main, argv, capsys))
    for method in ("ar", "medusa"):
        mesh = ["--mesh", "data=1,model=2", "--method", method]
        if method != "ar":
            mesh += ["--drafter", str(write_medusa(tmp_path / "d", cfg, tmp_path / "m"))]
        got = json.loads(run_ok(main, mesh + argv, capsys))
        assert got["token_ids"] == one["token_ids"], method
        assert got["weight_bytes_per_device"] < 0.6 * one["weight_bytes_per_device"]
    err = one_line_error(main, ["--model", str(tiny_ckpt[0]), "--mesh", "model=2", "w5"], capsys)
    assert "model=2 does not divide ffn_dim 83" in err


def write_medusa(folder, cfg, model_dir):
    from jaxspec.checkpoint import load_checkpoint
    from jaxspec.drafters.medusa import MedusaSettings
    from jaxspec.drafters.store import save_drafter

    _, params = load_checkpoint(model_dir)
    heads = MedusaDrafter(cfg, 2).init(params, jax.random.key(1))
    save_drafter(folder, "medusa", MedusaSettings(n_heads=2), heads, cfg, "untrained")
    return folder
