"""Llama GGUF files (llama.cpp) read with the `gguf` package, dequantised to float32."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from jaxspec.config import LlamaConfig
from jaxspec.convert.keys import params_from_hf
from jaxspec.errors import JaxspecError

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
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight"
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
        raise JaxspecError(f"cannot read GGUF file {path}: {e}") from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader, path: Path) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise JaxspecError(f"{path} holds a {arch!r} model; jaxspec supports 'llama' GGUF files")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise JaxspecError(
            f"{path} uses Llama 3.1 rope scaling (rope_freqs); convert from the HF folder instead"
        )

    def need(key):
        value = _field(reader, f"llama.{key}")
        if value is None:
            raise JaxspecError(f"{path} lacks the metadata key llama.{key}")
        return value

    n_heads = need("attention.head_count")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return LlamaConfig(
        vocab_size=int(_field(reader, "llama.vocab_size") or embedding.shape[-1]),
        dim=need("embedding_length"),
        n_layers=need("block_count"),
        n_heads=n_heads,
        n_kv_heads=_field(reader, "llama.attention.head_count_kv") or n_heads,
        ffn_dim=need("feed_forward_length"),
        head_dim=_field(reader, "llama.attention.key_length") or 0,
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base") or 10000.0),
        tie_embeddings="output.weight" not in names,
        max_position=_field(reader, "llama.context_length") or 4096,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(_field(reader, "tokenizer.ggml.eos_token_id", 2),),
        name=str(_field(reader, "general.name") or path.stem),
    )


def load_gguf(path: Path) -> tuple[LlamaConfig, dict, object]:
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise JaxspecError(f"no such GGUF file: {path}")
    reader = _open(path)
    cfg = gguf_config(reader, path)
    tensors, unknown = {}, []
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            unknown.append(t.name)
            continue
        w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)  # [out, in]
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, cfg.n_heads)
        elif name.endswith("k_proj.weight"):
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
        print(f"note: no tokenizer converted from {path.name} ({e})")
        return None
