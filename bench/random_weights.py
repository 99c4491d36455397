"""Give a model folder (config.json, tokenizer files) random weights, for timing runs where the real
weights cannot travel: `python bench/random_weights.py FOLDER [--dtype bfloat16]` writes
FOLDER/model.safetensors with transformers' own initialisation of the config's architecture. The
tokens such a model generates are noise; benchmarks that use it fix every output length
(`ignore_eos`), so the work per step is what the real weights would cost. Used by
bench/gpu_session.sh, whose device machine has no network and cannot take the builtin model's weights."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as a script, this folder (and the repository, through PYTHONPATH) would come first on the path, and
# transformers, which probes for a package named `kernels`, would import ours (or bench/kernels.py).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() not in (_HERE, _HERE.parent)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a model folder with config.json (and the tokenizer files to keep)")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the weights written (default bfloat16)")
    args = p.parse_args()
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(args.folder)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.folder, safe_serialization=True)
    print(f"{args.folder}: random {type(model).__name__} weights, {sum(t.numel() for t in model.parameters()):,} "
          f"parameters, {args.dtype}")


if __name__ == "__main__":
    main()
