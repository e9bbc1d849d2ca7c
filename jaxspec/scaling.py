"""Scaling on paper: what one decode step of a model split tensor-parallel over `model=TP`
devices (data=1) should cost per device, from the config and an accelerator's spec sheet.

A PREDICTION, not a measurement: no array is made and nothing is compiled. The layout is
jaxspec's (`jaxspec.mesh.RULES` applied to `jaxspec.param_table`): linear weights, the
embedding and lm_head split TP ways, norms replicated; the KV cache [B,K,S,H] split by kv
heads. A step's time is

    max(memory time, compute time) + communication time

memory: the weights and the cache buffer read once per step at HBM bandwidth; compute:
2 FLOPs per matmul weight per row times the bfloat16 passes a product takes (3 for
jaxspec's default "exact" products, 1 for "plain"; attention's float32 products over the
cache are not counted, docs/scaling.md estimates their share); communication: Megatron's
all-reduces of the [rows, D] activations (after o_proj and down_proj in every layer, and
one after the vocabulary-split embedding lookup) as ring all-reduces, an all-gather of the
[rows, V] logits (an upper bound: jaxspec gathers less), and a fixed latency per
collective. Units: bytes, FLOP, seconds.
"""

from __future__ import annotations

import dataclasses
import math

from jaxspec.config import PRESETS, LlamaConfig
from jaxspec.errors import JaxspecError
from jaxspec.mesh import RULES, SPLIT_SIZES
from jaxspec.param_table import entries

# Llama-3-70B (HF meta-llama/Meta-Llama-3-70B config.json); jaxspec.config has no preset.
LLAMA_3_70B = LlamaConfig(
    vocab_size=128256,
    dim=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    ffn_dim=28672,
    head_dim=128,
    rope_theta=500000.0,
    max_position=8192,
    bos_token_id=128000,
    eos_token_ids=(128001, 128009),
    name="Llama-3-70B",
)
MODELS = {"llama-3-70b": LLAMA_3_70B}


