"""Continue a prompt with a trained run: python -m blocklab.generate RUN_DIR --prompt "..." [options]."""
import argparse
import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from blocklab.model import ModelConfig, build_model
from blocklab.model.generate import generate
from blocklab.results import CHECKPOINT, MODEL_FILE, TOKENIZER_FILE


def load_run(run_dir: Path) -> tuple[torch.nn.Module, Tokenizer]:
    """The trained model and its tokenizer, from the files every run writes."""
    missing = [name for name in (MODEL_FILE, TOKENIZER_FILE, CHECKPOINT) if not (run_dir / name).exists()]
    if missing:
        raise SystemExit(f"error: {run_dir} is not a finished BlockLab run (missing {', '.join(map(str, missing))})")
    model = build_model(ModelConfig.from_dict(json.loads((run_dir / MODEL_FILE).read_text())))
    state = torch.load(run_dir / CHECKPOINT, map_location="cpu", weights_only=True)["state_dict"]
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    return model.eval(), Tokenizer.from_file(str(run_dir / TOKENIZER_FILE))


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
    model, tokenizer = load_run(args.run_dir)
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
