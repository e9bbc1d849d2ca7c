"""The public API (issue 28) on the tiny checkpoint: `import jaxspec` stays light and exports
what it names; every method's `Generator`, with an untrained drafter, decodes exactly AR's
tokens and the tokenizer's text; batches, token-id prompts, streaming, per-call sampling,
`load_drafter` and `load_model` (checkpoint, HF folder, missing path) behave as documented,
and careless inputs end in a JaxspecError."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.checkpoint import load_checkpoint
from jaxspec.drafters.chimera import ChimeraSettings
from jaxspec.drafters.eagle import EagleSettings
from jaxspec.drafters.firp import FirpSettings
from jaxspec.drafters.medusa import MedusaSettings
from jaxspec.drafters.sdsat import SdsatSettings
from jaxspec.drafters.store import save_drafter
from jaxspec.ppd import PpdSettings
from jaxspec.text import TextStream
from tests.conftest import save_tiny

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "w5 w9 w7 w11"
CHAT_IDS = [3, 5, 9, 7, 11, 2, 4]  # "user w5 w9 w7 w11 </s> assistant", by the chat template
N = 12  # new tokens per call
# A tree of the top 10 guesses at two depths: untrained drafters then get some guesses
# right, so that accepting drafted tokens (not only rejecting them) is checked to be lossless.
TREE = "comb-2-10"

# Each method's settings for an untrained drafter on the tiny model (as tests/test_bad_inputs).
SETTINGS = {
    "medusa": MedusaSettings(n_heads=2),
    "firp": FirpSettings(layers=(1, 2)),
    "chimera": ChimeraSettings(n_heads=2),
    "sdsat": SdsatSettings(rank=2),
    "eagle": EagleSettings(layers=(1, 1, 2), depth=3),
}
PUBLIC = ["load_model", "load_drafter", "Generator", "GenerationResult", "TreeSpec",
          "DynamicTree", "Sampling", "JaxspecError", "METHODS"]  # fmt: skip


def write_drafters(ckpt: Path, folder: Path) -> Path:
    """folder/<method>: an untrained drafter for each drafted method (each method's `init`;
    PPD: a random early-prediction head for layer 1) -> folder."""
    from jaxspec.methods import make_drafter

    cfg, params = load_checkpoint(ckpt)
    for method, settings in SETTINGS.items():
        weights = make_drafter(method, cfg, settings).init(params, jax.random.key(0))
        save_drafter(folder / method, method, settings, weights, cfg, "untrained")
    rng = np.random.default_rng(0)
    head = {"w": 0.05 * rng.standard_normal((cfg.dim, cfg.dim)).astype(np.float32),
            "b": np.zeros(cfg.dim, np.float32)}  # fmt: skip
    save_drafter(folder / "ppd", "ppd", PpdSettings(default_layer=1), {"heads": {"layer1": head}},
                 cfg, "untrained")  # fmt: skip
    return folder


def options(method: str, drafters: Path) -> dict:
    """Generator keywords for `method` with its drafter from `drafters`."""
    if method == "ar":
        return {}
    if method == "lookup":  # drafts from the text: no drafter folder
        return {"tree": TREE}
    if method == "ppd":
        return {"drafter": drafters / method, "ppd_layer": 1}
    return {"drafter": drafters / method, "tree": TREE}


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return jaxspec.load_model(tiny_ckpt[0], dtype="float32")


@pytest.fixture(scope="module")
def drafters(tiny_ckpt, tmp_path_factory) -> Path:
    return write_drafters(tiny_ckpt[0], tmp_path_factory.mktemp("drafters"))


@pytest.fixture(scope="module")
def generators(model, drafters) -> dict:
    return {m: jaxspec.Generator(model, m, **options(m, drafters)) for m in jaxspec.METHODS}


@pytest.fixture(scope="module")
def reference(generators, tiny_ckpt):
    """AR's greedy result for PROMPT, the tokens every method must reproduce: those of the
    HF model the checkpoint was converted from (so not merely self-consistent)."""
    import torch

    out = generators["ar"].generate(PROMPT, max_new_tokens=N)
    assert out.prompt_ids == CHAT_IDS  # the chat template applied, as the CLI does
    assert out.new_tokens == N and out.steps == N  # no early EOS: a full-length comparison
    with torch.no_grad():
        hf = tiny_ckpt[1].generate(torch.tensor([CHAT_IDS]), max_new_tokens=N, do_sample=False,
                                   pad_token_id=0)  # fmt: skip
    assert out.token_ids == hf[0, len(CHAT_IDS) :].tolist()
    return out


def test_import_is_light_and_exports_the_api():
    code = (
        "import sys, jaxspec\n"
        "assert 'jax' not in sys.modules, 'import jaxspec imported jax'\n"
        "print(' '.join(jaxspec.__all__))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert set(PUBLIC) <= set(done.stdout.split())
    for name in PUBLIC:
        assert getattr(jaxspec, name) is not None
    assert jaxspec.METHODS[0] == "ar" and {"medusa", "firp", "ppd"} <= set(jaxspec.METHODS)
    assert issubclass(jaxspec.JaxspecError, Exception)
    assert isinstance(jaxspec.Sampling(), jaxspec.Sampling)
    with pytest.raises(AttributeError):
        jaxspec.no_such_name  # noqa: B018


@pytest.mark.parametrize("method", jaxspec.METHODS)
def test_every_method_decodes_ar_tokens_and_their_text(method, generators, reference, model):
    out = generators[method].generate(PROMPT, max_new_tokens=N)
    assert isinstance(out, jaxspec.GenerationResult)
    assert out.prompt_ids == CHAT_IDS
    assert out.token_ids == reference.token_ids
    assert out.text == model.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.text.split()[0].startswith("w")  # words of the tiny vocabulary
    assert out.mean_accepted == N / out.steps and out.tokens_per_s > 0
    if method not in ("ar", "ppd"):  # (PPD's steps are single tokens, pipelined)
        assert out.steps < N  # some drafted tokens were accepted


def test_a_batch_gives_each_prompt_its_own_result(generators, model):
    gen = generators["medusa"]
    ids = model.tokenizer.encode("user w17 </s> assistant")  # a token-id prompt in the batch
    prompts = [PROMPT, "w40 w41 w42 w43 w44 w45 w46 w47 w48 w49", ids]
    outs = gen.generate(prompts, max_new_tokens=N)
    assert isinstance(outs, list) and len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        alone = gen.generate(prompt, max_new_tokens=N)
        assert (out.prompt_ids, out.token_ids, out.text) == (
            alone.prompt_ids, alone.token_ids, alone.text)  # fmt: skip
    assert outs[2].prompt_ids == ids
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the rows are not one row repeated


def test_token_ids_prompt_equals_its_text(model, reference, generators):
    chat = generators["ar"]
    assert chat.encode(PROMPT) == CHAT_IDS
    assert chat.generate(CHAT_IDS, max_new_tokens=N).token_ids == reference.token_ids
    assert chat.generate(tuple(CHAT_IDS), max_new_tokens=N).token_ids == reference.token_ids
    numpy_ids = list(np.asarray(CHAT_IDS, np.int64))  # numpy integers, as arrays hand out
    assert chat.generate(numpy_ids, np.int32(N)).token_ids == reference.token_ids

    plain = jaxspec.Generator(model, "ar", chat=False)  # the text encoded as is
    ids = [5, 9, 7, 11]
    assert plain.encode(PROMPT) == ids
    by_text, by_ids = plain.generate(PROMPT, N), plain.generate(ids, N)
    assert by_text.prompt_ids == by_ids.prompt_ids == ids
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.token_ids != reference.token_ids  # no chat template: another prompt


@pytest.mark.parametrize("method", ["ar", "medusa"])
def test_stream_pieces_join_to_the_generated_text(method, generators, reference):
    gen = generators[method]
    stream = gen.stream(PROMPT, max_new_tokens=N)
    assert stream.result is None  # until it is read
    pieces = list(stream)
    assert len(pieces) > 1 and all(pieces)
    assert "".join(pieces) == gen.generate(PROMPT, max_new_tokens=N).text == reference.text
    assert stream.result.token_ids == reference.token_ids
    assert stream.result.text == reference.text
    for bad, message in [([PROMPT, PROMPT], "one prompt"), ([5, 101], "token id 101")]:
        with pytest.raises(jaxspec.JaxspecError, match=message):
            list(gen.stream(bad))
    with pytest.raises(jaxspec.JaxspecError, match="seed"):
        list(gen.stream(PROMPT, seed=-1))


def test_text_leaves_special_tokens_out(generators):
    """The prompt "w47" leads the tiny model to <unk> and then to EOS (which ends the
    answer): the text, whole or streamed, is the words around them."""
    out = generators["ar"].generate("w47", max_new_tokens=40)
    assert out.token_ids[-1] == 2 and 0 in out.token_ids  # </s> and <unk>
    assert all(t in (0, 2) or t >= 5 for t in out.token_ids)
    words = " ".join(f"w{t}" for t in out.token_ids if t >= 5)
    stream = generators["ar"].stream("w47", max_new_tokens=40)
    pieces = list(stream)
    assert all(pieces)  # <unk> and </s> add no text, and no empty piece
    assert out.text == "".join(pieces) == stream.result.text == words


def test_a_character_split_over_tokens_streams_whole():
    class Bytes:  # one token per UTF-8 byte
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    text = TextStream(Bytes())
    assert [text.push(list(b)) for b in (b"a\xe2", b"\x82", b"\xac b")] == ["", "", "a\u20ac b"]


def test_a_stream_left_early_stops_its_decoding(generators, monkeypatch):
    """close() (from this thread or another), a `with` block's end and a `break` that drops
    the stream each stop the decoding thread within a few steps, not after max_new_tokens."""
    import threading

    gen, long = generators["ar"], 200
    assert gen.generate(PROMPT, max_new_tokens=long).new_tokens == long  # no early EOS
    decoder, made = gen._decoder(jaxspec.Sampling()), []
    original = decoder.generate

    def counting(ids, max_new_tokens, seed, on_tokens):
        return original(ids, max_new_tokens, seed, lambda new: (made.append(new), on_tokens(new)))

    monkeypatch.setattr(decoder, "generate", counting)

    def leave(how):
        made.clear()
        before = set(threading.enumerate())
        if how == "close":
            stream = gen.stream(PROMPT, max_new_tokens=long)
            next(stream)
            stream.close()
            assert stream.result is None
        elif how == "with":
            with gen.stream(PROMPT, max_new_tokens=long) as stream:
                next(stream)
        elif how == "break":
            for _ in gen.stream(PROMPT, max_new_tokens=long):
                break
        else:  # closed by another thread while this one waits in next()
            stream, read = gen.stream(PROMPT, max_new_tokens=long), []
            reader = threading.Thread(target=lambda: read.extend(stream))
            reader.start()
            while not made:
                reader.join(timeout=0.01)
            stream.close()
            reader.join(timeout=60)
            assert not reader.is_alive() and stream.result is None
        for thread in set(threading.enumerate()) - before:
            thread.join(timeout=60)  # a decoding left running would end after all tokens
        return sum(map(len, made))

    for how in ("close", "with", "break", "another thread"):
        assert leave(how) < long // 4, how
    whole = gen.stream(PROMPT, max_new_tokens=long)
    assert "".join(whole) == gen.generate(PROMPT, max_new_tokens=long).text  # read to the end
    assert whole.result.new_tokens == long
    whole.close()  # after the end: nothing left to stop


def test_sampling_is_per_call_and_seeded(generators, reference):
    gen = generators["medusa"]
    sample = dict(max_new_tokens=N, temperature=1.0, top_p=0.9)
    first = gen.generate(PROMPT, **sample, seed=0).token_ids
    again = gen.generate(PROMPT, **sample, seed=0)
    assert again.token_ids == first and again.compile_s == 0  # its programs kept
    other = next(s for s in (1, 2) if gen.generate(PROMPT, **sample, seed=s).token_ids != first)
    # a stream samples as generate does, seed and all
    stream = gen.stream(PROMPT, **sample, seed=other)
    assert "".join(stream) == gen.generate(PROMPT, **sample, seed=other).text
    # top_k=1 keeps only the likeliest token: sampling it is greedy decoding
    assert gen.generate(PROMPT, N, temperature=1.0, top_k=1, seed=3).token_ids == (
        reference.token_ids
    )
    stream = gen.stream(PROMPT, N, temperature=1.0, top_k=1, seed=3)
    assert "".join(stream) == reference.text
    assert gen.generate(PROMPT, N).token_ids == reference.token_ids  # greedy again after


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_k": -1}, "top-k"),
        ({"temperature": 0.7, "top_k": 102}, "vocabulary"),
        ({"top_k": 5}, r"top_k \(--top-k\) 5 applies only when sampling: set temperature"),
        ({"top_p": 0.9}, r"top_p \(--top-p\) 0.9 applies only when sampling"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**32}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"typical": True}, r"typical \(--typical\) needs sampling"),
        ({"top_k": 2.5}, r"top_k \(--top-k\) must be an integer, got 2.5"),
        ({"top_k": "2"}, r"top_k \(--top-k\) must be an integer, got '2'"),
        ({"temperature": "0.7"}, r"temperature \(--temperature\) must be a number, got '0.7'"),
        ({"top_p": None}, r"top_p \(--top-p\) must be a number, got None"),
        ({"temperature": 0.7, "typical": 1}, r"typical \(--typical\) must be True or False, got 1"),
    ],
)
def test_bad_sampling_settings_are_refused(settings, message, generators):
    with pytest.raises(jaxspec.JaxspecError, match=message):
        generators["ar"].generate(PROMPT, N, **settings)
    with pytest.raises(jaxspec.JaxspecError, match=message):
        generators["ar"].stream(PROMPT, N, **settings)


def test_ppd_refuses_sampling(generators):
    with pytest.raises(jaxspec.JaxspecError, match="greedily"):
        generators["ppd"].generate(PROMPT, N, temperature=0.7)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ({"role": "user", "content": "w5"}, "a prompt is a str or a list of token ids"),
        ([5.0, 9.0], r"token ids are integers, got 5.0 \(float\); pass ints"),
        ([5, 101], "token id 101 is outside the vocabulary"),
        ([5, -1], "token id -1 is outside the vocabulary"),
        ([True, 5], r"token ids are integers, got True \(bool\)"),
        (np.arange(3), "a prompt is a str or a list of token ids, got ndarray"),
        ("", "empty prompt"),
        ([], "empty prompt"),
        ([PROMPT, [5, 101]], "token id 101"),
    ],
)
def test_bad_prompts_are_refused(prompt, message, generators):
    with pytest.raises(jaxspec.JaxspecError, match=message):
        generators["ar"].generate(prompt, N)


def test_a_model_without_a_tokenizer_takes_ids_and_refuses_text(model, reference):
    bare = jaxspec.Generator(dataclasses.replace(model, tokenizer=None), "ar")
    assert bare.generate(CHAT_IDS, N).token_ids == reference.token_ids
    with pytest.raises(jaxspec.JaxspecError, match="has no tokenizer: pass token ids"):
        bare.generate(PROMPT, N)
    with pytest.raises(jaxspec.JaxspecError, match="stream yields text and the model"):
        bare.stream(CHAT_IDS, N)


@pytest.mark.parametrize("max_new_tokens", [2.5, "5", None, True, 0])
def test_a_bad_max_new_tokens_is_refused_before_any_work(max_new_tokens, generators):
    with pytest.raises(
        jaxspec.JaxspecError, match=r"max_new_tokens \(--max-new-tokens\) must be an integer >= 1"
    ):
        generators["medusa"].generate(PROMPT, max_new_tokens)


def test_load_drafter(model, drafters):
    settings, params, data = jaxspec.load_drafter(model, "medusa", drafters / "medusa")
    assert settings == SETTINGS["medusa"] and data == {}
    heads = params["heads"] if isinstance(params, dict) else params
    assert [h["w"].shape for h in heads] == [(model.cfg.dim, model.cfg.dim)] * 2
    for bad, message in [("ar", "no drafter"), ("hydra", "unknown")]:
        with pytest.raises(jaxspec.JaxspecError, match=message):
            jaxspec.load_drafter(model, bad, drafters / "medusa")
    with pytest.raises(jaxspec.JaxspecError, match="'firp' drafter, not 'medusa'"):
        jaxspec.load_drafter(model, "medusa", drafters / "firp")


def test_bad_generator_options_fail_at_construction(model, drafters):
    with pytest.raises(jaxspec.JaxspecError, match="unknown"):
        jaxspec.Generator(model, "hydra")
    with pytest.raises(jaxspec.JaxspecError, match="no drafter"):
        jaxspec.Generator(model, "medusa", drafter=drafters / "nowhere")
    with pytest.raises(jaxspec.JaxspecError, match="tree"):
        jaxspec.Generator(model, "medusa", drafter=drafters / "medusa", tree="no-such-tree")


@pytest.mark.parametrize(
    "method, option, message",
    [
        ("ppd", {"ppd_k": 0}, "ppd_k (--ppd-k) must be a whole number from 1 to 16, got 0"),
        ("ppd", {"ppd_k": 100}, "ppd_k (--ppd-k) must be a whole number from 1 to 16, got 100"),
        ("ppd", {"ppd_layer": 0}, "ppd_layer (--ppd-layer) must be a whole number >= 1, got 0"),
        ("sdsat", {"sdsat_loop": "bogus"}, "sdsat_loop (--sdsat-loop) must be one of two-forward"),
        ("eagle", {"retrieval": -1}, "retrieval (--retrieval) must be a whole number >= 1, got -1"),
        ("medusa", {"retrieval": 0}, "retrieval (--retrieval) must be a whole number >= 1, got 0"),
        (
            "firp",
            {"firp_chains": 1.5},
            "firp_chains (--firp-chains) must be a whole number >= 0, got 1.5",
        ),
    ],
)
def test_method_options_out_of_range_are_refused_not_ignored(model, method, option, message):
    """(ppd_k 0 once fell back to the default k; retrieval -1 reached top_k inside jit.)"""
    with pytest.raises(jaxspec.JaxspecError, match=re.escape(message)):
        jaxspec.Generator(model, method, **option)


def test_ppd_without_a_head_exits_at_half_the_depth_rounded_up(tmp_path):
    """Layer 2 of 3 (the tiny model's 2 layers cannot tell ceil from floor)."""
    hf_dir, _ = save_tiny(tmp_path, n_layers=3)
    model = jaxspec.load_model(hf_dir, dtype="float32")
    assert jaxspec.Generator(model, "ppd")._decoder(jaxspec.Sampling()).layer == 2


def test_ppd_refuses_a_mesh_of_several_sequences(tiny_ckpt):
    model = jaxspec.load_model(tiny_ckpt[0], mesh="data=2,model=1")
    with pytest.raises(jaxspec.JaxspecError, match="ppd pipelines one sequence at a time"):
        jaxspec.Generator(model, "ppd")


def test_load_model_from_an_hf_folder_matches_the_checkpoint(tmp_path, reference):
    hf_dir, _ = save_tiny(tmp_path, n_kv_heads=2)  # the model tiny_ckpt was converted from
    hf = jaxspec.load_model(hf_dir, dtype="float32")
    assert hf.path == hf_dir and hf.cfg.vocab_size == 101
    out = jaxspec.Generator(hf, "ar").generate(PROMPT, max_new_tokens=N)
    assert out.token_ids == reference.token_ids and out.text == reference.text


def test_load_model_refuses_a_missing_path_and_a_bad_dtype(tmp_path, tiny_ckpt):
    missing = tmp_path / "no-model-here"
    with pytest.raises(jaxspec.JaxspecError, match=re.escape(str(missing))):
        jaxspec.load_model(missing)
    with pytest.raises(jaxspec.JaxspecError, match="dtype"):
        jaxspec.load_model(tiny_ckpt[0], dtype="float16")


@pytest.fixture(scope="module")
def bfloat16_ar(tiny_ckpt):
    model16 = jaxspec.load_model(tiny_ckpt[0], dtype="bfloat16")
    return model16, jaxspec.Generator(model16).generate(PROMPT, max_new_tokens=N)


@pytest.mark.parametrize("method", list(SETTINGS))
def test_drafters_load_and_stay_lossless_in_bfloat16(method, bfloat16_ar, drafters):
    """bfloat16 keeps block weights [out,in] (`layers.OutIn`); drafter files, stored against
    the [in,out] layout, still pass their checks and decode bfloat16 AR's tokens."""
    model16, ar = bfloat16_ar
    gen = jaxspec.Generator(model16, method, **options(method, drafters))
    assert gen.generate(PROMPT, max_new_tokens=N).token_ids == ar.token_ids


def test_stream_is_an_iterator(generators, reference):
    stream = generators["ar"].stream(PROMPT, max_new_tokens=N)
    assert iter(stream) is stream and isinstance(next(stream), str)
    list(stream)
    assert stream.result.token_ids == reference.token_ids


def test_one_generator_serves_several_threads(model, drafters, monkeypatch):
    """Threads sharing one Generator (a server's workers) get the tokens one call gets, and
    a setting's decoder and its programs are built once, not once per thread."""
    from concurrent.futures import ThreadPoolExecutor

    from jaxspec import api, decode

    gen = jaxspec.Generator(model, "medusa", **options("medusa", drafters))
    built, lowered = [], []

    def slowly(calls, real):  # every thread reaches the build before the first one ends
        def run(*args, **kw):
            calls.append(args)
            time.sleep(0.5)
            return real(*args, **kw)

        return run

    monkeypatch.setattr(api, "build_generator", slowly(built, api.build_generator))
    lowerings = slowly(lowered, decode.SpeculativeGenerator.lowerings)
    monkeypatch.setattr(decode.SpeculativeGenerator, "lowerings", lowerings)
    sample = dict(max_new_tokens=N, temperature=0.7, seed=3)
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: gen.generate(PROMPT, **sample).token_ids, range(3)))
    assert outs == [gen.generate(PROMPT, **sample).token_ids] * 3
    assert len(built) == 1 and len(lowered) == 1
