"""Continue a prompt with a trained run: python -m blocklab.generate RUN_DIR --prompt "..." [options]."""
import argparse
import sys
from pathlib import Path

import torch

from blocklab.errors import ConfigError
from blocklab.experiment import Setup
from blocklab.model.generate import generate


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prompt", default="", help="text to continue (copy: e.g. 'abc<sep>')")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true", help="recompute the full context at every step")
    args = parser.parse_args(argv)
    try:
        setup = Setup.from_run_dir(args.run_dir)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    model, tokenizer = setup.trained_model(), setup.saved_tokenizer()
    ids = tokenizer.encode(args.prompt).ids
    eos = tokenizer.token_to_id("<eos>")
    if not ids:
        ids = [eos if eos is not None else 0]  # an empty prompt starts from a boundary token
    out = generate(model, [torch.tensor(ids)], args.max_new_tokens, eos_id=eos, pad_id=tokenizer.token_to_id("<pad>") or 0,
                   temperature=args.temperature, top_k=args.top_k,
                   generator=torch.Generator().manual_seed(args.seed), use_cache=not args.no_cache,
                   bos_id=tokenizer.token_to_id("<bos>"))
    new = out[0].tolist()
    if eos in new:
        new = new[: new.index(eos) + 1]
    sys.stdout.write(args.prompt + tokenizer.decode(new, skip_special_tokens=False) + "\n")


if __name__ == "__main__":
    main()
