"""Converters: HF round trip, GGUF import, and one clear error for each kind of bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from checkpoints_convert.cli import main as convert_main
from jaxspec.checkpoint import WEIGHTS_FILE, load_checkpoint
from jaxspec.convert import convert
from jaxspec.convert.gguf import unpermute_rope_rows
from jaxspec.errors import JaxspecError
from tests.conftest import one_line_error, save_tiny


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_hf_jaxspec_hf(tmp_path, tie):
    from transformers import LlamaForCausalLM

    hf_dir, model = save_tiny(tmp_path, tie=tie)
    convert(hf_dir, tmp_path / "ours")
    convert(tmp_path / "ours", tmp_path / "back", to="hf")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    tokens = np.arange(5, 40)[None]
    np.testing.assert_allclose(hf_logits(back, tokens), hf_logits(model, tokens), rtol=0, atol=0)
    assert (tmp_path / "back" / "tokenizer.json").is_file()


def test_conversions_never_put_a_weight_on_a_device(tmp_path):
    """HF (bfloat16) -> jaxspec -> HF and GGUF -> jaxspec run on the host alone (a device
    would have to hold every tensor of a 70B model at once), and keep the stored dtype."""
    import jax
    from transformers import LlamaForCausalLM

    hf_dir, model = save_tiny(tmp_path)
    model.to(torch.bfloat16).save_pretrained(hf_dir, safe_serialization=True)
    write_tiny_gguf(tmp_path / "tiny.gguf", model.float())
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        convert(hf_dir, tmp_path / "ours")
        convert(tmp_path / "ours", tmp_path / "back", to="hf")
        convert(tmp_path / "tiny.gguf", tmp_path / "from-gguf")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.bfloat16)
    original = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["vocab_size"] == 101
    assert (tmp_path / "from-gguf" / WEIGHTS_FILE).is_file()


def test_each_source_is_read_in_the_dtype_asked_for(tmp_path):
    """An HF folder or a checkpoint read for loading in bfloat16 is cast tensor by tensor on
    the host (a float32 copy of a 70B model beside it would need ~280 GB)."""
    import jax
    import ml_dtypes

    from jaxspec.convert import load_any

    hf_dir, _ = save_tiny(tmp_path)
    convert(hf_dir, tmp_path / "ours")
    for src in (hf_dir, tmp_path / "ours"):
        stored = jax.tree.leaves(load_any(src)[1])
        cast = jax.tree.leaves(load_any(src, ml_dtypes.bfloat16)[1])
        assert {w.dtype for w in stored} == {np.dtype(np.float32)}
        for w, c in zip(stored, cast, strict=True):
            assert isinstance(c, np.ndarray) and c.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(c, w.astype(ml_dtypes.bfloat16))


def test_convert_writes_the_dtype_asked_for(tmp_path):
    """jaxspec-convert --dtype bfloat16 of a GGUF (dequantised to float32 by default) and of
    a checkpoint: the weights of the default conversion, cast."""
    import jax
    import ml_dtypes

    _, model = save_tiny(tmp_path)
    write_tiny_gguf(tmp_path / "tiny.gguf", model)
    convert_main([str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "f32")])
    for src in ("tiny.gguf", "f32"):
        out = tmp_path / f"bf16-from-{src}"
        convert_main([str(tmp_path / src), "--out", str(out), "--dtype", "bfloat16"])
        stored = jax.tree.leaves(load_checkpoint(tmp_path / "f32", on_host=True)[1])
        cast = jax.tree.leaves(load_checkpoint(out, on_host=True)[1])
        assert {w.dtype for w in stored} == {np.dtype(np.float32)}
        for w, c in zip(stored, cast, strict=True):
            assert c.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(c, w.astype(ml_dtypes.bfloat16))
    with pytest.raises(JaxspecError, match="unknown dtype 'float16'"):
        convert(tmp_path / "f32", tmp_path / "f16", dtype="float16")


def test_unpermute_inverts_llama_cpp_order():
    # llama.cpp's q/k layout, per head: (2, pair) -> (pair, 2).
    w = np.arange(2 * 8 * 3).reshape(16, 3)
    permuted = w.reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, 2), w)


def write_tiny_gguf(path, model):
    """Write `model` as llama.cpp does: F32 tensors, q/k rows permuted, GGUF names."""
    import gguf

    cfg = model.config
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    def permute(x, heads):
        return x.reshape(heads, 2, x.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(x.shape)

    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            x = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                x = permute(x, cfg.num_attention_heads)
            elif gg == "attn_k":
                x = permute(x, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_import_matches_hf(tmp_path):
    from transformers import AutoModelForCausalLM

    _, model = save_tiny(tmp_path, n_kv_heads=2, tokenizer=False)
    write_tiny_gguf(tmp_path / "tiny.gguf", model)
    tokens = np.arange(3, 60)[None]
    # transformers' own GGUF reader (an independent un-permute) agrees with the original...
    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    )
    np.testing.assert_allclose(hf_logits(theirs, tokens), hf_logits(model, tokens), atol=1e-5)
    # ...and so does ours.
    convert(tmp_path / "tiny.gguf", tmp_path / "ours")
    from tests.test_parity_hf import jax_logits

    np.testing.assert_allclose(
        jax_logits(tmp_path / "ours", tokens)[0], hf_logits(model, tokens), atol=1e-4, rtol=1e-4
    )


# ---- bad inputs: one line, naming the problem and the fix ---------------------------


def convert_error(capsys, src, out) -> str:
    return one_line_error(convert_main, [str(src), "--out", str(out)], capsys)


def test_missing_source(tmp_path, capsys):
    err = convert_error(capsys, tmp_path / "nope", tmp_path / "o")
    assert "no such file or folder" in err


def test_corrupt_safetensors(tmp_path, capsys):
    hf_dir, _ = save_tiny(tmp_path)
    (hf_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    err = convert_error(capsys, hf_dir, tmp_path / "o")
    assert "corrupt safetensors" in err


def test_wrong_architecture(tmp_path, capsys):
    hf_dir, _ = save_tiny(tmp_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    err = convert_error(capsys, hf_dir, tmp_path / "o")
    assert "unsupported architecture 'gpt2'" in err


def test_generation_config_adds_stop_tokens_or_names_itself(tmp_path, capsys):
    hf_dir, _ = save_tiny(tmp_path)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    convert(hf_dir, tmp_path / "ok")
    assert load_checkpoint(tmp_path / "ok")[0].eos_token_ids == (2, 7)
    (hf_dir / "generation_config.json").write_text("[1, 2]")
    err = convert_error(capsys, hf_dir, tmp_path / "o")
    assert "cannot read" in err and "generation_config.json" in err


def test_hf_export_refuses_a_flag_its_family_cannot_hold():
    import dataclasses

    from jaxspec.config import preset

    cfg = dataclasses.replace(preset("tiny-gqa"), sliding_window=8)  # family llama
    with pytest.raises(JaxspecError, match="llama HF configs cannot hold sliding_window"):
        cfg.to_hf_dict()
    assert dataclasses.replace(cfg, family="mistral").to_hf_dict()["sliding_window"] == 8


def test_missing_and_misshapen_keys_listed_together(tmp_path):
    from safetensors.numpy import load_file, save_file

    hf_dir, _ = save_tiny(tmp_path)
    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, hf_dir / "model.safetensors")
    with pytest.raises(JaxspecError) as e:
        convert(hf_dir, tmp_path / "o")
    assert "missing model.layers.1.mlp.up_proj.weight" in str(e.value)
    assert "unexpected model.extra.weight" in str(e.value)

    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["intermediate_size"] = 84  # every mlp tensor is now the wrong shape
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    save_tiny(tmp_path, name="hf2")
    (tmp_path / "hf2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(JaxspecError, match=r"gate_proj has shape \(48, 83\), expected \(48, 84\)"):
        convert(tmp_path / "hf2", tmp_path / "o")


def test_corrupt_jaxspec_checkpoint(tiny_ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt[0], bad)
    (bad / WEIGHTS_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(JaxspecError, match="corrupt or unreadable weights .* convert again"):
        load_checkpoint(bad)
    with pytest.raises(JaxspecError, match="no jaxspec checkpoint at .*jaxspec-convert"):
        load_checkpoint(tmp_path / "nothing")


def test_a_checkpoint_missing_its_weights_or_with_a_damaged_tokenizer(tiny_ckpt, tmp_path):
    """Named as what they are (not "no config.json", not a JSONDecodeError), with the fix."""
    import shutil

    from jaxspec.models import load_model

    half = tmp_path / "half"
    shutil.copytree(tiny_ckpt[0], half)
    (half / WEIGHTS_FILE).unlink()
    missing = "holds a jaxspec jaxspec.json but no model.safetensors .*jaxspec-convert"
    with pytest.raises(JaxspecError, match=missing):
        load_model(half)
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_ckpt[0], damaged)
    (damaged / "tokenizer.json").write_text("{\n oops")
    with pytest.raises(JaxspecError, match=f"cannot read the tokenizer in {damaged} .*convert"):
        load_model(damaged)


def test_not_a_gguf_file(tmp_path, capsys):
    (tmp_path / "x.bin").write_bytes(b"1234")
    err = convert_error(capsys, tmp_path / "x.bin", tmp_path / "o")
    assert "not a .gguf file" in err
    (tmp_path / "x.gguf").write_bytes(b"1234")
    err = convert_error(capsys, tmp_path / "x.gguf", tmp_path / "o")
    assert "cannot read GGUF file" in err and "download it again" in err
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x01\x00")  # a header cut short
    err = convert_error(capsys, tmp_path / "cut.gguf", tmp_path / "o")
    assert "one cut short; download it again" in err


def test_sharded_hf_folder(tmp_path):
    from tests.conftest import tiny_hf_model
    from tests.test_parity_hf import jax_logits

    model = tiny_hf_model(n_kv_heads=1)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="30KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    convert(tmp_path / "sharded", tmp_path / "ours")
    tokens = np.arange(5, 30)[None]
    np.testing.assert_allclose(
        jax_logits(tmp_path / "ours", tokens)[0], hf_logits(model, tokens), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("flags", [[], ["--if-missing"]])
def test_the_default_model_into_a_users_folder_needs_overwrite(tmp_path, capsys, flags):
    """Without SRC the packaged model converts into the cache, which is jaxspec's own; an
    --out the user named is theirs, refused when it holds files (as with SRC)."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "tokenizer.json").write_text("mine")
    err = one_line_error(convert_main, ["--out", str(out), *flags], capsys)
    assert "is not empty" in err and "--overwrite" in err
    assert (out / "tokenizer.json").read_text() == "mine"


