"""Meshes: parsing, the Megatron layout from the parameter table, and tensor/data-parallel
decoding giving one device's tokens for every method (4 virtual CPU devices,
tests/conftest.py), with explicit shardings and no weight gathered on the hot path."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxspec import export
from jaxspec.config import preset
from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.medusa import MedusaDrafter
from jaxspec.drafters.retrieval import RetrievalDrafter
from jaxspec.errors import JaxspecError
from jaxspec.llama import compute_params, init_params
from jaxspec.mesh import (
    Layout,
    make_mesh,
    param_specs,
    parse_mesh,
    place,
    shard_params,
    table_specs,
)
from jaxspec.param_table import param_shapes
from jaxspec.sampling import Sampling
from jaxspec.tree import tree_preset

# heads 4, kv heads 2, FFN 88, vocabulary 96: model=2 divides them all
CFG = dataclasses.replace(preset("tiny-gqa"), vocab_size=96, eos_token_ids=())
# 4 layers (FIRP reads 2 and 4); heads 8, kv heads 4, FFN 96, vocabulary 96: model=2 and
# model=4 divide them all
CFG4 = dataclasses.replace(
    CFG, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=8, ffn_dim=96, name="tiny-4"
)
PROMPTS = [[5, 9, 7, 11, 3], [4, 8, 15, 16, 23, 42]]
MESHES = {"1x2": (1, 2), "2x2": (2, 2), "1x4": (1, 4), "2x1": (2, 1)}


def test_parse_mesh():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh("model=3") == {"data": 1, "model": 3}
    for bad in ("model=0", "tensor=2", "model=x", "model", "model=2,model=4", "", " , "):
        with pytest.raises(JaxspecError, match="expected AXIS=N pairs"):
            parse_mesh(bad)
    assert parse_mesh(" data=2 , model=4 ,") == {"data": 2, "model": 4}  # as typed
    assert parse_mesh("data=256,model=256") == {"data": 256, "model": 256}  # 1 << 16: the most
    with pytest.raises(JaxspecError, match="asks for 1000000000000 devices; a mesh holds at"):
        parse_mesh("data=1000000,model=1000000")  # XLA aborted, asked for as many


def test_mesh_sizes_are_checked():
    with pytest.raises(JaxspecError, match="needs 16 devices, 4 found"):
        make_mesh({"data": 4, "model": 4})
    d = jax.devices()  # the first D*M devices, neighbours along `model`
    assert make_mesh({"model": 2}).devices.tolist() == [d[:2]]
    assert make_mesh({"data": 2, "model": 2}).devices.tolist() == [d[:2], d[2:]]
    assert make_mesh({"data": 2}).devices.tolist() == [d[:1], d[1:2]]
    params = init_params(CFG, jax.random.key(0))
    with pytest.raises(JaxspecError, match="model=4 does not divide n_kv_heads 2 .* 1, 2$"):
        shard_params(params, CFG, make_mesh({"data": 1, "model": 4}))
    with pytest.raises(JaxspecError, match="model=4 does not divide n_kv_heads 2 .* 1, 2$"):
        SpeculativeGenerator(CFG, params, mesh="model=4")


def test_megatron_layout_comes_from_the_logical_axes():
    specs = param_specs(CFG)
    layer = specs["layers"][0]
    assert specs["embed_tokens"] == P("model", None) and specs["lm_head"] == P(None, "model")
    assert specs["norm"] == P(None) and layer["input_layernorm"] == P(None)
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert layer[name] == P(None, "model"), name  # split by output columns
    for name in ("o_proj", "down_proj"):
        assert layer[name] == P("model", None), name  # split by rows
    # a drafter's leaf named like a parameter but of another shape (a head over a draft
    # vocabulary of V + 3 tokens) is replicated; one of the table's shape split by it
    D, V = CFG.dim, CFG.vocab_size
    tree = {"lm_head": jax.ShapeDtypeStruct((D, V + 3), jnp.float32),
            "embed_tokens": jax.ShapeDtypeStruct((V, D), jnp.float32)}  # fmt: skip
    assert table_specs(CFG, tree) == {"lm_head": P(), "embed_tokens": P("model", None)}
    sharded = shard_params(init_params(CFG, jax.random.key(0)), CFG, make_mesh({"model": 2}))
    q = sharded["layers"][0]["q_proj"]
    assert q.addressable_shards[0].data.shape == (CFG.dim, CFG.n_heads * CFG.head_dim // 2)


def test_the_cache_is_split_by_rows_and_kv_heads():
    """On 2x2 a cache [B,K,S,H] is split by rows over `data` (whole when `data` does not
    divide the batch) and by kv heads over `model`; its lengths [B] and other row arrays
    by rows only."""
    from jaxspec.kv_cache import init_cache

    mesh, K, H = make_mesh({"data": 2, "model": 2}), CFG4.n_kv_heads, CFG4.head_dim
    for batch, rows in ((2, 1), (3, 3)):
        layout = Layout(mesh, batch)
        cache = jax.eval_shape(lambda b=batch: init_cache(CFG4, b, 32))
        shardings = layout.kv_tree(cache)
        for x, s in zip(jax.tree.leaves(cache), jax.tree.leaves(shardings), strict=True):
            want = (rows, K // 2, 32, H) if x.ndim == 4 else (rows,)
            assert s.shard_shape(x.shape) == want
        assert layout.rows.shard_shape((batch, 7)) == (rows, 7)


def test_a_device_of_a_mesh_needs_its_share_of_a_steps_memory(monkeypatch):
    """The memory check before a generation counts a step's bytes split over the mesh's 4
    devices: a quarter of one device's fits where the whole would not."""
    from jaxspec import decode

    one, split = method_generator("ar"), method_generator("ar", make_mesh({"data": 2, "model": 2}))
    need = decode.step_bytes(CFG4, one.tree.n_nodes, 2, 64)
    monkeypatch.setattr(decode, "available_bytes", lambda: (need // 4, "host"))
    with pytest.raises(JaxspecError, match="needs about"):
        one.check_memory(2, 64)
    split.check_memory(2, 64)


@pytest.mark.slow  # CI time (~31 s); every method on a 2x2 mesh stays fast
def test_generate_on_a_mesh_gives_one_devices_tokens(tmp_path, tiny_ckpt, capsys):
    """jaxspec-generate --mesh (ar, medusa, ppd): the same token ids, the weights split two
    ways; and
    jaxspec-bench --mesh: Medusa's tokens are AR's on the mesh."""
    from infer.generate import main
    from jaxspec.checkpoint import save_checkpoint
    from tests.conftest import one_line_error, tiny_tokenizer
    from tests.test_cli import run_ok

    cfg = dataclasses.replace(CFG, vocab_size=104, eos_token_ids=(2,), name="tiny-104")
    save_checkpoint(tmp_path / "m", cfg, init_params(cfg, jax.random.key(0)), tiny_tokenizer())
    argv = ["--model", str(tmp_path / "m"), "--json", "--max-new-tokens", "12", "w5 w9 w7"]
    one = json.loads(run_ok(main, argv, capsys))
    for method in ("ar", "medusa", "ppd"):  # ppd: its stages on model=2 meshes (shared)
        mesh = ["--mesh", "data=1,model=2", "--method", method]
        if method == "medusa":
            mesh += ["--drafter", str(write_medusa(tmp_path / "d", cfg, tmp_path / "m"))]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # 4 devices: ppd's stages shared
            got = json.loads(run_ok(main, mesh + argv, capsys))
        assert got["token_ids"] == one["token_ids"], method
        assert got["weight_bytes_per_device"] < 0.6 * one["weight_bytes_per_device"]
    err = one_line_error(main, ["--model", str(tiny_ckpt[0]), "--mesh", "model=2", "w5"], capsys)
    assert "model=2 does not divide ffn_dim 83" in err

    from infer.bench import main as bench

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "a", "turns": ["w5 w6"]}))
    out = tmp_path / "r.json"
    run_ok(bench, ["--model", str(tmp_path / "m"), "--methods", "ar,medusa", "--drafter",
                   f"medusa={tmp_path / 'd'}", "--questions", str(questions), "--max-new-tokens",
                   "8", "--mesh", "data=1,model=2", "--out", str(out)], capsys)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["methods"]["medusa"]["match_ar"] == 1.0 and result["mesh"] == "data=1,model=2"
    assert result["weight_bytes_per_device"] == got["weight_bytes_per_device"]