def model_config(name: str) -> LlamaConfig:
    """A jaxspec preset, or one of MODELS (configs this module adds)."""
    known = {**PRESETS, **MODELS}
    if name not in known:
        raise JaxspecError(f"unknown model {name!r}; known: {', '.join(known)}")
    return known[name]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device's spec-sheet numbers. link_bandwidth: bytes/s one device sends to its
    peers in one direction; collective_latency: seconds a collective costs besides its
    bytes (an ASSUMPTION, not a spec-sheet number)."""

    name: str
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    link_bandwidth: float  # bytes/s per direction
    collective_latency: float  # s


GB, TB, TFLOP = 1e9, 1e12, 1e12
ACCELERATORS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, 989 TFLOPs dense
    # bf16, NVLink 900 GB/s both directions together.
    "h100": Accelerator("H100 SXM", 80 * GB, 3.35 * TB, 989 * TFLOP, 450 * GB, 5e-6),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, same compute and
    # NVLink as H100.
    "h200": Accelerator("H200 SXM", 141 * GB, 4.8 * TB, 989 * TFLOP, 450 * GB, 5e-6),
    # Google Cloud TPU v5e docs: 16 GB HBM2, 819 GB/s, 197 TFLOPs bf16; ICI 400 GB/s a chip
    # both directions together, taken as 200 GB/s per direction (approximate).
    "tpu-v5e": Accelerator("TPU v5e", 16 * GB, 819 * GB, 197 * TFLOP, 200 * GB, 10e-6),
    # Google Cloud TPU v5p docs: 95 GB HBM2e, 2765 GB/s, 459 TFLOPs bf16; ICI 1200 GB/s a
    # chip both directions together, taken as 600 GB/s per direction (approximate).
    "tpu-v5p": Accelerator("TPU v5p", 95 * GB, 2.765 * TB, 459 * TFLOP, 600 * GB, 10e-6),
}


@dataclasses.dataclass(frozen=True)
class Dtypes:
    """Bytes per element and bfloat16 passes per product (defaults: jaxspec's decoding)."""

    weight: int = 2  # bfloat16 weights
    cache: int = 4  # float32 keys/values
    activation: int = 4  # float32 activations and logits
    passes: int = 3  # "exact" products (layers.split_bfloat16); "plain": 1


DTYPES = Dtypes()


def check_tp(cfg: LlamaConfig, tp: int) -> None:
    """TP must divide every size `model` splits (heads, kv heads, MLP, vocabulary)."""
    if tp < 1:
        raise JaxspecError(f"TP={tp}: the model axis needs at least 1 device")
    bad = [f"{field} {getattr(cfg, field)}" for field in SPLIT_SIZES if getattr(cfg, field) % tp]
    if bad:
        raise JaxspecError(f"TP={tp} does not divide {', '.join(bad)} of {cfg.name}")


def _per_device(cfg: LlamaConfig, tp: int, keep) -> int:
    """Scalars per device of the parameters `keep(entry)` selects: an entry with an axis
    RULES maps to `model` holds 1/TP of its scalars, a replicated one all of them."""
    check_tp(cfg, tp)
    total = 0
    for p, shape in entries(cfg):
        if keep(p):
            split = any(RULES[a] == "model" for a in p.axes)
            total += math.prod(shape) // (tp if split else 1) * (cfg.n_layers if p.per_layer else 1)
    return total


def params_per_device(cfg: LlamaConfig, tp: int) -> int:
    """Parameter scalars one device holds: (n_params - norms) / TP + norms, where the
    replicated norms are (2 L + 1) D scalars."""
    return _per_device(cfg, tp, lambda p: True)


def matmul_params_per_device(cfg: LlamaConfig, tp: int) -> int:
    """Weight scalars one device multiplies per row: every linear weight and the output
    projection (lm_head, or the tied embedding); not the norms, not an untied embedding
    (a lookup)."""
    return _per_device(
        cfg,
        tp,
        lambda p: len(p.dims) == 2 and (p.name != "embed_tokens" or cfg.tie_embeddings),
    )


def weight_bytes(cfg: LlamaConfig, tp: int, dt: Dtypes = DTYPES) -> int:
    """Bytes of weights per device."""
    return params_per_device(cfg, tp) * dt.weight


def cache_bytes(cfg: LlamaConfig, tp: int, batch: int, context: int, dt: Dtypes = DTYPES) -> int:
    """Bytes of KV cache per device: keys and values, L x [B, K/TP, S, H] each, S = context
    (the buffer a step reads whole)."""
    check_tp(cfg, tp)
    return 2 * cfg.n_layers * batch * (cfg.n_kv_heads // tp) * context * cfg.head_dim * dt.cache


def ring_allreduce_bytes(size: float, tp: int) -> float:
    """Bytes one device sends in a ring all-reduce of `size` bytes over TP devices."""
    return 2 * (tp - 1) / tp * size


def allreduce_bytes(cfg: LlamaConfig, tp: int, rows: int, dt: Dtypes = DTYPES) -> float:
    """Bytes one device sends in a step's all-reduces: 2 per layer (after o_proj and
    down_proj) and 1 after the embedding lookup, each of the [rows, D] activations."""
    return (2 * cfg.n_layers + 1) * ring_allreduce_bytes(rows * cfg.dim * dt.activation, tp)


def logits_gather_bytes(cfg: LlamaConfig, tp: int, rows: int, dt: Dtypes = DTYPES) -> float:
    """Bytes one device receives gathering [rows, V/TP] logits into [rows, V] (an upper
    bound on what jaxspec's sampling gathers)."""
    return (tp - 1) / tp * rows * cfg.vocab_size * dt.activation


def collectives(cfg: LlamaConfig, tp: int) -> int:
    """Collectives per step: 2 L + 1 all-reduces and the logits' all-gather (none at TP 1)."""
    return 0 if tp == 1 else 2 * cfg.n_layers + 2


@dataclasses.dataclass(frozen=True)
class Step:
    """One predicted decode step on one device of the mesh (bytes, FLOP, seconds)."""

    rows: int  # batch x tokens in the step
    weight_bytes: int
    cache_bytes: int
    flops: float
    comm_bytes: float  # all-reduces sent + logits gathered
    allreduce_bytes: float
    collectives: int
    memory_s: float
    compute_s: float
    comm_s: float

    @property
    def seconds(self) -> float:
        """max(memory, compute) + communication."""
        return max(self.memory_s, self.compute_s) + self.comm_s


def predict_step(
    cfg: LlamaConfig,
    acc: Accelerator,
    tp: int,
    batch: int,
    tokens: int,
    context: int,
    dt: Dtypes = DTYPES,
) -> Step:
    """A step forwarding `tokens` new tokens per row (1: AR, T: a T-node verify) for
    `batch` rows against a cache buffer of `context` slots, on a mesh of model=TP."""
    rows = batch * tokens
    weights = weight_bytes(cfg, tp, dt)
    cache = cache_bytes(cfg, tp, batch, context, dt)
    flops = 2.0 * matmul_params_per_device(cfg, tp) * rows * dt.passes
    reduce = allreduce_bytes(cfg, tp, rows, dt)
    comm = reduce + logits_gather_bytes(cfg, tp, rows, dt)
    n = collectives(cfg, tp)
    return Step(
        rows=rows,
        weight_bytes=weights,
        cache_bytes=cache,
        flops=flops,
        comm_bytes=comm,
        allreduce_bytes=reduce,
        collectives=n,
        memory_s=(weights + cache) / acc.hbm_bandwidth,
        compute_s=flops / acc.bf16_flops,
        comm_s=comm / acc.link_bandwidth + n * acc.collective_latency,
    )


def fits(step: Step, acc: Accelerator) -> bool:
    """Weights and cache within the device's memory (no room counted for activations,
    XLA's workspace or a drafter)."""
    return step.weight_bytes + step.cache_bytes <= acc.hbm_bytes


def speedup(tau: float, ar: Step, verify: Step) -> float:
    """Tokens per second over AR's for a method accepting `tau` tokens per verify step
    (bonus token included): tau * t_AR / t_verify. Drafting time is not counted."""
    return tau * ar.seconds / verify.seconds
