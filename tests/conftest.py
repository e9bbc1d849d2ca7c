"""Fixtures: tiny random HF Llama models (prime-sized dims) saved with save_pretrained."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

# Four virtual CPU devices (PPD's pipelined decoding needs k + 1 devices); set before
# jax initialises its backends. Everything else runs on device 0 as before.
if "device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    os.environ["XLA_FLAGS"] = flags.strip()
# The tests' tiny programs spend their time compiling, not running: LLVM's optimisations
# cost a quarter to a third of it and change no result (XLA:CPU keeps IEEE float semantics
# at every level). Commands the tests start inherit the flag.
NO_LLVM_OPTIMISATION = "--xla_backend_optimization_level=0"
if "optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + NO_LLVM_OPTIMISATION

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxspec.compile_cache import SETTINGS  # noqa: E402  (every program kept)

jax.config.update("jax_default_matmul_precision", "highest")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One folder of compiled programs for the whole run, shared by the pytest-xdist workers
# (they inherit the variable from the process that made the folder, which removes it at the
# end): modules free their programs when they end (below), and many compile the same ones.
_PROGRAMS = "JAXSPEC_TEST_PROGRAMS"
_made_programs_folder = _PROGRAMS not in os.environ
if _made_programs_folder:
    os.environ[_PROGRAMS] = tempfile.mkdtemp(prefix="jaxspec-test-programs-")
for _name, _value in {"jax_compilation_cache_dir": os.environ[_PROGRAMS], **SETTINGS}.items():
    jax.config.update(_name, _value)


def pytest_unconfigure(config):
    if _made_programs_folder:
        shutil.rmtree(os.environ.pop(_PROGRAMS), ignore_errors=True)


VOCAB = 101


def tiny_hf_config(n_kv_heads=2, tie=False, rope=None, n_layers=2):
    from transformers import LlamaConfig

    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, **(rope or {})}
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=83,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters=rope_parameters,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_hf_model(seed=0, **kw):
    """A random float32 LlamaForCausalLM whose weights (norms too) are far from init."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_hf_config(**kw)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.15 * torch.randn_like(p))
    return model


# One tiny random model per supported family, built with transformers' own config class:
# dims that exercise each difference from the Llama block (GQA throughout).
FAMILY_WINDOW = 16  # Mistral's sliding window: shorter than the tests' prompt + new tokens
FAMILIES = ("llama3.2", "mistral", "qwen2", "qwen3")


def tiny_family_config(family: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=83, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)  # fmt: skip
    if family == "llama3.2":  # tied embeddings, llama3 RoPE scaling, two eos ids
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                "rope_theta": 500000.0}  # fmt: skip
        return transformers.LlamaConfig(
            **{**common, "eos_token_id": [2, 3]}, tie_word_embeddings=True, rope_parameters=rope
        )
    if family == "mistral":  # a sliding window
        return transformers.MistralConfig(**common, sliding_window=FAMILY_WINDOW)
    if family == "qwen2":  # q/k/v biases, tied embeddings, rope theta 1e6
        return transformers.Qwen2Config(
            **common, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )  # fmt: skip
    if family == "qwen3":  # per-head q/k norms, head_dim 16 != hidden / heads (12)
        return transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    raise ValueError(family)


def tiny_family_model(family: str, seed=1):
    """A random float32 model of `family` whose weights (norms and biases too) are far from
    their initial values."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_family_config(family)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.15 * torch.randn_like(p))
    return model


def save_tiny_family(tmp: Path, family: str) -> tuple[Path, object]:
    model = tiny_family_model(family)
    folder = tmp / family
    model.save_pretrained(folder, safe_serialization=True)
    tiny_tokenizer().save_pretrained(folder)
    return folder, model


def tiny_tokenizer():
    """A word-level tokenizer over VOCAB tokens: <unk> <s> </s> user assistant w5 ... w100
    (the device campaign's dry-run tokenizer)."""
    from jaxspec.device_bench.end_to_end import tiny_tokenizer as word_level

    return word_level(VOCAB)


def save_tiny(tmp: Path, name="hf", tokenizer=True, **kw) -> tuple[Path, object]:
    model = tiny_hf_model(**kw)
    folder = tmp / name
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer:
        tiny_tokenizer().save_pretrained(folder)
    return folder, model


def one_line_error(main, argv, capsys) -> str:
    """Run a command-line main expecting a user error: exit 2 and one `error: ...` line."""
    capsys.readouterr()  # drop what building fixtures printed
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def tiny_training_args(ckpt: Path, tmp: Path, **overrides) -> list[str]:
    """The trainers' shared options (train/args.py) for a seconds-long run on a tiny
    checkpoint; overrides: option name with underscores -> value."""
    options = {"model": ckpt, "work_dir": tmp / "work", "out": tmp / "out", "train_seqs": 8,
               "test_seqs": 4, "prompt_len": 40, "new_tokens": 24, "batch": 2, "save_every": 2,
               "lr": 0.01, **overrides}  # fmt: skip
    return [arg for k, v in options.items() for arg in (f"--{k.replace('_', '-')}", str(v))]


def train_on_made_up_conversations(trainer, *runs: list[str]) -> list[dict]:
    """trainer.train(args) for each args in turn, ShareGPT replaced by the tests' made-up
    conversations -> their reports."""
    import train.features as features
    from tests.test_medusa import conversations

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(features, "sharegpt_split", lambda split: conversations(seed=len(split)))
        return [trainer.train(args) for args in runs]


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop every module's compiled programs when it ends: XLA:CPU maps memory for each
    executable, and the whole suite's would pass the kernel's per-process map limit
    (vm.max_map_count, 65530), after which compilation aborts."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt):
    """tiny_ckpt's model, loaded in float32 by the public API."""
    import jaxspec

    return jaxspec.load_model(tiny_ckpt[0], dtype="float32")


@pytest.fixture(scope="module")
def tiny_drafters(tiny_ckpt, tmp_path_factory):
    """A folder of untrained drafters for tiny_ckpt, one a method (tests.test_api)."""
    from tests.test_api import write_drafters

    return write_drafters(tiny_ckpt[0], tmp_path_factory.mktemp("drafters"))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """(jaxspec checkpoint folder, HF model) for a GQA model with a tokenizer."""
    from jaxspec.convert import convert

    tmp = tmp_path_factory.mktemp("tiny")
    hf_dir, model = save_tiny(tmp, n_kv_heads=2)
    convert(hf_dir, tmp / "jaxspec")
    return tmp / "jaxspec", model