def write_medusa(folder, cfg, model_dir):
    from jaxspec.checkpoint import load_checkpoint
    from jaxspec.drafters.medusa import MedusaSettings
    from jaxspec.drafters.store import save_drafter

    _, params = load_checkpoint(model_dir)
    heads = MedusaDrafter(cfg, 2).init(params, jax.random.key(1))
    save_drafter(folder, "medusa", MedusaSettings(n_heads=2), heads, cfg, "untrained")
    return folder


@functools.cache
def base_params(cfg=CFG4):
    """Random weights; biases and q/k norms (Qwen2/Qwen3) far from their zeros and ones."""
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    wiggle = {"q_bias": 0.3, "k_bias": 0.3, "v_bias": 0.3, "q_norm": 0.5, "k_norm": 0.5}
    for layer in params["layers"]:
        for name, size in wiggle.items():
            if name in layer:
                layer[name] = layer[name] + size * jnp.sin(jnp.arange(layer[name].size) + 1.0)
    return params


def method_generator(
    method: str, mesh=None, sampling=None, params=None, cfg=CFG4, tree="comb-2-2", retrieval=0,
    settings=None,
) -> SpeculativeGenerator:  # fmt: skip
    """A generator of `method` with random drafter weights (losslessness does not depend
    on their quality) on `cfg`, on `mesh` (AR: given only params placed on it) or one
    device; retrieval: lookup's continuations joining its dynamic tree; settings: the
    drafter's (default: the export tests')."""
    from jaxspec.methods import make_drafter
    from tests.test_export import DATA, SETTINGS

    params = base_params(cfg) if params is None else params
    if method == "ar":  # params already on the mesh: the generator decodes on theirs
        params = params if mesh is None else place(params, table_specs(cfg, params), mesh)
        return SpeculativeGenerator(cfg, params, sampling=sampling)
    settings = settings or SETTINGS[method]
    drafter = make_drafter(method, cfg, settings)
    weights = drafter.init(base_params(cfg), jax.random.key(1))
    weights = jax.tree.map(lambda w: w + 0.05 * jnp.sin(jnp.arange(w.size).reshape(w.shape)),
                           weights)  # fmt: skip
    data = DATA.get(method, {})
    weights = drafter.prepare(params, weights, data)
    tree = drafter.select_tree(tree, settings)
    drafter = drafter.for_tree(tree, settings, data)
    if retrieval:
        drafter = RetrievalDrafter(drafter, retrieval)
    return SpeculativeGenerator(cfg, params, drafter, weights, tree, sampling, mesh=mesh)


