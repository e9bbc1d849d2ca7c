"""The docs stay readable: BENCHMARKS.md a summary with its raw results in benchmarks/,
the README short, and every linked file present (issue 28).

Fast and jax-free: it only reads files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks"
MAX_BYTES = 100_000

# The target of a markdown link to a file under benchmarks/.
LINK = re.compile(r"\]\((benchmarks/[^)\s]+)\)")


def _text() -> str:
    return BENCHMARKS.read_text(encoding="utf-8")


def _linked() -> list[str]:
    return LINK.findall(_text())


def test_benchmarks_md_is_small():
    size = BENCHMARKS.stat().st_size
    assert size < MAX_BYTES, (
        f"BENCHMARKS.md is {size} bytes; move raw results to benchmarks/ and link them"
    )


def test_no_raw_json_block_left():
    assert "```json" not in _text(), "raw JSON belongs in benchmarks/<date>-<slug>.json"


def test_linked_results_exist():
    linked = _linked()
    assert linked, "BENCHMARKS.md links no file under benchmarks/"
    missing = [p for p in linked if not (ROOT / p).is_file()]
    assert not missing, f"BENCHMARKS.md links missing files: {missing}"


def test_every_results_file_is_linked():
    linked = set(_linked())
    orphans = sorted(p.relative_to(ROOT).as_posix() for p in RESULTS.iterdir() if p.is_file())
    orphans = [p for p in orphans if p not in linked]
    assert not orphans, f"files in benchmarks/ that BENCHMARKS.md does not link: {orphans}"


def test_json_results_parse():
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise AssertionError(f"{path.name} is not valid JSON: {e}") from e


def test_readme_is_short_and_its_links_resolve():
    """The README is a newcomer's five minutes; every file it or docs/ links exists."""
    readme = ROOT / "README.md"
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 200
    for doc in [readme, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s#]+)\)", doc.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name} links a missing {target}"
