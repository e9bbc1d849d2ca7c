"""`make demo`: speculative generation of a prompt with the best shipped drafter, streamed,
then the same prompt with plain AR decoding: accepted tokens per step, speedup, and
whether the two outputs are token-identical (they must be: greedy decoding is lossless).
Both run with the weight dtype that decodes fastest on this machine (`fastest_dtype`)."""

from __future__ import annotations

import sys

from jaxspec.cli import run_main
from jaxspec.methods import DRAFTERS_DIR, build_generator
from jaxspec.models import fastest_dtype, load_model
from jaxspec.text import TextStream, encode_prompt

DEFAULT_PROMPT = "Write a short poem about the sea."
PREFERENCE = ("firp", "medusa")  # best first, among methods whose drafter ships for the model


def _main(argv) -> None:
    prompt = " ".join(argv if argv is not None else sys.argv[1:]) or DEFAULT_PROMPT
    dtype = fastest_dtype()
    model = load_model(dtype=dtype)
    shipped = [m for m in PREFERENCE if (DRAFTERS_DIR / model.cfg.name / m).is_dir()]
    method = shipped[0] if shipped else "ar"
    print(
        f"model: {model.cfg.name} ({model.cfg.n_params / 1e6:.0f}M params, {dtype} weights, "
        f"the faster here), method: {method}\n"
    )
    print(f">>> {prompt}\n")
    ids = encode_prompt(model.tokenizer, prompt)
    stream = TextStream(model.tokenizer)
    spec = build_generator(model, method)
    result = spec.generate(ids, 128, on_tokens=lambda t: print(stream.push(t), end="", flush=True))
    print(
        f"\n\n[{method}] {result.new_tokens} tokens in {result.steps} steps: "
        f"{result.mean_accepted:.2f} accepted tokens/step, {result.tokens_per_s:.1f} tokens/s"
    )
    if method != "ar":
        ar = build_generator(model, "ar").generate(ids, 128)
        speedup = result.tokens_per_s / ar.tokens_per_s
        print(
            f"[ar] {ar.tokens_per_s:.1f} tokens/s -> speedup {speedup:.2f}x; "
            f"outputs identical: {ar.token_ids == result.token_ids}"
        )
    print("(compilation excluded from all timings)")


def main(argv=None) -> None:
    run_main(_main, argv)


if __name__ == "__main__":
    main()