@functools.cache
def one_device_tokens(method: str, sampling=None) -> list[list[int]]:
    results = method_generator(method, sampling=sampling).generate_batch(PROMPTS, 16, seed=3)
    return [r.token_ids for r in results]


@pytest.mark.parametrize(
    "method, mesh",
    [(m, "2x2") for m in ("ar", "medusa", "firp", "chimera", "sdsat", "lookup", "eagle")]
    + [("chimera", shape) for shape in ("1x4", "2x1")]
    + [("medusa", "1x2")],
)
def test_every_method_on_a_mesh_gives_one_devices_tokens(method, mesh):
    """Greedy: each row's tokens equal one device's (batch 2: over `data` in 2x2 and 2x1)."""
    data, model = MESHES[mesh]
    gen = method_generator(method, make_mesh({"data": data, "model": model}))
    got = [r.token_ids for r in gen.generate_batch(PROMPTS, 16, seed=3)]
    assert got == one_device_tokens(method)


# Every family's difference on CFG4 at once: q/k/v biases (Qwen2) split with their heads,
# per-head q/k norms (Qwen3; head_dim 12, not dim / heads) replicated, a window (Mistral)
# shorter than prompt + new tokens.
FAMILIES_CFG = dataclasses.replace(
    CFG4, qkv_bias=True, qk_norm=True, head_dim=12, sliding_window=8, name="tiny-families"
)


