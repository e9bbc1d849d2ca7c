"""GGUF import of each family as llama.cpp writes it (Llama 3.2 and Mistral as the llama
architecture, qwen2, qwen3), F32 with F16, Q8_0 and Q4_1 tensors among them, against HF's
logits."""

from __future__ import annotations

import dataclasses
import json
import re
import weakref

import numpy as np
import pytest
import torch

from checkpoints_convert.cli import main as convert_main
from jaxspec.checkpoint import load_checkpoint
from jaxspec.config import LlamaConfig, RopeScaling, preset
from jaxspec.convert import convert
from jaxspec.errors import JaxspecError
from tests.conftest import FAMILIES, VOCAB, one_line_error, tiny_family_config
from tests.test_convert import hf_logits
from tests.test_parity_hf import jax_logits

ARCH = {"llama3.2": "llama", "llama-linear": "llama", "mistral": "llama", "qwen2": "qwen2",
        "qwen3": "qwen3"}  # fmt: skip
# Tensors not in F32 (llama.cpp keeps norms and biases in F32 whatever the file type); the
# llama architecture's ffn_down in Q4_1, the default model's GGUF type.
QTYPES = {
    "token_embd.weight": "F16",
    "attn_q.weight": "F16",
    "ffn_down.weight": "Q8_0",
}
LLAMA_QTYPES = {**QTYPES, "ffn_down.weight": "Q4_1"}
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


def tiny_model(family: str):
    """conftest's tiny model of `family` ("llama-linear": Llama 3.2 with linear RoPE scaling)
    with F = 64, so down_proj's rows [F] fill Q8_0's blocks of 32."""
    from transformers import AutoModelForCausalLM

    config = tiny_family_config("llama3.2" if family == "llama-linear" else family)
    config.intermediate_size = 64
    if family == "llama-linear":
        config.rope_parameters = LINEAR
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.15 * torch.randn_like(p))
    return model


def llama_cpp_permute(x: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows [heads*H, D]: per head HF's (2, pair) -> llama.cpp's (pair, 2)."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(x.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """rope_freqs [H/2] as llama.cpp computes it for llama3 scaling: the divisor of each
    inverse frequency (llama.cpp reads original_max_position_embeddings from the top level,
    defaulting to Llama 3.1's 8192; this model's 32 sits in its rope parameters)."""
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    old_len, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (old_len / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen > old_len / low, factor, middle)
    return np.where(wavelen < old_len / high, 1.0, factors).astype(np.float32)


def write_metadata(w, cfg, family: str) -> None:
    """Hyperparameters as llama.cpp's convert_hf_to_gguf.py writes them for `family`."""
    import gguf

    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if cfg.rope_parameters["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if family == "mistral":
        w.add_sliding_window(cfg.sliding_window)
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(eos[0])
    if len(eos) > 1:  # Llama 3's <|eot_id|>
        w.add_eot_token_id(eos[1])


def write_gguf(path, model, family: str) -> None:
    """Write `model` as llama.cpp does for `family` (tensors in QTYPES quantised, llama's q/k
    rows permuted), then give `model` the weights the file holds (dequantised)."""
    import gguf
    from gguf.quants import dequantize, quantize

    cfg, arch = model.config, ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    write_metadata(w, cfg, family)
    if cfg.rope_parameters["rope_type"] == "llama3":
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg.rope_parameters, head_dim))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    heads = {"attn_q.weight": cfg.num_attention_heads, "attn_k.weight": cfg.num_key_value_heads}
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))  # blk.0.attn_q.weight
        kind = re.sub(r"^blk\.\d+\.", "", name)
        qtypes = LLAMA_QTYPES if arch == "llama" else QTYPES
        qtype = gguf.GGMLQuantizationType[qtypes.get(kind, "F32")]
        x = tensor.numpy()  # [out, in] or [out]
        stored = llama_cpp_permute(x, heads[kind]) if arch == "llama" and kind in heads else x
        w.add_tensor(name, quantize(stored, qtype), raw_dtype=qtype)
        # Blocks lie within rows: quantising permuted rows gives the same values.
        held = dequantize(quantize(x, qtype), qtype)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(held))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", [*FAMILIES, "llama-linear"])
def test_gguf_family_matches_hf(tmp_path, family):
    model = tiny_model(family)
    write_gguf(tmp_path / "tiny.gguf", model, family)
    convert(tmp_path / "tiny.gguf", tmp_path / "ours")
    cfg, _ = load_checkpoint(tmp_path / "ours")
    hf_cfg = LlamaConfig.from_hf_config(model.config)
    fields = ("family", "qkv_bias", "qk_norm", "sliding_window", "head_dim", "tie_embeddings")
    for field in (*fields, "n_kv_heads", "rope_theta", "bos_token_id", "eos_token_ids"):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    kind = {"llama3.2": "freq_factors", "llama-linear": "linear"}.get(family, "default")
    assert cfg.rope_scaling.kind == kind
    # 40 tokens: past the Mistral window (16) and llama3's original context (32).
    tokens = np.random.default_rng(0).integers(0, VOCAB, (1, 40))
    np.testing.assert_allclose(
        jax_logits(tmp_path / "ours", tokens)[0], hf_logits(model, tokens), atol=1e-4, rtol=1e-4
    )


def test_a_gguf_is_cast_tensor_by_tensor(tmp_path, monkeypatch):
    """load_model(.gguf, dtype="bfloat16"): each tensor is cast as it is dequantised (all of
    a 70B GGUF in float32 would need ~280 GB of host memory), to the weights a float32 load
    gives cast."""
    import gguf.quants
    import jax
    import jax.numpy as jnp

    from jaxspec.checkpoint import flatten_params
    from jaxspec.models import load_model

    write_gguf(tmp_path / "tiny.gguf", tiny_model("llama3.2"), "llama3.2")
    whole = flatten_params(load_model(tmp_path / "tiny.gguf").params)
    dequantised, real_dequantize = [], gguf.quants.dequantize

    def dequantize(data, qtype):  # [out, in] or [out] float32; none earlier still held
        assert all(w() is None for w in dequantised)
        out = real_dequantize(data, qtype)
        dequantised.append(weakref.ref(out))
        return out

    monkeypatch.setattr(gguf.quants, "dequantize", dequantize)
    cast = flatten_params(load_model(tmp_path / "tiny.gguf", dtype="bfloat16").params)
    assert len(dequantised) == len(whole) + 1  # and rope_freqs
    for name, w in whole.items():
        assert cast[name].dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(cast[name], jax.device_get(w).astype(jnp.bfloat16))


def test_unsupported_architecture_is_one_line_error(tmp_path, capsys):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    argv = [str(tmp_path / "gemma.gguf"), "--out", str(tmp_path / "o")]
    err = one_line_error(convert_main, argv, capsys)
    assert "'gemma'" in err and "llama, qwen2, qwen3" in err


def test_freq_factors_refuse_hf_export():
    rope = RopeScaling("freq_factors", freq_factors=(1.0, 2.0) * 4)  # [H/2] = 8
    cfg = dataclasses.replace(preset("tiny-mha"), rope_scaling=rope)
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # list -> tuple
    with pytest.raises(JaxspecError, match="export from the original HF folder instead"):
        cfg.to_hf_dict()
