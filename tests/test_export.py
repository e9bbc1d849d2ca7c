"""Every compiled program of decoding lowers for CUDA and TPU from this CPU host
(jax.export), with nothing on it that only a CPU host runs (`pytest -k export`)."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxspec import export, sampling
from jaxspec.config import preset
from jaxspec.decode import SpeculativeGenerator
from jaxspec.drafters.chimera import ChimeraSettings
from jaxspec.drafters.eagle import EagleSettings
from jaxspec.drafters.firp import FirpSettings
from jaxspec.drafters.lookup import LookupSettings
from jaxspec.drafters.medusa import MedusaSettings
from jaxspec.drafters.sdsat import SdsatSettings
from jaxspec.llama import compute_params, init_params
from jaxspec.methods import make_drafter
from jaxspec.ppd import PpdGenerator
from jaxspec.sampling import Sampling
from jaxspec.tree import tree_preset

CFG = dataclasses.replace(preset("tiny-gqa"), n_layers=4)
SETTINGS = {
    "ar": None,
    "medusa": MedusaSettings(n_heads=2),
    "firp": FirpSettings(layers=(2, 4), chains=2),
    "chimera": ChimeraSettings(n_heads=2),
    "sdsat": SdsatSettings(rank=2),
    "lookup": LookupSettings(),
    "eagle": EagleSettings(layers=(1, 2, 4), depth=3),
}
# a chain, and a branching tree (with sampling: plain and typical acceptance)
CASES = [
    ("chain-2", Sampling()),
    ("comb-2-2", Sampling()),
    ("comb-2-2", Sampling(0.8, top_p=0.9)),
    ("comb-2-2", Sampling(0.8, typical=True)),
]
DATA = {"firp": {"test_topk_accuracy": jnp.array([[0.5, 0.7], [0.3, 0.5]])}}


@functools.cache
def params():
    return init_params(CFG, jax.random.key(0))


def generator(method: str, tree: str, how: Sampling, settings=None,
              **options) -> SpeculativeGenerator:  # fmt: skip
    if method == "ar":
        return SpeculativeGenerator(CFG, params(), sampling=how)
    spec = tree_preset(tree)
    settings = settings or SETTINGS[method]
    drafter = make_drafter(method, CFG, settings, **options)
    weights = drafter.init(params(), jax.random.key(1))
    weights = drafter.prepare(params(), weights, DATA.get(method, {}))
    drafter = drafter.for_tree(spec, settings, DATA.get(method, {}))
    return SpeculativeGenerator(CFG, params(), drafter, weights, spec, how)


@pytest.mark.parametrize("tree, how", CASES, ids=lambda x: getattr(x, "label", None) or str(x))
@pytest.mark.parametrize("method", list(SETTINGS))
def test_export_decoding_programs(method, tree, how):
    gen = generator(method, tree, how)
    plan = gen.lowerings(*gen.example_inputs(2, 16, 64))
    assert ("redraft" in plan) == (method == "sdsat")  # SDSAT's draft step, its own program
    if tree != "comb-2-2" or not how.greedy:  # the rest do not depend on tree or sampling
        plan = {"step": plan["step"]}
    export.export_all(plan)  # raises NotPortable where a program does not export


@pytest.mark.parametrize("tree", ["comb-2-2", "dynamic-8"])
def test_export_eagle_of_two_blocks(tree):
    settings = dataclasses.replace(SETTINGS["eagle"], blocks=2)
    gen = generator("eagle", tree, Sampling(), settings)
    plan = gen.lowerings(*gen.example_inputs(2, 16, 64))
    exported = export.export_all({k: plan[k] for k in ("prefill", "step")})
    assert set(exported["step"]) == set(export.ACCELERATORS)


@pytest.mark.parametrize("method", ["ar", "chimera"])
def test_export_chunked_prefill_with_plain_products(method):
    """A long prompt's chunk programs (extend, the last chunk's prefill after the cache),
    with bfloat16 weights multiplied in one pass in the prefill."""
    gen = generator(method, "comb-2-2", Sampling())
    bf16 = compute_params(params(), jnp.bfloat16)
    gen = SpeculativeGenerator(CFG, bf16, gen.drafter, gen.drafter_params, gen.tree,
                               products="plain-prefill", prefill_chunk=16)  # fmt: skip
    plan = gen.lowerings(*gen.example_inputs(2, 16, 64, chunked=True))
    exported = export.export_all({k: plan[k] for k in ("extend", "prefill")})
    assert "bf16" in exported["extend"]["cuda"].mlir_module()


def test_export_plain_prefill_attention_multiplies_in_bfloat16():
    """Under plain-prefill a long prompt's attention products (batched 4-d dots: the
    chunk's scores and weighted values, block by block) are bfloat16 ones in the exported
    chunk programs; with exact products they stay float32."""
    attention_bf16 = re.compile(r"stablehlo\.dot_general[^\n]*tensor<\d+x\d+x\d+x\d+xbf16>")
    bf16 = compute_params(params(), jnp.bfloat16)
    for products, expected in (("plain-prefill", True), ("exact", False)):
        gen = SpeculativeGenerator(CFG, bf16, products=products, prefill_chunk=16)
        plan = gen.lowerings(*gen.example_inputs(2, 16, 64, chunked=True))
        exported = export.export_all({k: plan[k] for k in ("extend", "prefill")})
        for name, by_platform in exported.items():
            module = by_platform["cuda"].mlir_module()
            assert bool(attention_bf16.search(module)) == expected, (name, products)


@pytest.mark.parametrize(
    "changes",
    [{"qkv_bias": True}, {"qk_norm": True, "head_dim": 12}, {"sliding_window": 8}],
    ids=["qwen2", "qwen3", "mistral"],
)
def test_export_family_programs(changes):
    """The families' block differences (biases, q/k norms, the window's mask) on the
    prefill and verify step of Chimera, whose encoder is a copy of a decoder layer."""
    cfg = dataclasses.replace(CFG, **changes)
    weights = init_params(cfg, jax.random.key(0))
    drafter = make_drafter("chimera", cfg, SETTINGS["chimera"])
    drafter_weights = drafter.init(weights, jax.random.key(1))
    gen = SpeculativeGenerator(cfg, weights, drafter, drafter_weights, tree_preset("comb-2-2"))
    plan = gen.lowerings(*gen.example_inputs(2, 16, 64))
    export.export_all({k: plan[k] for k in ("prefill", "step")})


def test_export_sdsat_one_forward_and_its_draft_step():
    two = generator("sdsat", "comb-2-2", Sampling())
    assert "redraft" in two.lowerings(*two.example_inputs(1, 16, 64))
    one = generator("sdsat", "chain-2", Sampling(), sdsat_loop="one-forward")
    plan = one.lowerings(*one.example_inputs(1, 16, 64))
    assert "redraft" not in plan
    export.export_all({"step": plan["step"]})


def test_export_ppd_programs():
    gen = PpdGenerator(CFG, params(), k=2, layer=2, devices=jax.devices()[:3])
    exported = export.export_all(gen.lowerings(16, 64))
    want = {"prefill", "extend_prompt", "prefill_last_chunk", "sub_process_layers",
            "early_top", "commit_round"}  # fmt: skip
    assert want <= set(exported)


def test_export_nucleus_takes_the_lowering_platforms_path():
    """The top-p filter's path is the target platform's, not the host's: the CPU program
    searches top-k candidates row by row (a while loop over rows), the CUDA and TPU ones
    sort every row and take no top-k. (Not "no while loop" on an accelerator: jax 0.11
    lowers a GPU cumsum to a scan whose exported form is one.)"""

    @jax.jit
    def keep(logits):
        return sampling._keep_nucleus(logits, 0.9)

    logits = jax.ShapeDtypeStruct((2, 3, 5000), jnp.float32)
    text = {p: jax.export.export(keep, platforms=[p])(logits).mlir_module() for p in
            ("cpu", *export.ACCELERATORS)}  # fmt: skip
    assert "stablehlo.while" in text["cpu"] and "chlo.top_k" in text["cpu"]
    for p in export.ACCELERATORS:
        assert "chlo.top_k" not in text[p] and "stablehlo.sort" in text[p], p


def test_export_refuses_host_callbacks():
    """The check fails on a program that calls back into the host."""

    @jax.jit
    def with_callback(x):
        back = jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return back + 1

    for p in export.ACCELERATORS:
        with pytest.raises(export.NotPortable):
            export.export(with_callback, (jnp.ones(3),), {}, p)
    export.export(jax.jit(lambda x: x + 1), (jnp.ones(3),), {}, "cuda")  # the same, no callback


def test_export_refuses_float64_and_reads_no_source_names():
    """float64 (a host-side value leaked into a program) is refused; a source location's
    names are not code (a function called f64 exports), and the program is the platform's."""
    with jax.enable_x64(True), pytest.raises(export.NotPortable, match="holds float64"):
        export.export(jax.jit(lambda x: x * 2), (jnp.ones(3, jnp.float64),), {}, "cuda")

    def f64(x):
        return x + 1

    for p in export.ACCELERATORS:
        assert export.export(jax.jit(f64), (jnp.ones(3),), {}, p).platforms == (p,)