@pytest.mark.slow  # CI time (~33 s)
def test_the_families_on_a_mesh_give_one_devices_tokens():
    """Chimera (its encoder a copy of a decoder layer, with the biases and norms) on a 2x2
    mesh gives one device's tokens, rows split over data, heads over model."""
    cfg = FAMILIES_CFG
    layer = param_specs(cfg)["layers"][0]
    assert all(layer[n] == P("model") for n in ("q_bias", "k_bias", "v_bias") if n in layer)
    assert all(layer[n] == P(None) for n in ("q_norm", "k_norm") if n in layer)
    one = method_generator("chimera", cfg=cfg).generate_batch(PROMPTS, 16, seed=3)
    mesh = make_mesh({"data": 2, "model": 2})
    got = method_generator("chimera", mesh, cfg=cfg).generate_batch(PROMPTS, 16, seed=3)
    assert [r.token_ids for r in got] == [r.token_ids for r in one]
    assert [r.steps for r in got] == [r.steps for r in one]
    ar = method_generator("ar", cfg=cfg).generate_batch(PROMPTS, 16, seed=3)
    assert [r.token_ids for r in ar] == [r.token_ids for r in one]


@pytest.mark.parametrize("method, retrieval", [("medusa", 0), ("firp", 0), ("eagle", 2)])
def test_dynamic_trees_on_a_mesh_give_one_devices_tokens(method, retrieval):
    """The topology chosen on device (a Draft between steps, split by rows) on 2x2; with
    retrieval candidates, the lookup state split by rows beside the drafter's own."""
    kw = dict(tree="dynamic-6", retrieval=retrieval)
    one = method_generator(method, **kw).generate_batch(PROMPTS, 16, seed=3)
    mesh = make_mesh({"data": 2, "model": 2})
    got = method_generator(method, mesh, **kw).generate_batch(PROMPTS, 16, seed=3)
    assert [r.token_ids for r in got] == [r.token_ids for r in one] == one_device_tokens("ar")
    assert [r.steps for r in got] == [r.steps for r in one]


@pytest.mark.parametrize(
    "tree",
    ["comb-2-2", pytest.param("dynamic-6", marks=pytest.mark.slow)],  # ~30 s
)
def test_eagle_of_two_blocks_on_a_mesh_gives_one_devices_tokens(tree):
    """A drafter of two blocks, its state's K*2 key/value heads split over `model` like the
    model's cache, gives one device's tokens."""
    from tests.test_export import SETTINGS

    two = dataclasses.replace(SETTINGS["eagle"], blocks=2)
    one = method_generator("eagle", tree=tree, settings=two).generate_batch(PROMPTS, 16, seed=3)
    mesh = make_mesh({"data": 2, "model": 2})
    got = method_generator("eagle", mesh, tree=tree, settings=two).generate_batch(
        PROMPTS, 16, seed=3
    )
    assert [r.token_ids for r in got] == [r.token_ids for r in one] == one_device_tokens("ar")
    assert [r.steps for r in got] == [r.steps for r in one]


def test_sampling_on_a_mesh_draws_one_devices_tokens():
    """The same keys give the same sampled tokens as on one device: the mesh leaves the
    sampler's distribution alone (see also the chi-square test below)."""
    how = Sampling(0.9, top_p=0.95)
    gen = method_generator("medusa", make_mesh({"data": 2, "model": 2}), how)
    got = [r.token_ids for r in gen.generate_batch(PROMPTS, 16, seed=3)]
    assert got == one_device_tokens("medusa", how)


