"""The campaign's record as markdown: a header naming the device and software, then one
table per part (a skipped row shows its reason)."""

from __future__ import annotations

# Per part: (row key, column header, format) of its table's columns.
COLUMNS = {
    "numerics": [
        ("what", "computed", "{}"),
        ("compile", "compiled with", "{}"),
        ("rows", "rows", "{}"),
        ("row0_same_bits", "row 0 same bits as alone", "{}"),
        ("row0_max_diff", "row 0 max difference", "{:.3g}"),
        ("error_vs_float64", "error vs float64", "{:.3g}"),
        ("us_per_product", "µs per product", "{:.1f}"),
    ],
    "ar": [
        ("batch", "batch", "{}"),
        ("products", "products", "{}"),
        ("context", "context", "{}"),
        ("ms_per_step", "ms / step", "{:.2f}"),
        ("tokens_per_s", "tokens/s", "{:.1f}"),
        ("floor_ms", "floor ms", "{:.2f}"),
        ("fraction_of_floor", "of floor", "{:.0%}"),
    ],
    "verify": [
        ("nodes", "nodes", "{}"),
        ("tree", "tree", "{}"),
        ("depth", "depth", "{}"),
        ("ms_per_step", "ms / step", "{:.2f}"),
        ("over_ar_step", "x AR step", "{:.2f}"),
    ],
    "prefill": [
        ("tokens", "prompt tokens", "{}"),
        ("products", "products", "{}"),
        ("chunk", "chunk", "{}"),
        ("ms", "ms", "{:.1f}"),
        ("tokens_per_s", "tokens/s", "{:.0f}"),
    ],
    "default_model": [
        ("set", "questions", "{}"),
        ("group", "trees", "{}"),
        ("row", "row", "{}"),
        ("tree", "tree", "{}"),
        ("tokens_per_s", "tokens/s", "{:.1f}"),
        ("speedup", "speedup", "{:.2f}x"),
        ("mean_accepted", "mean accepted", "{:.2f}"),
        (
            "acceptance_by_depth",
            "accepted at depth 1 / 2 / 3 / 4",
            lambda depths: " / ".join(f"{x:.2f}" for x in depths[:4]),
        ),
        ("match_ar", "match_ar", "{:.2f}"),
    ],
}
COLUMNS["verify_wide"] = COLUMNS["verify"]


def cell(row: dict, key: str, fmt) -> str:
    """fmt: a format string, or a function of the value."""
    value = row.get(key)
    if value is None:
        return ""
    return fmt(value) if callable(fmt) else fmt.format(value)


def table(name: str, rows: list[dict]) -> list[str]:
    columns = COLUMNS[name]
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|---" * len(columns) + "|"]
    for row in rows:
        cells = [cell(row, key, fmt) for key, _, fmt in columns]
        if "skipped" in row:  # the reason in the first column the row has no value for
            at = next((i for i, (key, _, _) in enumerate(columns) if key not in row), -1)
            cells[at] = f"skipped: {row['skipped']}"
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def model_line(record: dict) -> str:
    m = record.get("model")
    if isinstance(m, dict):
        return (
            f"{m['name']}: D {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads, "
            f"{m['n_kv_heads']} kv heads, F {m['ffn_dim']}, V {m['vocab_size']}, "
            f"{m['n_params'] / 1e9:.2f}B params"
        )
    return f"{m} ({record.get('dtype')}, {record.get('max_new_tokens')} new tokens)" if m else ""


def markdown(result: dict) -> str:
    d, sw = result["device"], result["software"]
    gbs = (
        f"{d['bandwidth_gbs']:g} GB/s ({d['bandwidth_source']})"
        if d["bandwidth_gbs"]
        else f"unknown ({d['bandwidth_source']})"
    )
    lines = [
        f"# Device campaign{' (dry run)' if result['dry_run'] else ''}: {d['kind']}, "
        f"{result['date']}",
        "",
        f"- Device: {d['kind']} ({d['platform']}, {d['count']} device(s)), driver "
        f"{d['driver'] or 'unknown (' + d['driver_source'] + ')'}, bandwidth {gbs}",
        f"- Software: jax {sw['jax']}, jaxlib {sw['jaxlib']}, Python {sw['python']}, jaxspec "
        f"{sw['jaxspec_commit'] or 'unknown'}",
        f"- Command: `{result['command']}`; weights {result['dtype']}; "
        f"{result['elapsed_s']:.0f} s of a {result['budget_s']:.0f} s budget",
    ]
    cache = result.get("compile_cache") or {}
    if cache.get("dir"):
        lines.append(
            f"- Compiled programs cached in {cache['dir']}: {cache['hits']} of "
            f"{cache['requests']} compiles loaded from it ({max(cache['saved_s'], 0):.0f} s saved)"
        )
    for name, record in result["parts"].items():
        lines += ["", f"## {record['title']} ({name})", ""]
        status = f"- Status: {record['status']}"
        if record.get("reason"):
            status += f" ({record['reason']})"
        lines.append(
            f"{status}; {record.get('seconds', 0):.0f} s of a {record['cap_s']:.0f} s cap."
        )
        if model_line(record):
            lines.append(f"- Model: {model_line(record)}.")
        if record.get("fraction_of_floor") is not None:
            lines.append(
                f"- Its AR step: {record['fraction_of_floor']:.0%} of its floor "
                f"({record['floor_ms']:.2f} ms); the whole model's weights alone: "
                f"{record['full_floor_ms']:.1f} ms."
            )
        if record["rows"]:
            lines += [""] + table(name, record["rows"])
    return "\n".join(lines) + "\n"
