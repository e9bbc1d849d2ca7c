"""LlamaConfig's checks, its reading of HF config.json (defaults taken from transformers'
own classes), HF export's fields, the presets (against published sizes and the default
model's own GGUF), checked_dtype and load_model's placement, and the `hf` peer row."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import transformers

from jaxspec.config import LlamaConfig, RopeScaling, preset
from jaxspec.errors import JaxspecError
from tests.conftest import tiny_family_config, tiny_hf_config

TINY = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=88)


def hf_dict(**changes) -> dict:
    """A tiny Llama config.json as transformers writes it, with `changes` (None: key removed)."""
    d = {**tiny_hf_config().to_dict(), **changes}
    return {k: v for k, v in d.items() if v is not None}


# ---- LlamaConfig's own checks: one JaxspecError each --------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"family": "gpt2"}, "family 'gpt2' is unknown"),
        ({"n_heads": 6, "n_kv_heads": 4, "dim": 96}, "n_heads=6 is not a multiple of n_kv_heads=4"),
        ({"head_dim": 15}, "head_dim=15 must be even"),
        ({"n_layers": True}, "n_layers must be an integer"),
        ({"n_layers": 0}, "n_layers must be positive"),
        ({"max_position": 0}, "max_position must be positive"),
        ({"head_dim": -2}, "head_dim must be positive"),
        ({"sliding_window": -1}, "sliding_window must be positive"),
        ({"sliding_window": 2.5}, "sliding_window must be an integer"),
        ({"qkv_bias": 1}, "qkv_bias must be true or false"),
        ({"norm_eps": float("nan")}, "norm_eps must be a positive number"),
        ({"norm_eps": 0.0}, "norm_eps must be a positive number"),
        ({"rope_theta": True}, "rope_theta must be a positive number"),
    ],
)
def test_a_bad_config_field_is_one_error(changes, message):
    """Each malformed field is refused when the config is made, naming the field."""
    with pytest.raises(JaxspecError, match=message):
        LlamaConfig(**{**TINY, **changes})


def test_freq_factors_come_exactly_with_their_kind():
    """RoPE kind freq_factors without factors (or factors on another kind) is refused."""
    with pytest.raises(JaxspecError, match="exactly when its kind is freq_factors"):
        RopeScaling("freq_factors")
    with pytest.raises(JaxspecError, match="exactly when its kind is freq_factors"):
        RopeScaling("linear", freq_factors=(1.0,))


def test_jaxspec_json_reading(tmp_path):
    """from_dict takes RoPE's default when rope_scaling is absent and refuses unknown keys;
    load names the file when a required key is missing."""
    cfg = LlamaConfig(**TINY)
    d = cfg.to_dict()
    del d["rope_scaling"]
    assert LlamaConfig.from_dict(d) == cfg
    with pytest.raises(JaxspecError, match=r"unknown config keys \['hidden'\]"):
        LlamaConfig.from_dict({**cfg.to_dict(), "hidden": 1})
    path = tmp_path / "jaxspec.json"
    path.write_text(json.dumps({k: v for k, v in cfg.to_dict().items() if k != "dim"}))
    with pytest.raises(JaxspecError, match=f"cannot read model config {path}"):
        LlamaConfig.load(path)


def test_an_unknown_preset_is_one_error():
    with pytest.raises(JaxspecError, match="unknown preset 'llama-9'; known: smollm2-135m"):
        preset("llama-9")


# ---- from_hf_config: what transformers would read ---------------------------------------


def test_absent_hf_fields_read_as_transformers_defaults():
    """A config.json without eps, tying, kv heads, eos or RoPE theta reads as transformers'
    LlamaConfig fills those in (eps 1e-6, untied, MHA, no eos, theta 10000)."""
    hf = transformers.LlamaConfig(hidden_size=48, num_attention_heads=4)
    absent = dict.fromkeys(["rms_norm_eps", "tie_word_embeddings", "num_key_value_heads",
                            "eos_token_id", "rope_parameters", "rope_theta"])  # fmt: skip
    cfg = LlamaConfig.from_hf_config(hf_dict(**absent))
    assert cfg.norm_eps == hf.rms_norm_eps
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert cfg.n_kv_heads == hf.num_key_value_heads == 4
    assert cfg.eos_token_ids == ()
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize("family", ["llama3.2", "mistral", "qwen2", "qwen3"])
def test_a_config_without_context_or_window_keys_reads_as_its_class(family):
    """No max_position_embeddings or sliding_window in config.json: the length and window
    are those the family's transformers class assumes (Llama 2048, Mistral 131072 with a
    4096 window, Qwen 32768), not one guess for all."""
    d = {k: v for k, v in tiny_family_config(family).to_dict().items()
         if k not in ("max_position_embeddings", "sliding_window")}  # fmt: skip
    hf = transformers.AutoConfig.for_model(**d)
    cfg = LlamaConfig.from_hf_config(d)
    assert cfg.max_position == hf.max_position_embeddings
    assert cfg.sliding_window == (hf.sliding_window if family == "mistral" else 0)


def test_rope_parameters_theta_wins_over_a_stale_top_level_one():
    """Both layouts in one file: transformers 5 reads rope_parameters' theta; so does jaxspec."""
    d = hf_dict(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    want = transformers.LlamaConfig(**d).rope_parameters["rope_theta"]
    assert LlamaConfig.from_hf_config(d).rope_theta == want == 1e6


def test_hf_name_and_old_configs_without_model_type():
    """The model's name is _name_or_path; with no model_type the class name gives the family."""
    assert LlamaConfig.from_hf_config(hf_dict(_name_or_path="org/m")).name == "org/m"
    mistral = {**tiny_family_config("mistral").to_dict(), "architectures": ["MistralForCausalLM"]}
    del mistral["model_type"]
    assert LlamaConfig.from_hf_config(mistral).family == "mistral"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_act": "gelu"}, "unsupported activation 'gelu'"),
        ({"mlp_bias": True}, "Llama with attention/mlp biases"),
        ({"model_type": "qwen3", "attention_bias": True}, "Qwen3 with attention biases"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "on some layers only"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ],
)
def test_hf_configs_jaxspec_cannot_run_are_refused(changes, message):
    """What jaxspec's block does not compute (activation, biases, partial windows, YaRN) is
    refused rather than run as something else."""
    with pytest.raises(JaxspecError, match=message):
        LlamaConfig.from_hf_config(hf_dict(**changes))