def test_tree_rejection_sampling_on_a_mesh_preserves_the_distribution():
    """The chi-square test of lossless tree sampling, with the model split two ways and the
    rows two ways."""
    from tests.test_speculative import check_two_token_distribution, sampling_test_drafter

    cfg = dataclasses.replace(CFG, vocab_size=6)
    mesh = make_mesh({"data": 2, "model": 2})
    params = shard_params(init_params(cfg, jax.random.key(0), scale=0.3), cfg, mesh)
    drafter, dparams = sampling_test_drafter("chimera", cfg, params)
    layout = Layout(mesh, batch=2)  # the test's 12000 rows split over data=2 too

    def place(kind, value):
        if kind == "rows":
            return jax.tree.map(lambda x: jax.device_put(x, layout.rows), value)
        shardings = layout.kv_tree(value) if kind == "cache" else None
        if kind == "state":
            shardings = drafter.state_shardings(value, layout)
        return jax.tree.map(jax.device_put, value, shardings)

    check_two_token_distribution(
        cfg, params, tree_preset("cpu-8"), Sampling(0.8), drafter, dparams, place
    )


def collectives(compiled) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, result shape) of every collective in the compiled program."""
    text = compiled.as_text()
    found = re.findall(r"= \w+\[([\d,]*)\]\S* (all-gather|all-reduce|all-to-all|"
                       r"collective-permute|reduce-scatter)\(", text)  # fmt: skip
    return [(kind, tuple(int(d) for d in dims.split(",") if d)) for dims, kind in found]


@pytest.mark.parametrize("method", ["medusa", "chimera"])
def test_no_weight_is_gathered_on_the_hot_path(method):
    """The compiled programs on a 2x2 mesh (bfloat16 weights as decoding holds them) sum
    the split layers' outputs (all-reduce) and gather activations (logits, top-k partials)
    but never a weight matrix, and shuffle no activations between devices (permutes only
    of a few per-row counters: rows stay on their `data` device). Their results come back
    where the next program reads them: new keys and values [B,K,T,H] split by rows and kv
    heads, what the host reads after a step whole on every device (every process)."""
    params = compute_params(base_params(), jnp.bfloat16)
    gen = method_generator(method, make_mesh({"data": 2, "model": 2}), params=params)
    weights = {s for s in jax.tree.leaves(param_shapes(CFG4), is_leaf=lambda x:
               isinstance(x, tuple)) if len(s) == 2}  # fmt: skip
    weights |= {s[::-1] for s in weights}
    plan = gen.lowerings(*gen.example_inputs(2, 16, 64))
    assert set(plan) >= {"prefill", "step", "commit_prompt", "commit_path"}
    for name, (program, args, static) in plan.items():
        compiled = program.lower(*args, **static).compile()
        found = collectives(compiled)
        outs = compiled.output_shardings
        if name in ("prefill", "step"):  # (..., block, state): prefill's rows, step's host
            block = jax.tree.leaves(outs[-2])
            assert block and all(s.spec == P("data", "model", None, None) for s in block)
        if name == "step":
            assert all(s.is_fully_replicated for s in jax.tree.leaves(outs[:3])), outs[:3]
        kinds = Counter(kind for kind, _ in found)
        if name in ("prefill", "step"):  # attention's and the MLP's sums in every layer
            assert kinds["all-reduce"] >= 2 * CFG4.n_layers, (name, kinds)
        shuffled = [s for kind, s in found if kind in ("collective-permute", "all-to-all")]
        assert all(math.prod(s) < CFG4.dim for s in shuffled), (name, shuffled)
        gathered = {shape for kind, shape in found if kind == "all-gather"}
        assert not weights & gathered, (name, gathered)


@pytest.mark.parametrize("method", ["ar", "medusa", "firp", "chimera", "sdsat"])
def test_export_mesh_programs(method):
    """Every program on a 2x2 mesh exports for CUDA and TPU with its shardings."""
    gen = method_generator(method, make_mesh({"data": 2, "model": 2}))
    exported = export.export_all(gen.lowerings(*gen.example_inputs(2, 16, 64)))
    step = exported["step"]["cuda"]
    assert step.nr_devices == 4
    assert re.search(r"sharding<@mesh, \[\{\}, \{\"model\"\}\]>", step.mlir_module())


@pytest.mark.slow
def test_default_model_split_three_ways_gives_one_devices_tokens(capsys):
    """SmolLM2 (9 heads, 3 kv heads) on model=3 with `jaxspec-generate --mesh`: every
    method's token ids equal one device's, the weights a third per device."""
    from infer.generate import main
    from tests.test_cli import run_ok

    argv = ["--json", "--max-new-tokens", "24", "Explain KV caches in one sentence."]
    for method in ("ar", "medusa", "firp", "chimera", "sdsat"):
        one = json.loads(run_ok(main, ["--method", method, *argv], capsys))
        split = ["--mesh", "data=1,model=3", "--method", method, *argv]
        got = json.loads(run_ok(main, split, capsys))
        assert got["token_ids"] == one["token_ids"], method
        third = got["weight_bytes_per_device"] / one["weight_bytes_per_device"]
        assert 0.33 < third < 0.34, third  # norms (replicated) are a few KB


def test_sharded_loading_reads_only_each_devices_slices(tmp_path, monkeypatch):
    """load_model(CKPT, mesh=2x2): the same weights as a whole load, each split tensor
    read as the halves the devices hold and every slice once (the data axis's replicas
    share a read): the bytes read are the checkpoint's, not the mesh's."""
    from jaxspec import checkpoint
    from jaxspec.checkpoint import flatten_params, save_checkpoint
    from jaxspec.models import load_model

    save_checkpoint(tmp_path, CFG, init_params(CFG, jax.random.key(0)))
    reads = []

    class CountingFile:  # safe_open, recording the shape of every slice read
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            stored = self.file.get_slice(name)
            return CountingSlice(name, stored)

    class CountingSlice:
        def __init__(self, name, stored):
            self.name, self.stored = name, stored

        def get_shape(self):
            return self.stored.get_shape()

        def __getitem__(self, index):
            data = self.stored[index]
            reads.append((self.name, data.shape, data.nbytes))
            return data

    whole = flatten_params(load_model(tmp_path).params)
    real_open = checkpoint.safe_open
    monkeypatch.setattr(checkpoint, "safe_open", CountingFile)
    mesh = make_mesh({"data": 2, "model": 2})
    loaded = load_model(tmp_path, mesh=mesh)
    assert loaded.mesh is mesh  # decoding (Generator) splits on it
    split = flatten_params(loaded.params)
    for name, w in whole.items():
        np.testing.assert_array_equal(np.asarray(split[name]), np.asarray(w))
    for name, shape, _ in reads:
        held = split[name].addressable_shards[0].data.shape
        assert shape == held and (len(held) == 1 or held[0] * held[1] * 2 == whole[name].size)
    assert sum(n for *_, n in reads) == sum(w.nbytes for w in whole.values())


def test_a_sharded_load_casts_and_refuses_a_bad_checkpoint(tmp_path):
    """load_params_sharded casts each shard to the dtype asked for (bfloat16 on an
    accelerator by default) and refuses, in one line, weights of another config's shapes
    or a damaged file."""
    from jaxspec.checkpoint import WEIGHTS_FILE, load_params, load_params_sharded, save_checkpoint

    mesh = make_mesh({"model": 2})
    save_checkpoint(tmp_path, CFG, init_params(CFG, jax.random.key(0)))
    split = load_params_sharded(tmp_path, CFG, mesh, jnp.bfloat16)
    whole = load_params(tmp_path, CFG, jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(whole), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = dataclasses.replace(CFG, ffn_dim=2 * CFG.ffn_dim)
    with pytest.raises(
        JaxspecError, match=rf"do not match .*gate_proj has shape \({CFG.dim}, {CFG.ffn_dim}\)"
    ):
        load_params_sharded(tmp_path, other, mesh)
    file = tmp_path / WEIGHTS_FILE
    file.write_bytes(file.read_bytes()[:100])  # cut short
    with pytest.raises(JaxspecError, match="corrupt or unreadable weights"):
        load_params_sharded(tmp_path, CFG, mesh)


def test_an_hf_folder_goes_to_its_shards_from_host_memory(tmp_path, monkeypatch):
    """load_model(HF folder, mesh=1x2): the weights a whole load gives, each placed on the
    mesh from a host array (a device array would have held the whole tensor on one device:
    a model larger than a device could not load)."""
    import torch
    import transformers

    from jaxspec import mesh as mesh_module
    from jaxspec.checkpoint import flatten_params
    from jaxspec.models import load_model
    from tests.conftest import tiny_hf_config

    config = tiny_hf_config()
    config.vocab_size, config.intermediate_size = 96, 88  # model=2 divides them
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    whole = flatten_params(load_model(tmp_path).params)
    placed, real_place = [], mesh_module.place

    def place(tree, specs, mesh):
        placed.extend(type(x) for x in jax.tree.leaves(tree))
        return real_place(tree, specs, mesh)

    monkeypatch.setattr(mesh_module, "place", place)
    loaded = load_model(tmp_path, mesh="data=1,model=2")
    assert loaded.mesh.shape == {"data": 1, "model": 2}  # decoding (Generator) splits on it
    split = flatten_params(loaded.params)
    assert len(placed) == len(whole) and set(placed) == {np.ndarray}
    for name, w in whole.items():
        np.testing.assert_array_equal(np.asarray(split[name]), np.asarray(w))
    q = split["layers.0.q_proj"]
    assert q.addressable_shards[0].data.size * 2 == q.size  # split over the model axis


TRAINERS = {  # method: (its flags for a seconds-long run, --batch, the loss its report shows)
    "medusa": (["--heads", "2", "--steps", "6"], 16, "final_loss_per_head"),
    "chimera": (["--rows", "8", "--heads", "2", "--steps", "3"], 2, "final_loss_per_head"),
    "sdsat": (["--spans", "4", "--window", "3", "--rank", "2", "--ids", "2", "--cpu-tree",
               "chain-3", "--steps", "3"], 2, "final_loss_per_depth"),
}  # fmt: skip


@pytest.mark.parametrize("method", list(TRAINERS))
def test_data_parallel_training_matches_one_device(method, tiny_ckpt, tmp_path, monkeypatch):
    """jaxspec-train METHOD --mesh data=2 (each step's batch split over two devices, the
    gradients summed by the compiled step): the losses and weights of one device, within
    float tolerance (sums in another order), with every batch array of every step held half
    by each device. The second run reuses the first's answers."""
    import importlib
    import shutil

    from jaxspec.checkpoint import load_checkpoint
    from jaxspec.drafters.store import load_drafter
    from tests.conftest import tiny_training_args, train_on_made_up_conversations

    flags, batch, loss = TRAINERS[method]
    trainer = importlib.import_module(f"train.{method}")
    skeleton = importlib.import_module("train.skeleton")
    monkeypatch.setattr(skeleton, "measure_acceptance", lambda *args: {})  # decoding: elsewhere
    split, batches = skeleton.Trainer.split_batch, []

    def recorded(self, *arrays):
        batches.append(split(self, *arrays))
        return batches[-1]

    monkeypatch.setattr(skeleton.Trainer, "split_batch", recorded)

    def run(name: str, *extra: str) -> dict:
        args = tiny_training_args(tiny_ckpt[0], tmp_path / name, train_seqs=6, batch=batch)
        return train_on_made_up_conversations(trainer, [*args, *flags, *extra])[0]

    one = run("one")
    shutil.copytree(tmp_path / "one", tmp_path / "two",
                    ignore=shutil.ignore_patterns("checkpoints", "out"))  # fmt: skip
    batches.clear()
    two = run("two", "--mesh", "data=2")
    held = [x for arrays in batches for x in arrays if x is not None]
    assert held and all(
        len(x.sharding.device_set) == 2 and x.sharding.shard_shape(x.shape)[0] * 2 == x.shape[0]
        for x in held
    )
    np.testing.assert_allclose(two[loss], one[loss], rtol=1e-3, atol=2e-4)  # reports round
    cfg, _ = load_checkpoint(tiny_ckpt[0])
    weights = [load_drafter(tmp_path / n / "out", method, cfg).params for n in ("one", "two")]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4), *weights)


