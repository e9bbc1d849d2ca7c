"""Scaling on paper (`jaxspec.scaling`): per device of a model=TP mesh, the weights and KV
cache it holds, whether they fit, and the PREDICTED time of an AR step and of a T-node
verify step, from the model's config and the accelerators' spec sheets. Nothing runs on a
device; the numbers are predictions, not measurements (docs/scaling.md).

    python -m infer.scaling                                   # the table in docs/scaling.md
    python -m infer.scaling --models llama-3-70b --tp 8 --accelerators h100 tpu-v5p \\
        --tau chimera@searched-32:32:2.16 medusa@searched-32:32:1.58

`--tau LABEL:NODES:TAU` adds a second table: the speedup over AR a method accepting TAU
tokens per step on a NODES-node tree would give on each row's setting (drafting not
counted), for the settings where the model fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from jaxspec.cli import ArgumentParser, positive_int, run_main
from jaxspec.errors import JaxspecError
from jaxspec.outputs import check_output_file, write_text
from jaxspec.scaling import ACCELERATORS, Dtypes, fits, model_config, predict_step, speedup

PASSES = {"exact": 3, "plain": 1}


@dataclasses.dataclass(frozen=True)
class Tau:
    """A method's measured tokens per step `tau` on a tree of `nodes` nodes (root included)."""

    label: str
    nodes: int
    tau: float


def parse_tau(text: str) -> Tau:
    """ "chimera@searched-32:32:2.16" -> Tau("chimera@searched-32", 32, 2.16)."""
    label, _, rest = text.partition(":")
    nodes, _, tau = rest.partition(":")
    try:
        parsed = Tau(label, int(nodes), float(tau))
    except ValueError:
        parsed = None
    if not label or parsed is None or parsed.nodes < 1 or not parsed.tau >= 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write LABEL:NODES:TAU with NODES >= 1 and TAU >= 1, e.g. chimera:32:2.16"
        )
    return parsed


def predict(args) -> list[dict]:
    """One record per (model, accelerator, TP): the AR step, the verify step, and each
    --tau's speedup."""
    dt = Dtypes(cache=args.cache_bytes, passes=PASSES[args.products])
    records = []
    for name in args.models:
        cfg = model_config(name)
        for acc_name in args.accelerators:
            acc = ACCELERATORS[acc_name]
            for tp in args.tp:
                ar = predict_step(cfg, acc, tp, args.batch, 1, args.context, dt)
                verify = predict_step(cfg, acc, tp, args.batch, args.nodes, args.context, dt)
                speedups = {}
                for t in args.tau:
                    tree = predict_step(cfg, acc, tp, args.batch, t.nodes, args.context, dt)
                    speedups[t.label] = speedup(t.tau, ar, tree)
                records.append(
                    {
                        "model": cfg.name,
                        "accelerator": acc.name,
                        "tp": tp,
                        "fits": fits(ar, acc),
                        "ar": _step_record(ar),
                        "verify": _step_record(verify),
                        "speedups": speedups,
                    }
                )
    return records


def _step_record(step) -> dict:
    return {**dataclasses.asdict(step), "seconds": step.seconds}


def table(records: list[dict], nodes: int) -> str:
    """The markdown table of weights, fit, step times and verify communication."""
    lines = [
        f"| model | accelerator | TP | weights GB/device | KV GB/device | fits | AR ms/token "
        f"| {nodes}-node verify ms | verify / AR | comm MB/verify step (all-reduce + logits) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ar, v = r["ar"], r["verify"]
        gather = v["comm_bytes"] - v["allreduce_bytes"]
        lines.append(
            f"| {r['model']} | {r['accelerator']} | {r['tp']} | {ar['weight_bytes'] / 1e9:.2f} "
            f"| {ar['cache_bytes'] / 1e9:.2f} | {'yes' if r['fits'] else 'no'} "
            f"| {ar['seconds'] * 1e3:.2f} | {v['seconds'] * 1e3:.2f} "
            f"| {v['seconds'] / ar['seconds']:.2f} "
            f"| {v['allreduce_bytes'] / 1e6:.1f} + {gather / 1e6:.1f} |"
        )
    return "\n".join(lines)


def speedup_table(records: list[dict], taus: list[Tau]) -> str:
    """The markdown table of each --tau's predicted speedup, per setting the model fits."""
    head = " | ".join(f"{t.label} ({t.nodes} nodes, τ {t.tau:.2f})" for t in taus)
    lines = [f"| model | accelerator | TP | {head} |", "|---|---|---|" + "---|" * len(taus)]
    for r in filter(lambda r: r["fits"], records):
        cells = " | ".join(f"{r['speedups'][t.label]:.2f}x" for t in taus)
        lines.append(f"| {r['model']} | {r['accelerator']} | {r['tp']} | {cells} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m infer.scaling", description=__doc__)
    p.add_argument(
        "--models",
        nargs="+",
        default=["llama-3-8b", "llama-3-70b"],
        help="jaxspec presets, or llama-3-70b",
    )
    p.add_argument(
        "--tp",
        nargs="+",
        type=positive_int,
        default=[1, 2, 4, 8],
        help="tensor-parallel degrees (mesh model=TP, data=1)",
    )
    p.add_argument(
        "--accelerators", nargs="+", choices=list(ACCELERATORS), default=list(ACCELERATORS)
    )
    p.add_argument(
        "--context",
        type=positive_int,
        default=2048,
        help="cache slots read per step (jaxspec reads its whole buffer)",
    )
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--nodes", type=positive_int, default=32, help="verify tree nodes")
    p.add_argument(
        "--cache-bytes",
        type=int,
        choices=(2, 4),
        default=4,
        help="bytes per cached key/value element (jaxspec: 4, float32)",
    )
    p.add_argument(
        "--products",
        choices=list(PASSES),
        default="exact",
        help="bfloat16 products: exact (3 passes, jaxspec's default) or plain (1)",
    )
    p.add_argument(
        "--tau",
        nargs="*",
        type=parse_tau,
        default=[],
        help="LABEL:NODES:TAU, a method's measured tokens per step",
    )
    p.add_argument("--json", type=Path, help="also write the records to this file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json")
    return p.parse_args(argv)


def _main(argv) -> None:
    args = parse_args(argv)
    if args.json is not None:
        check_output_file(args.json, "--json")
        if args.json.exists() and not args.overwrite:
            raise JaxspecError(f"{args.json} exists; pass --overwrite to replace it")
    records = predict(args)
    print(table(records, args.nodes))
    if args.tau:
        print()
        print(speedup_table(records, args.tau))
    if args.json is not None:
        write_text(args.json, json.dumps(records, indent=2) + "\n")


def main(argv=None) -> None:
    run_main(_main, argv)


if __name__ == "__main__":
    main()
