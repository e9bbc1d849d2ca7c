"""GGUF files (llama.cpp) of the llama, qwen2 and qwen3 architectures, read with the `gguf`
package and dequantised to float32."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np

from jaxspec.config import LlamaConfig, RopeScaling
from jaxspec.convert.keys import params_from_hf
from jaxspec.errors import JaxspecError

# general.architecture values read; metadata keys are prefixed by it ("qwen2.block_count").
ARCHITECTURES = ("llama", "qwen2", "qwen3")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # [H/2] divisors of the inverse frequencies (Llama 3.1)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (interleaved rotary pairs) back to HF's split halves.

    w [heads*H, D]: llama.cpp stores each head's rows as (pair, 2) where HF has (2, pair).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _open(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises many types on malformed files
        raise JaxspecError(
            f"cannot read GGUF file {path} ({e}): not a GGUF file the gguf package reads (its "
            "version or quantization), or one cut short; download it again, or upgrade gguf"
        ) from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader, path: Path) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise JaxspecError(
            f"{path} holds a {arch!r} model; jaxspec reads the GGUF architectures "
            + ", ".join(ARCHITECTURES)
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise JaxspecError(f"{path} lacks the tensor token_embd.weight")

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    def need(key):
        value = get(key)
        if value is None:
            raise JaxspecError(f"{path} lacks the metadata key {arch}.{key}")
        return value

    n_heads = need("attention.head_count")
    head_dim = get("attention.key_length") or need("embedding_length") // n_heads
    max_position = get("context_length", 4096)
    # Mistral is written as llama; a window as long as the context changes nothing.
    window = get("attention.sliding_window", 0) if arch == "llama" else 0
    window = window if window < max_position else 0
    return LlamaConfig(
        vocab_size=int(get("vocab_size") or tensors["token_embd.weight"].shape[-1]),
        dim=need("embedding_length"),
        n_layers=need("block_count"),
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv") or n_heads,
        ffn_dim=need("feed_forward_length"),
        head_dim=head_dim,
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base") or 10000.0),
        rope_scaling=_rope_scaling(reader, arch, path, tensors.get(_ROPE_FREQS), head_dim),
        tie_embeddings="output.weight" not in tensors,
        max_position=max_position,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(reader),
        name=str(_field(reader, "general.name") or path.stem),
        family="mistral" if window else arch,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        sliding_window=window,
    )


def _rope_scaling(reader, arch: str, path: Path, freqs, head_dim: int) -> RopeScaling:
    """Linear scaling from the metadata, or rope_freqs' per-frequency divisors [H/2]."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if freqs is not None:
        kind = "rope_freqs" if kind == "none" else f"{kind} with rope_freqs"
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        factor = _field(reader, f"{arch}.rope.scaling.factor", 1.0)
        return RopeScaling("linear", factor=float(factor))
    if kind != "rope_freqs":
        raise JaxspecError(
            f"{path} uses {kind!r} rope scaling; jaxspec reads none, linear and rope_freqs"
        )
    from gguf.quants import dequantize

    factors = dequantize(freqs.data, freqs.tensor_type).reshape(-1)
    if factors.size != head_dim // 2:
        raise JaxspecError(f"{path}: {_ROPE_FREQS} has {factors.size} factors, not {head_dim // 2}")
    return RopeScaling("freq_factors", freq_factors=tuple(factors.tolist()))


def _eos_ids(reader) -> tuple[int, ...]:
    """eos, then end-of-turn and end-of-message (Llama 3's <|eot_id|>, <|eom_id|>) if given."""
    ids = [_field(reader, "tokenizer.ggml.eos_token_id", 2)]
    ids += [_field(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom")]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def load_gguf(path: Path, dtype=np.float32) -> tuple[LlamaConfig, dict, object]:
    """(config, params as host arrays in `dtype`, tokenizer | None). Each tensor is cast as
    it is dequantised: the file's weights are never all in float32 at once."""
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise JaxspecError(f"no such GGUF file: {path}")
    reader = _open(path)
    cfg = gguf_config(reader, path)
    # Only the llama architecture interleaves q/k rows; qwen2/3 keep HF's (NEOX) order.
    interleaved = _field(reader, "general.architecture") == "llama"
    tensors, unknown = {}, []
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:  # read into cfg.rope_scaling
            continue
        name = hf_name(t.name)
        if name is None:
            unknown.append(t.name)
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype)  # [out, in] or [out]
        if interleaved and name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, cfg.n_heads)
        elif interleaved and name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, cfg.n_kv_heads)
        tensors[name] = w
    if unknown:
        raise JaxspecError(f"{path} has tensors jaxspec does not know: {', '.join(unknown[:10])}")
    params = params_from_hf(tensors, cfg, str(path))
    return cfg, params, gguf_tokenizer(path)


def gguf_tokenizer(path: Path):
    """transformers builds a fast tokenizer (with the chat template) from GGUF metadata."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # unsupported tokenizer kinds: weights still convert
        print(f"note: no tokenizer converted from {path.name} ({e})", file=sys.stderr)
        return None
