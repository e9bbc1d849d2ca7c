"""`make demo`: generate from a prompt with the default model, streaming the text, then
report tokens per step and speed. Speculative methods join here as their drafters ship;
until then plain AR decoding is the method shown."""

from __future__ import annotations

import sys

from infer.common import METHODS, load_model
from jaxspec.cli import run_main
from jaxspec.generate import ARGenerator
from jaxspec.text import TextStream, encode_prompt

DEFAULT_PROMPT = "Write a short poem about the sea."


def _main(argv) -> None:
    prompt = " ".join(argv if argv is not None else sys.argv[1:]) or DEFAULT_PROMPT
    model = load_model()
    print(f"model: {model.cfg.name} ({model.cfg.n_params / 1e6:.0f}M params) from {model.path}")
    print(f"methods available: {', '.join(METHODS)}\n")
    print(f">>> {prompt}\n")
    ids = encode_prompt(model.tokenizer, prompt)
    generator = ARGenerator(model.cfg, model.params)
    stream = TextStream(model.tokenizer)
    result = generator.generate(
        ids, 128, on_tokens=lambda t: print(stream.push(t), end="", flush=True)
    )
    print(
        f"\n\n[ar] {result.new_tokens} tokens, {result.mean_accepted:.2f} accepted tokens/step, "
        f"{result.tokens_per_s:.1f} tokens/s (first-call compilation {result.compile_s:.1f} s, "
        "not counted)"
    )


def main(argv=None) -> None:
    run_main(_main, argv)


if __name__ == "__main__":
    main()
