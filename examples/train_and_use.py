"""Train a small Medusa drafter for a model, then decode with it: the same tokens as plain
autoregressive (AR) decoding, in fewer forward passes the better the drafter guesses.

Training has no front-door API yet: this calls the trainer behind `jaxspec-train medusa`
(train/medusa.py) with command-line arguments. It learns from the model's own answers to
ShareGPT prompts, which it generates first (cached in $JAXSPEC_HOME for reruns).

    python examples/train_and_use.py             # the default model: minutes on a small CPU
    python examples/train_and_use.py --steps 400 --train-seqs 200   # longer, more data
    python examples/train_and_use.py --model PATH --out DIR

A drafter trained this briefly guesses little (a little over one token per forward pass);
the shipped Medusa drafter (800 conversations, 1200 steps, its card) does better with the
same 1-deep tree, the CPU default.

The drafter goes to --out (default: jaxspec-examples/medusa-small in the temp folder),
never to the repository's drafters/.
"""

import argparse
import tempfile
from pathlib import Path

import jaxspec.tools.train.medusa as medusa_trainer  # the trainer behind jaxspec-train medusa

import jaxspec

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
parser.add_argument("--model", help="jaxspec checkpoint (default: the default model)")
parser.add_argument("--out", type=Path, help="where the drafter goes (an empty or new folder)")
parser.add_argument("--steps", type=int, default=100, help="training steps")
parser.add_argument("--train-seqs", type=int, default=32, help="answers to train on")
parser.add_argument("--prompt", default="Explain what a KV cache is in two sentences.")
parser.add_argument("--max-new-tokens", type=int, default=64)
args = parser.parse_args()

out = args.out or Path(tempfile.gettempdir()) / "jaxspec-examples" / "medusa-small"
flags = ["--heads", "2", "--steps", args.steps, "--train-seqs", args.train_seqs,
         "--test-seqs", "4", "--new-tokens", "64", "--out", out]  # fmt: skip
flags += ["--model", args.model] if args.model else []
flags += [] if args.out else ["--overwrite"]  # the example's own folder: replaced on a rerun
report = medusa_trainer.train([str(flag) for flag in flags])
print(f"trained: top-1 accuracy per head {[acc[0] for acc in report['test_topk_accuracy']]}")

model = jaxspec.load_model(args.model)
ar = jaxspec.Generator(model, "ar").generate(args.prompt, max_new_tokens=args.max_new_tokens)
medusa = jaxspec.Generator(model, "medusa", drafter=out)
result = medusa.generate(args.prompt, max_new_tokens=args.max_new_tokens)
print(result.text.strip())
print(f"{result.mean_accepted:.2f} tokens per forward pass (AR: 1.00), ", end="")
print("the same tokens as AR" if result.token_ids == ar.token_ids else "NOT AR's TOKENS")