def test_training_meshes_it_cannot_use_are_one_line_errors(tiny_ckpt, tmp_path, capsys):
    from tests.conftest import one_line_error, tiny_training_args
    from train.cli import main

    flags = tiny_training_args(tiny_ckpt[0], tmp_path, batch=3)
    err = one_line_error(main, ["medusa", *flags, "--mesh", "data=2"], capsys)
    assert "--batch 3 does not split over data=2 devices; use a multiple of 2" in err
    err = one_line_error(main, ["firp", *flags, "--mesh", "data=2"], capsys)
    assert "jaxspec-train firp does not split its batch over devices yet" in err
    err = one_line_error(main, ["ppd", *flags, "--mesh", "model=1"], capsys)
    assert "drop --mesh" in err
    assert "expected AXIS=N" in one_line_error(main, ["medusa", "--mesh", "rows=2"], capsys)


def test_ppd_on_stages_split_over_model_is_greedy():
    """PPD with model_split=2: each stage a data=1,model=2 mesh holding the model split in
    two (4 devices: the main stage and one shared by the sub-processes); AR's tokens, with
    sub-process states handed over between meshes."""
    from jaxspec.ppd import PpdGenerator

    cfg = dataclasses.replace(CFG4, n_layers=6)
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    prompt = [5, 6, 7, 8, 9]
    ar = SpeculativeGenerator(cfg, params).generate(prompt, 40).token_ids
    with pytest.warns(RuntimeWarning, match="shared"):
        gen = PpdGenerator(cfg, params, k=2, layer=3, model_split=2)
    assert gen.params["layers"][0]["q_proj"].sharding.spec == P(None, "model")
    assert gen.generate(prompt, 40).token_ids == ar
    assert any(gen.last_stats.matches)