def test_a_qwen2_window_that_is_off_is_full_attention():
    """Qwen2.5's Hub configs name a sliding_window with use_sliding_window false: no window."""
    d = {**tiny_family_config("qwen2").to_dict(), "use_sliding_window": False, "sliding_window": 32}
    assert LlamaConfig.from_hf_config(d).sliding_window == 0


def test_a_window_spanning_the_context_is_full_attention():
    """A Mistral window as long as max_position_embeddings hides nothing: it reads as 0."""
    d = tiny_family_config("mistral").to_dict()
    n = d["max_position_embeddings"]
    assert LlamaConfig.from_hf_config({**d, "sliding_window": n}).sliding_window == 0
    assert LlamaConfig.from_hf_config({**d, "sliding_window": n - 1}).sliding_window == n - 1


# ---- to_hf_dict: the fields transformers itself writes ----------------------------------


@pytest.mark.parametrize("family", ["llama3.2", "mistral", "qwen2", "qwen3"])
def test_hf_export_writes_what_transformers_writes(family):
    """Every field to_hf_dict and transformers' own config.json of the same model both write
    (RoPE aside) is the same (one eos id as an int, the window, head_dim, the bias flags)."""
    hf = tiny_family_config(family).to_dict()
    ours = LlamaConfig.from_hf_config(hf).to_hf_dict()
    del ours["rope_scaling"], ours["rope_theta"]  # transformers 5 writes rope_parameters
    causal_lm = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    assert ours.pop("architectures") == [causal_lm[hf["model_type"]]]
    assert {k: hf[k] for k in ours if k in hf} == {k: v for k, v in ours.items() if k in hf}


def test_a_windowless_mistral_exports_no_window():
    """sliding_window None (transformers' "no window"), not 0; a llama config cannot hold one."""
    cfg = dataclasses.replace(LlamaConfig(**TINY), family="mistral")
    out = cfg.to_hf_dict()
    assert out["sliding_window"] is None
    assert transformers.MistralConfig(**out).sliding_window is None
    with pytest.raises(JaxspecError, match="llama HF configs cannot hold sliding_window"):
        dataclasses.replace(cfg, family="llama", sliding_window=8).to_hf_dict()


