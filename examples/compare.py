"""Methods side by side on a few prompts: a table of mean tokens per step (how many tokens
each forward pass yields) and decoding speed relative to plain autoregressive (AR) decoding.

    python examples/compare.py                   # the default model and its shipped drafters
    python examples/compare.py --methods ar medusa firp --max-new-tokens 128
    python examples/compare.py --model PATH --drafters DIR   # DIR/<method>/: your drafters

Each method first decodes every prompt once untimed (a warm-up: compiling its programs),
then once more, timed. Speed depends on the machine: on a small CPU, AR can be fastest.
"""

import argparse
import os

# PPD pipelines its work over 4 devices: on a CPU, ask XLA for 4 virtual ones (this has to
# happen before jax starts, and `import jaxspec` does not start it).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jaxspec  # noqa: E402

PROMPTS = [
    "Explain what a KV cache is in two sentences.",
    "Write a Python function that reverses a list.",
    "Give three tips for a job interview.",
]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--model", help="checkpoint, HF folder or .gguf (default: the default model)")
parser.add_argument("--drafters", help="folder of <method>/ drafters (default: the shipped ones)")
parser.add_argument("--methods", nargs="+", default=jaxspec.METHODS, choices=jaxspec.METHODS)
parser.add_argument("--max-new-tokens", type=int, default=64)
args = parser.parse_args()

model = jaxspec.load_model(args.model)
print(f"{'method':8} {'tokens/step':>11} {'tokens/s':>9} {'vs AR':>6}  same tokens as AR")
ar_speed, ar_tokens = None, None
for method in ["ar", *[m for m in args.methods if m != "ar"]]:  # AR first: the reference
    # AR drafts nothing and lookup drafts from the text itself: neither loads a drafter.
    own = method not in ("ar", "lookup") and args.drafters is not None
    drafter = f"{args.drafters}/{method}" if own else None
    try:
        generator = jaxspec.Generator(model, method, drafter=drafter)
    except jaxspec.JaxspecError as e:  # e.g. PPD on a machine with fewer than 4 devices
        print(f"{method:8} skipped: {e}")
        continue
    for prompt in PROMPTS:  # the warm-up
        generator.generate(prompt, max_new_tokens=args.max_new_tokens)
    outs = [generator.generate(p, max_new_tokens=args.max_new_tokens) for p in PROMPTS]
    tokens = sum(out.new_tokens for out in outs)
    speed = tokens / sum(out.prefill_s + out.decode_s for out in outs)
    if method == "ar":
        ar_speed, ar_tokens = speed, [out.token_ids for out in outs]
    same = "yes" if [out.token_ids for out in outs] == ar_tokens else "NO"
    per_step = tokens / sum(out.steps for out in outs)
    print(f"{method:8} {per_step:11.2f} {speed:9.1f} {speed / ar_speed:5.2f}x  {same}")