# ---- HF config.json in both transformers layouts, and HF export's config ----------------


def test_transformers_4_config_layout_reads_as_5s():
    """config.json as transformers 4.x writes it (the Hub's Llama 3.x configs): rope_theta
    at the top level and the scaling in rope_scaling (with "type" in older files) gives
    the config transformers 5's rope_parameters give."""
    from jaxspec.config import LlamaConfig, RopeScaling
    from tests.conftest import tiny_hf_config
    from tests.test_parity_hf import ROPES

    rope = ROPES["llama3"]
    new = tiny_hf_config(rope=rope).to_dict()
    want = LlamaConfig.from_hf_config(new)
    assert (want.rope_scaling.kind, want.rope_theta) == ("llama3", 500.0)
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old["rope_theta"] = rope["rope_theta"]
    old["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    assert LlamaConfig.from_hf_config(old) == want
    old["rope_scaling"] = {"type": "linear", "factor": 2.5}
    assert LlamaConfig.from_hf_config(old).rope_scaling == RopeScaling("linear", factor=2.5)


@pytest.mark.parametrize("family", ["llama3.2", "mistral", "qwen2", "qwen3"])
def test_hf_export_config_reads_back_the_same(family):
    """cfg.to_hf_dict() read by from_hf_config gives cfg back: every field HF export writes
    (RoPE scaling of each kind, one or several eos ids, bos, eps, window, head_dim)."""
    import dataclasses

    from jaxspec.config import LlamaConfig, RopeScaling
    from tests.conftest import tiny_family_config

    cfg = LlamaConfig.from_hf_config(tiny_family_config(family))
    linear = RopeScaling("linear", factor=2.5)
    variants = [cfg, dataclasses.replace(cfg, rope_scaling=linear, norm_eps=1e-3, bos_token_id=7,
                                         eos_token_ids=(2, 5, 9), max_position=300)]  # fmt: skip
    for c in variants:
        assert LlamaConfig.from_hf_config(c.to_hf_dict()) == dataclasses.replace(c, name=c.family)


def test_tied_folder_that_also_stores_lm_head(tmp_path):
    """Some tied checkpoints store lm_head.weight too (a copy of the embeddings): it is
    ignored, not an error, and the tied embeddings project the logits."""
    from safetensors.numpy import load_file, save_file

    from tests.test_parity_hf import jax_logits

    hf_dir, model = save_tiny(tmp_path, tie=True, tokenizer=False)
    tensors = load_file(hf_dir / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    convert(hf_dir, tmp_path / "ours")
    assert load_checkpoint(tmp_path / "ours")[0].tie_embeddings
    tokens = np.arange(5, 30)[None]
    np.testing.assert_allclose(
        jax_logits(tmp_path / "ours", tokens)[0], hf_logits(model, tokens), atol=1e-4, rtol=1e-4
    )


def test_generation_config_with_one_eos_id(tmp_path):
    """generation_config.json's eos_token_id as a single id (not a list) is a stop token too."""
    from jaxspec.convert.hf import read_hf_config

    hf_dir, _ = save_tiny(tmp_path, tokenizer=False)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert read_hf_config(hf_dir).eos_token_ids == (2, 7)