# ---- presets --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, n_params",
    [  # the published parameter counts (the models' safetensors totals)
        ("smollm2-135m", 134_515_008),
        ("llama-2-7b", 6_738_415_616),
        ("vicuna-7b", 6_738_415_616),
        ("llama-2-13b", 13_015_864_320),
        ("vicuna-13b", 13_015_864_320),
        ("codellama-7b", 6_738_546_688),
        ("codellama-13b", 13_016_028_160),
        ("llama-3-8b", 8_030_261_248),
    ],
)
def test_presets_have_the_published_sizes(name, n_params):
    assert preset(name).n_params == n_params


def test_llama_3_preset_rope_and_special_tokens():
    """Meta-Llama-3-8B(-Instruct)'s config.json: theta 500000, bos 128000, eos 128001/128009."""
    cfg = preset("llama-3-8b")
    assert (cfg.rope_theta, cfg.bos_token_id, cfg.eos_token_ids) == (5e5, 128000, (128001, 128009))
    assert (cfg.max_position, cfg.n_kv_heads, cfg.tie_embeddings) == (8192, 8, False)


def test_smollm2_preset_rope_and_special_tokens():
    """SmolLM2-135M-Instruct's config.json (and its packaged GGUF): theta 100000, 8192
    positions, eps 1e-5, bos 1, eos 2, tied embeddings."""
    cfg = preset("smollm2-135m")
    assert (cfg.rope_theta, cfg.max_position, cfg.norm_eps) == (1e5, 8192, 1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.tie_embeddings) == (1, (2,), True)


# ---- models: checked_dtype and load_model ---------------------------------------------


def test_checked_dtype_keeps_none_as_stored(tmp_path, tiny_ckpt):
    """dtype None means "as stored": a bfloat16 checkpoint converted again stays bfloat16."""
    import jax
    import ml_dtypes

    from jaxspec.checkpoint import load_checkpoint
    from jaxspec.convert import convert
    from jaxspec.models import checked_dtype

    assert checked_dtype(None) is None and checked_dtype("bfloat16") == ml_dtypes.bfloat16
    convert(tiny_ckpt[0], tmp_path / "bf16", dtype="bfloat16")
    convert(tmp_path / "bf16", tmp_path / "again")
    leaves = load_checkpoint(tmp_path / "again", on_host=True)[1]
    assert {w.dtype for w in jax.tree.leaves(leaves)} == {np.dtype(ml_dtypes.bfloat16)}


def test_an_hf_folder_loads_onto_the_device(tmp_path):
    """load_model(HF folder): jax arrays (not host numpy), and bytes_per_device counts them."""
    import jax

    from jaxspec.models import load_model
    from tests.conftest import save_tiny

    hf_dir, _ = save_tiny(tmp_path, n_kv_heads=2)
    model = load_model(hf_dir, dtype="float32")
    leaves = jax.tree.leaves(model.params)
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert model.bytes_per_device() == sum(x.nbytes for x in leaves)
    assert model.weight_dtype == np.float32


# ---- the hf peer row --------------------------------------------------------------------


@pytest.fixture(scope="module")
def peer_model(tiny_ckpt):
    """(cfg, params) of the tiny checkpoint."""
    from jaxspec.checkpoint import load_checkpoint

    return load_checkpoint(tiny_ckpt[0])


def test_the_peer_stops_at_any_eos_and_counts_its_tokens(peer_model):
    """HFPeer.generate returns only new tokens, one step each, and stops at the second eos
    id as at the first."""
    from jaxspec.hf_peer import HFPeer

    cfg, params = peer_model
    prompt = [5, 6, 7]
    free, steps, _ = HFPeer(dataclasses.replace(cfg, eos_token_ids=(0,)), params).generate(
        prompt, 12
    )
    assert len(free) == steps == 12
    stop = next(t for t in free[2:] if t not in free[:2] and t != 0)  # a token drawn later
    cut = free[: free.index(stop) + 1]
    got, steps, _ = HFPeer(dataclasses.replace(cfg, eos_token_ids=(0, stop)), params).generate(
        prompt, 12
    )
    assert got == cut and steps == len(cut)


def test_the_peer_runs_bfloat16_weights(peer_model):
    """A model loaded in bfloat16 (OutIn block weights) runs in the peer: its weights upcast."""
    import jax
    import jax.numpy as jnp

    from jaxspec.hf_peer import HFPeer
    from jaxspec.llama import compute_params

    cfg, params = peer_model
    bf16 = compute_params(params, "bfloat16")
    up = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), params)
    assert HFPeer(cfg, bf16).generate([5, 6, 7], 6)[0] == HFPeer(cfg, up).generate([5, 6, 7], 6)[0]
