"""jaxspec-generate: generate from a prompt, streaming text or printing one JSON object.
Several prompts decode together as one batch (one JSON object per line with --json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxspec.cli import (
    ArgumentParser,
    nonnegative_int,
    positive_int,
    probability,
    run_main,
    seed,
    temperature,
)
from jaxspec.errors import JaxspecError
from jaxspec.methods import METHODS, SDSAT_LOOPS, build_generator, check_method, provide_devices
from jaxspec.models import DTYPES, load_model
from jaxspec.sampling import Sampling
from jaxspec.text import TextStream, encode_prompt

ALL_METHODS = ("ar", "medusa", "firp", "chimera", "sdsat", "ppd")


def parse_args(argv=None):
    p = ArgumentParser(prog="jaxspec-generate", description=__doc__)
    p.add_argument(
        "prompts",
        nargs="+",
        metavar="PROMPT",
        help="the prompt text ('-' reads standard input); several prompts run as one batch",
    )
    p.add_argument(
        "--method",
        default="ar",
        help=f"one of {', '.join(ALL_METHODS)} (available: {', '.join(METHODS)})",
    )
    p.add_argument(
        "--model", type=Path, help="jaxspec checkpoint folder (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument(
        "--drafter", type=Path, help="drafter folder (default: the one shipped for the model)"
    )
    p.add_argument("--tree", help="tree preset (default: the method's, by backend)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=probability, default=1.0)
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="0: no top-k cut")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument(
        "--typical",
        action="store_true",
        help="Medusa's typical acceptance (faster, NOT lossless: changes the output distribution)",
    )
    p.add_argument(
        "--ppd-k", type=positive_int, default=3, help="ppd: sub-processes (needs k+1 devices)"
    )
    p.add_argument(
        "--ppd-layer", type=positive_int, help="ppd: early-prediction layer (>= half the depth)"
    )
    p.add_argument(
        "--firp-chains",
        type=nonnegative_int,
        help="firp: pseudo chains on the N tree nodes likeliest to end a step (0 = every "
        "node; default: the drafter's setting)",
    )
    p.add_argument(
        "--sdsat-loop",
        choices=SDSAT_LOOPS,
        help="sdsat: the paper's draft step then verify step (two forwards a loop), or "
        "adaptive chains inside the verify step (one forward; default: two-forward)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="weight dtype (default: as stored, float32); bfloat16 decodes faster on CPUs with "
        "AMX and GPUs, and is a slightly different model (README, Precision)",
    )
    p.add_argument(
        "--max-len", type=positive_int, help="cache length limit (default: the model's context)"
    )
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    return p.parse_args(argv)


def main(argv=None) -> None:
    run_main(_main, argv)


def _main(argv) -> None:
    args = parse_args(argv)
    check_options(args)
    if args.method == "ppd":
        provide_devices(args.ppd_k + 1)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.typical)
    prompts = [read_prompt(p) for p in args.prompts]
    model = load_model(args.model, args.dtype)
    prompt_ids = [encode_prompt(model.tokenizer, p, chat=not args.no_chat) for p in prompts]
    generator = build_generator(
        model, args.method, args.drafter, args.tree, sampling, args.max_len, args.ppd_k,
        args.ppd_layer, args.firp_chains, args.sdsat_loop,
    )  # fmt: skip
    if len(prompt_ids) > 1:
        results = generator.generate_batch(prompt_ids, args.max_new_tokens, args.seed)
        for result in results:
            summary = summarize(args.method, model.tokenizer, result)
            print(json.dumps(summary) if args.json else f"--- {summary['text']}\n")
        total, seconds = (
            sum(r.new_tokens for r in results),
            results[0].prefill_s + results[0].decode_s,
        )
        print(
            f"[{args.method}] batch of {len(results)}: {total} tokens in {seconds:.1f} s "
            f"({total / seconds:.1f} tokens/s); compile {results[0].compile_s:.1f} s",
            file=sys.stderr,
        )
        return

    stream = None if args.json else TextStream(model.tokenizer)

    def show(ids):
        print(stream.push(ids), end="", flush=True)

    result = generator.generate(
        prompt_ids[0], args.max_new_tokens, args.seed, None if args.json else show
    )
    if args.json:
        print(json.dumps(summarize(args.method, model.tokenizer, result)))
    else:
        print()
        report(args.method, result)


def read_prompt(arg: str) -> str:
    """A prompt argument, or standard input for '-'; UTF-8 text either way."""
    if arg == "-":
        try:
            return sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as e:
            raise JaxspecError(
                f"standard input is not UTF-8 text (byte {e.start}); send UTF-8"
            ) from None
    try:
        arg.encode("utf-8")  # undecodable argv bytes arrive as lone surrogates
    except UnicodeEncodeError:
        raise JaxspecError("a prompt is not UTF-8 text; pass UTF-8 (or '-' and stdin)") from None
    return arg


def check_options(args) -> None:
    """Options that the chosen method would silently ignore are errors."""
    check_method(args.method)
    if args.tree is not None and args.method in ("ar", "ppd"):
        raise JaxspecError(f"--tree picks a draft tree; --method {args.method} has none")
    if args.drafter is not None and args.method == "ar":
        raise JaxspecError("--drafter applies to speculative methods; --method ar has none")
    if args.firp_chains is not None and args.method != "firp":
        raise JaxspecError("--firp-chains applies to --method firp only")
    if args.sdsat_loop is not None and args.method != "sdsat":
        raise JaxspecError("--sdsat-loop applies to --method sdsat only")
    if args.ppd_layer is not None and args.method != "ppd":
        raise JaxspecError("--ppd-layer applies to --method ppd only")


def summarize(method: str, tokenizer, result) -> dict:
    return {
        "method": method,
        "text": tokenizer.decode(result.token_ids, skip_special_tokens=True),
        "token_ids": result.token_ids,
        "prompt_tokens": len(result.prompt_ids),
        "new_tokens": result.new_tokens,
        "steps": result.steps,
        "mean_accepted": result.mean_accepted,
        "tokens_per_s": result.tokens_per_s,
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "compile_s": result.compile_s,
    }


def report(method: str, result) -> None:
    print(
        f"[{method}] {result.new_tokens} tokens in {result.steps} steps "
        f"({result.mean_accepted:.2f} tokens/step), {result.tokens_per_s:.1f} tokens/s; "
        f"compile {result.compile_s:.1f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
