"""Frozen, hashable model configuration (usable as a static jit argument).

Axis legend used across jaxspec: B batch, T new tokens, S cache length, N query heads,
K kv heads, G = N // K query heads per kv head, H head dim, D model dim, F mlp dim,
V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from jaxspec.errors import JaxspecError
from jaxspec.param_table import param_count

# The architectures jaxspec runs (HF model_type -> class name): the Llama block, with Qwen2's
# q/k/v biases, Qwen3's per-head q/k norms, Mistral's sliding window.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
FAMILIES = tuple(HF_ARCHITECTURES)
# What each family's transformers class assumes for a key its config.json leaves out.
HF_CLASS_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768},
}
SUPPORTED = (
    "Llama 2/3.x (model_type 'llama'), Mistral ('mistral'), Qwen2/2.5 ('qwen2') and dense "
    "Qwen3 ('qwen3')"
)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind: "default" | "linear" | "llama3" | "freq_factors"."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only
    # freq_factors only: the inverse frequencies [H/2] are divided by these (a GGUF's
    # rope_freqs, Llama 3.1's scaling precomputed by llama.cpp).
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self):
        if self.kind not in ("default", "linear", "llama3", "freq_factors"):
            raise JaxspecError(
                f"unsupported rope scaling {self.kind!r}; supported: default, linear, llama3, "
                "freq_factors"
            )
        # A tuple (hashable: configs are static jit arguments) also when read from JSON.
        object.__setattr__(self, "freq_factors", tuple(map(float, self.freq_factors)))
        if (self.kind == "freq_factors") != bool(self.freq_factors):
            raise JaxspecError(
                "rope scaling has freq_factors exactly when its kind is freq_factors"
            )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int = 0  # 0 means dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_embeddings: bool = False
    max_position: int = 4096
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    name: str = "llama"
    family: str = "llama"  # FAMILIES: what HF export and GGUF name the architecture
    qkv_bias: bool = False  # biases on q/k/v (Qwen2)
    qk_norm: bool = False  # RMSNorm per head on q and k before RoPE (Qwen3)
    sliding_window: int = 0  # > 0: a token sees only the last this many positions (Mistral)

    def __post_init__(self):
        self._check_types()
        if self.family not in FAMILIES:
            raise JaxspecError(
                f"config family {self.family!r} is unknown; known: {', '.join(FAMILIES)}"
            )
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise JaxspecError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise JaxspecError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def folder_name(self) -> str:
        """The model's name as one folder name (drafters/<it>/, $JAXSPEC_HOME/train/<it>/):
        a name that is a path ("/ckpt/run-3", "org/model") gives its last part."""
        return plain_name(self.name) or self.family

    def _check_types(self) -> None:
        """Sizes are positive integers and constants positive numbers (a config edited by
        hand fails here, in one line, not deep inside a compiled program)."""
        sizes = (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "max_position",
        )
        for name in (*sizes, "head_dim", "sliding_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise JaxspecError(f"config {name} must be an integer, got {value!r}")
            if value < (name in sizes):
                raise JaxspecError(f"config {name} must be positive, got {value}")
        for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise JaxspecError(f"config {name} must be true or false")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise JaxspecError(f"config {name} must be a positive number, got {value!r}")

    @property
    def n_params(self) -> int:
        """Number of scalars in the model's params (counted from `param_table`)."""
        return param_count(self)

    # ---- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise JaxspecError(f"unknown config keys {sorted(unknown)}; is this a jaxspec config?")
        return cls(**d)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> LlamaConfig:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as e:
            raise JaxspecError(f"cannot read model config {path}: {e}") from None
        except (ValueError, TypeError) as e:
            raise JaxspecError(
                f"cannot read model config {path}: {e}; convert the model again (jaxspec-convert)"
            ) from None

    # ---- Hugging Face -------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: Any) -> LlamaConfig:
        """From a transformers config or its dict (transformers 4.x and 5.x) of a family in
        FAMILIES; anything else is one error naming the supported list."""
        d = hf if isinstance(hf, dict) else hf.to_dict()
        family = _family_of(d)
        d = {**HF_CLASS_DEFAULTS[family], **d}  # a key set to null stays null, as in HF
        if d.get("hidden_act", "silu") != "silu":
            raise JaxspecError(f"unsupported activation {d['hidden_act']!r}; expected 'silu'")
        # transformers 5 moved rope_theta and rope_scaling into rope_parameters.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.get("rope_theta", d.get("rope_theta")) or 10000.0
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            vocab_size=d["vocab_size"],
            dim=d["hidden_size"],
            n_layers=d["num_hidden_layers"],
            n_heads=d["num_attention_heads"],
            n_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            ffn_dim=d["intermediate_size"],
            head_dim=d.get("head_dim") or 0,
            norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_rope_scaling_from_hf(rope),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position=d["max_position_embeddings"],
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            name=d.get("_name_or_path") or family,
            family=family,
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            sliding_window=_sliding_window(d, family),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json for the family's transformers class (HF_ARCHITECTURES)."""
        rs = self.rope_scaling
        owners = {"qkv_bias": "qwen2", "qk_norm": "qwen3", "sliding_window": "mistral"}
        stray = [f for f, family in owners.items() if getattr(self, f) and self.family != family]
        if stray:
            raise JaxspecError(
                f"{self.family} HF configs cannot hold {', '.join(stray)}: set the config's "
                "family to the one that has it (qkv_bias: qwen2, qk_norm: qwen3, "
                "sliding_window: mistral)"
            )
        if rs.kind == "freq_factors":
            raise JaxspecError(
                "HF configs cannot hold per-frequency RoPE factors (a GGUF's rope_freqs): "
                "export from the original HF folder instead"
            )
        scaling = None
        if rs.kind == "linear":
            scaling = {"rope_type": "linear", "factor": rs.factor}
        elif rs.kind == "llama3":
            scaling = {
                "rope_type": "llama3",
                "factor": rs.factor,
                "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position,
            }
        eos = list(self.eos_token_ids)
        out = {
            "architectures": [HF_ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_position,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "hidden_act": "silu",
        }
        if self.family in ("llama", "qwen3"):
            out["attention_bias"] = False
        if self.family == "llama":
            out["mlp_bias"] = False
        if self.family == "mistral":
            out["sliding_window"] = self.sliding_window or None
        if self.family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
        return out


def _family_of(d: dict[str, Any]) -> str:
    """The family of an HF config dict, or one error naming the supported ones."""
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    if model_type is None:  # an old config without model_type: its class name says
        model_type = next((f for f, a in HF_ARCHITECTURES.items() if a in archs), "llama")
    if model_type not in FAMILIES:
        raise JaxspecError(
            f"unsupported architecture {model_type!r} ({', '.join(archs) or 'no name'}); "
            f"jaxspec supports {SUPPORTED}"
        )
    if model_type == "llama" and (d.get("attention_bias") or d.get("mlp_bias")):
        raise JaxspecError(
            "Llama with attention/mlp biases is not supported; jaxspec supports " + SUPPORTED
        )
    if model_type == "qwen3" and d.get("attention_bias"):
        raise JaxspecError(
            "Qwen3 with attention biases is not supported; jaxspec supports " + SUPPORTED
        )
    return model_type


def _sliding_window(d: dict[str, Any], family: str) -> int:
    """The window every layer attends within (Mistral), 0 for full attention; a window on
    some layers only (Qwen2/3's use_sliding_window, per-layer layer_types) is refused."""
    layer_types = set(d.get("layer_types") or [])
    if family in ("qwen2", "qwen3"):
        if d.get("use_sliding_window") and d.get("sliding_window"):
            layer_types.add("sliding_attention")
    elif family == "mistral" and d.get("sliding_window"):
        window = int(d["sliding_window"])
        return window if window < d["max_position_embeddings"] else 0
    if "sliding_attention" in layer_types:
        raise JaxspecError(
            f"this {family} model attends within a sliding window on some layers only; "
            "jaxspec implements a window on every layer (Mistral) or none: use a model "
            "with use_sliding_window false"
        )
    return 0


def plain_name(name: str) -> str:
    """A model name or path -> its last part, characters outside [A-Za-z0-9._-] as '-'
    ("" when nothing is left, or only dots)."""
    last = str(name).replace("\\", "/").rstrip("/").split("/")[-1]
    last = re.sub(r"[^A-Za-z0-9._-]", "-", last)
    return "" if last.strip(".") == "" else last


def _rope_scaling_from_hf(rope: dict[str, Any]) -> RopeScaling:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope["original_max_position_embeddings"]),
        )
    return RopeScaling(kind)  # raises the unsupported-scaling error