def test_ppd_with_plain_products_splits_the_weights_as_the_table_says():
    """products="plain" on split stages: the weights are placed by the parameter table
    first, then multiplied in one pass; AR's tokens with the same products."""
    from jaxspec.layers import PlainProducts
    from jaxspec.ppd import PpdGenerator

    cfg = dataclasses.replace(CFG4, n_layers=6)
    params = compute_params(init_params(cfg, jax.random.key(0), scale=0.3), jnp.bfloat16)
    prompt = [5, 6, 7, 8, 9]
    ar = SpeculativeGenerator(cfg, params, products="plain").generate(prompt, 30).token_ids
    with pytest.warns(RuntimeWarning, match="shared"):
        gen = PpdGenerator(cfg, params, k=2, layer=3, model_split=2, products="plain")
        exact = PpdGenerator(cfg, params, k=2, layer=3, model_split=2, products="exact")
    q_proj, placed = gen.params["layers"][0]["q_proj"], exact.params["layers"][0]["q_proj"]
    assert isinstance(q_proj, PlainProducts)
    assert jax.tree.leaves(q_proj)[0].sharding == jax.tree.leaves(placed)[0].sharding
    assert gen.generate(prompt, 30).token_ids == ar


def test_guesses_over_a_vocabulary_split_three_ways_compile():
    """The TopK of a drafter's guesses behind its barrier, with the logits split over three
    devices by vocabulary (the default model on model=3): XLA:CPU's TopK decomposer aborted
    the process when the barrier took the TopK's two results as one tuple (eagle, and every
    dynamic tree). In a process of its own, since the failure was an abort."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from jaxspec import topology
        mesh = Mesh(np.array(jax.devices()[:3]), ("model",))
        logits = jnp.arange(1 * 4 * 96, dtype=jnp.float32).reshape(1, 4, 96) % 17
        split = jax.device_put(logits, NamedSharding(mesh, P(None, None, "model")))
        lp, index = jax.jit(lambda x: topology.top_log_probs(x, 8))(split)
        want = jax.lax.top_k(logits, 8)[1]
        print(bool((index == want).all()), lp.shape)
    """)
    flags = "--xla_force_host_platform_device_count=3 --xla_backend_optimization_level=0"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "XLA_FLAGS": flags}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "(1,", "4,", "8)"]
