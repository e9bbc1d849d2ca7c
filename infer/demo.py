"""`make demo`: a prompt generated, streamed, with the fastest lossless configuration of this
machine (weight dtype, method, tree: measured once by `jaxspec.autoconfig`, then cached),
then with plain AR decoding in the faster AR dtype here: accepted tokens per step, the
speedup over that AR (below 1 too, if so) and whether the output is token-identical to AR
in the chosen dtype (greedy decoding is lossless; AR in the other dtype is a slightly
different model, whose tokens may differ)."""

from __future__ import annotations

from jaxspec.api import Generator
from jaxspec.autoconfig import Choice, best_configuration
from jaxspec.cli import ArgumentParser, run_main
from jaxspec.generate import GenerationResult
from jaxspec.models import load_model

DEFAULT_PROMPT = "Write a short poem about the sea."
NEW_TOKENS = 128


def parse_args(argv):
    parser = ArgumentParser(
        prog="python -m infer.demo",
        description="Speculative decoding of a prompt, against plain AR.",
    )
    parser.add_argument("prompt", nargs="*", help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    parser.add_argument(
        "--remeasure", action="store_true", help="measure this machine's best configuration again"
    )
    return parser.parse_args(argv)


def _main(argv) -> None:
    args = parse_args(argv)
    prompt = " ".join(args.prompt) or DEFAULT_PROMPT
    choice = best_configuration(remeasure=args.remeasure)
    print(summary(choice))
    best = choice.best
    model = load_model(dtype=best.dtype)
    print(f"model: {model.cfg.name} ({model.cfg.n_params / 1e6:.0f}M params), {best.label}\n")
    print(f">>> {prompt}\n")
    stream = Generator(model, best.method, tree=best.tree).stream(prompt, NEW_TOKENS)
    for piece in stream:
        print(piece, end="", flush=True)
    result = stream.result
    print(
        f"\n\n[{best.label}] {result.new_tokens} tokens in {result.steps} steps: "
        f"{result.mean_accepted:.2f} tokens/step, {result.tokens_per_s:.1f} tokens/s"
    )
    if best.method == "ar":
        print("no drafter decodes faster than AR here: AR is the fastest lossless configuration")
    else:
        compare_with_ar(model, choice, prompt, result)
    print("(compilation excluded from all timings)")


def summary(choice: Choice) -> str:
    """Why this configuration: one line."""
    n = sum(row.lossless for row in choice.table)
    when = "" if not choice.cached else f" on {choice.date}"
    return (
        f"measured {n} lossless configurations here{when} in {choice.measured_s:.0f} s "
        f"(cached in {choice.path}; --remeasure to redo): {choice.best.label} is fastest, "
        f"{choice.speedup:.2f}x the fastest AR there"
    )


def compare_with_ar(model, choice: Choice, prompt: str, result: GenerationResult) -> None:
    """AR on the same prompt: in the chosen dtype for the lossless check, in the faster AR
    dtype here for the speedup (one run when they are the same)."""
    dtype, fastest_ar = choice.best.dtype, choice.fastest_ar
    same_dtype = ar = Generator(model).generate(prompt, NEW_TOKENS)
    if fastest_ar.dtype != dtype:
        ar = Generator(load_model(dtype=fastest_ar.dtype)).generate(prompt, NEW_TOKENS)
    print(
        f"[{fastest_ar.label}] {ar.tokens_per_s:.1f} tokens/s -> speedup "
        f"{result.tokens_per_s / ar.tokens_per_s:.2f}x over the fastest AR here "
        f"({fastest_ar.dtype})"
    )
    print(f"outputs identical to {dtype} AR: {same_dtype.token_ids == result.token_ids}")


def main(argv=None) -> None:
    run_main(_main, argv)


if __name__ == "__main__":
    main()