# ---- presets ------------------------------------------------------------------------
def _llama2(name: str, dim: int, layers: int, heads: int, ffn: int, vocab: int = 32000, **kw):
    return LlamaConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads,
        ffn_dim=ffn,
        max_position=4096,
        name=name,
        **kw,
    )


PRESETS: dict[str, LlamaConfig] = {
    "smollm2-135m": LlamaConfig(
        vocab_size=49152,
        dim=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        ffn_dim=1536,
        norm_eps=1e-5,
        rope_theta=100000.0,
        tie_embeddings=True,
        max_position=8192,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="SmolLM2-135M-Instruct",
    ),
    "llama-2-7b": _llama2("Llama-2-7B", 4096, 32, 32, 11008),
    "llama-2-13b": _llama2("Llama-2-13B", 5120, 40, 40, 13824),
    "vicuna-7b": _llama2("Vicuna-7B", 4096, 32, 32, 11008),
    "vicuna-13b": _llama2("Vicuna-13B", 5120, 40, 40, 13824),
    "codellama-7b": _llama2(
        "CodeLlama-7B", 4096, 32, 32, 11008, vocab=32016, rope_theta=1e6, norm_eps=1e-5
    ),
    "codellama-13b": _llama2(
        "CodeLlama-13B", 5120, 40, 40, 13824, vocab=32016, rope_theta=1e6, norm_eps=1e-5
    ),
    "llama-3-8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        rope_theta=500000.0,
        max_position=8192,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
        name="Llama-3-8B",
    ),
    # Tiny configs for tests: prime-ish sizes so transposes cannot hide.
    "tiny-mha": LlamaConfig(
        vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=88, name="tiny-mha"
    ),
    "tiny-gqa": LlamaConfig(
        vocab_size=97, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=88, name="tiny-gqa"
    ),
    "tiny-mqa": LlamaConfig(
        vocab_size=97,
        dim=48,
        n_layers=2,
        n_heads=3,
        n_kv_heads=1,
        ffn_dim=72,
        tie_embeddings=True,
        name="tiny-mqa",
    ),
}


def preset(name: str) -> LlamaConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise JaxspecError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
