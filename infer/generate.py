"""jaxspec-generate: generate from a prompt, streaming text or printing one JSON object.
Several prompts decode together as one batch (one JSON object per line with --json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxspec import METHODS, hosts
from jaxspec.api import Generator
from jaxspec.cli import (
    ArgumentParser,
    nonnegative_int,
    positive_int,
    ppd_k,
    probability,
    run_main,
    seed,
    temperature,
)
from jaxspec.decode import PRODUCTS
from jaxspec.errors import JaxspecError
from jaxspec.mesh import make_mesh
from jaxspec.mesh import parse_mesh as mesh_shape
from jaxspec.methods import SDSAT_LOOPS, provide_devices, provide_devices_for
from jaxspec.models import DTYPES, load_model


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
        help=f"one of {', '.join(METHODS)}",
    )
    p.add_argument(
        "--model",
        type=Path,
        help="a jaxspec checkpoint folder, an HF model folder or a .gguf file "
        "(default: SmolLM2-135M-Instruct)",
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
    p.add_argument("--ppd-k", type=ppd_k, help="ppd: sub-processes (needs k+1 devices; default 3)")
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
        "--retrieval",
        type=positive_int,
        help="medusa, firp, chimera, eagle with a dynamic-N tree: N-node budget shared with "
        "this many continuations found in the prompt and output (lookup's), scored by their "
        "own measured confidence or the drafter's probability, whichever is higher",
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
        help="weight dtype (default: float32 on CPU, bfloat16 on accelerators); bfloat16 decodes "
        "faster on CPUs with AMX and GPUs, and is a slightly different model (docs/design.md, "
        "Precision)",
    )
    p.add_argument(
        "--max-len",
        type=positive_int,
        help="the most positions a prompt and its answer may take (default: the model's context)",
    )
    p.add_argument(
        "--mesh", type=mesh_shape,
        help="split the model over devices: data=D,model=M (tensor parallel over model; on "
        "CPU the D*M virtual devices are set up for you)",
    )  # fmt: skip
    p.add_argument(
        "--products", choices=PRODUCTS,
        help="how bfloat16 weights multiply: exact (float32-accurate), one bfloat16 pass "
        "in the prefill only (plain-prefill) or everywhere (plain); default plain-prefill "
        "on a GPU, else exact",
    )  # fmt: skip
    hosts.add_arguments(p)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    return p.parse_args(argv)


def main(argv=None) -> None:
    run_main(_main, argv)


def _main(argv) -> None:
    args = parse_args(argv)
    hosts.check(args.coordinator, args.num_processes, args.process_id)
    if args.coordinator and args.method == "ppd":
        raise JaxspecError("ppd runs in one process (its stages on that process's devices): "
                           "drop --coordinator")  # fmt: skip
    provide_devices_for([args.method], args.ppd_k, args.mesh["model"] if args.mesh else 1)
    if args.mesh:
        devices = args.mesh["data"] * args.mesh["model"]
        provide_devices(hosts.local_device_count(devices, args.num_processes))
    prompts = [read_prompt(p) for p in args.prompts]
    hosts.start(args.coordinator, args.num_processes, args.process_id)
    with hosts.printing_on_first_process():
        _generate(args, prompts)


def _generate(args, prompts: list[str]) -> None:
    model = load_model(args.model, args.dtype, make_mesh(args.mesh) if args.mesh else None)
    if model.tokenizer is None:  # the prompts are text
        raise JaxspecError(
            f"the model at {model.path} has no tokenizer (tokenizer.json or tokenizer.model) to "
            "read the prompt with: convert the model from its HF folder"
        )
    generator = Generator(
        model,
        args.method, drafter=args.drafter, tree=args.tree,
        max_len=args.max_len, products=args.products, chat=not args.no_chat, ppd_k=args.ppd_k,
        ppd_layer=args.ppd_layer, firp_chains=args.firp_chains, sdsat_loop=args.sdsat_loop,
        retrieval=args.retrieval,
    )  # fmt: skip
    weight_bytes = generator.model.bytes_per_device()
    sampling = dict(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        typical=args.typical,
    )  # fmt: skip
    if len(prompts) > 1:
        results = generator.generate(prompts, args.max_new_tokens, **sampling)
        for result in results:
            print(
                json.dumps(summarize(args.method, result, weight_bytes))
                if args.json
                else f"--- {result.text}\n"
            )
        report_batch(args.method, results)
    elif args.json:
        result = generator.generate(prompts[0], args.max_new_tokens, **sampling)
        print(json.dumps(summarize(args.method, result, weight_bytes)))
    else:
        stream = generator.stream(prompts[0], args.max_new_tokens, **sampling)
        for piece in stream:
            print(piece, end="", flush=True)
        print()
        report(args.method, stream.result)


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


def summarize(method: str, result, weight_bytes_per_device: int | None = None) -> dict:
    return {
        "method": method,
        "text": result.text,
        "token_ids": result.token_ids,
        "prompt_tokens": len(result.prompt_ids),
        "new_tokens": result.new_tokens,
        "steps": result.steps,
        "mean_accepted": result.mean_accepted,
        "tokens_per_s": result.tokens_per_s,
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "compile_s": result.compile_s,
        "weight_bytes_per_device": weight_bytes_per_device,
    }


def report_batch(method: str, results) -> None:
    total, seconds = sum(r.new_tokens for r in results), results[0].prefill_s + results[0].decode_s
    print(
        f"[{method}] batch of {len(results)}: {total} tokens in {seconds:.1f} s "
        f"({total / seconds:.1f} tokens/s); compile {results[0].compile_s:.1f} s",
        file=sys.stderr,
    )


def report(method: str, result) -> None:
    print(
        f"[{method}] {result.new_tokens} tokens in {result.steps} steps "
        f"({result.mean_accepted:.2f} tokens/step), {result.tokens_per_s:.1f} tokens/s; "
        f"compile {result.compile_s:.1f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
