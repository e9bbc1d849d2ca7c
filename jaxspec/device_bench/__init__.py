"""The device campaign (`python -m infer.device_bench`, `make device-bench`): on a machine
with an accelerator, in one command and under 8 minutes, everything the project has not
measured on one yet, written to one JSON file and its markdown beside it:

- ar: AR decode at Llama-3-8B shapes (random bfloat16 weights made on the device), batch 1
  and 8, ms per token against the memory-bandwidth floor of the device found;
- verify: the verify step over trees of 1/2/4/8/16/32/64 nodes at the same shapes, each
  over the AR step;
- prefill: prompts of 2k/8k/32k tokens (a size that does not fit: a skipped row), then
  the 8k one in 1024- and 4096-token chunks (which chunk size the platform should take);
- default_model: the default model, every method with its shipped drafter at its default
  tree and at its searched 32-node tree, on 20 Spec-Bench questions and 10 HumanEval
  problems, bfloat16: tokens/s, speedup over AR, mean accepted tokens, how often each depth
  was accepted, match_ar;
- verify_wide: the verify step at Llama-3-70B's layer shapes (a 4-layer slice), if memory
  allows.

Each part has a share of the time budget and the record is rewritten after every row, so a
run cut short still leaves its file. `dry_run` runs every part at tiny shapes (a tiny
checkpoint with untrained drafters for the end-to-end part) in well under a minute on a CPU.
"""

from jaxspec.device_bench.campaign import PARTS, run_campaign

__all__ = ["PARTS", "run_campaign"]
