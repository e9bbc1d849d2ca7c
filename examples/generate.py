"""Every decoding method on one prompt: the text, tokens per step, tokens per second, and
whether the tokens equal plain autoregressive (AR) decoding's. They must: speculative
decoding is lossless, it only changes how many tokens each forward pass yields.

    python examples/generate.py                  # the default model and its shipped drafters
    python examples/generate.py --prompt "Why is the sky blue?" --max-new-tokens 128
    python examples/generate.py --model PATH --drafters DIR   # DIR/<method>/: your drafters

Each method compiles its programs on its first call; tokens/s leaves compilation out.
"""

import argparse
import os

# PPD pipelines its work over 4 devices: on a CPU, ask XLA for 4 virtual ones (this has to
# happen before jax starts, and `import jaxspec` does not start it).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jaxspec  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--model", help="checkpoint, HF folder or .gguf (default: the default model)")
parser.add_argument("--drafters", help="folder of <method>/ drafters (default: the shipped ones)")
parser.add_argument("--prompt", default="Explain what a KV cache is in two sentences.")
parser.add_argument("--max-new-tokens", type=int, default=64)
args = parser.parse_args()

model = jaxspec.load_model(args.model)
ar_tokens = None
for method in jaxspec.METHODS:  # "ar" comes first
    # AR drafts nothing and lookup drafts from the text itself: neither loads a drafter.
    own = method not in ("ar", "lookup") and args.drafters is not None
    drafter = f"{args.drafters}/{method}" if own else None
    try:
        generator = jaxspec.Generator(model, method, drafter=drafter)
    except jaxspec.JaxspecError as e:  # e.g. PPD on a machine with fewer than 4 devices
        print(f"== {method}: skipped ({e})\n")
        continue
    out = generator.generate(args.prompt, max_new_tokens=args.max_new_tokens)
    if method == "ar":
        ar_tokens = out.token_ids
    same = "same tokens as AR" if out.token_ids == ar_tokens else "NOT AR's TOKENS"
    speed = f"{out.mean_accepted:.2f} tokens/step, {out.tokens_per_s:.1f} tokens/s"
    print(f"== {method}: {speed}, {same}")
    print(out.text.strip(), "\n")
