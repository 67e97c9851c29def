"""Continue a prompt with a trained run: python -m blocklab.generate RUN_DIR --prompt "..." [options].
Bad input (an option out of range, a run folder that is missing, damaged or cannot generate) is one line on
stderr and exit 2, as for training; the options are checked before torch is imported."""
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from blocklab.errors import ConfigError, OneLineParser, exit_on
from blocklab.results import unfinished_run_error
from blocklab.schema import SEED_MAX

if TYPE_CHECKING:
    from blocklab.tasks.placement import Placement


def main(argv=None) -> None:
    parser = OneLineParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--prompt", default="", help="text to continue (copy: e.g. 'abc<sep>')")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true", help="recompute the full context at every step")
    args = parser.parse_args(argv)
    exit_on(option_error(args) or unfinished_run_error(args.run_dir))
    try:
        text = _continue(args)
    except ConfigError as err:  # a damaged run file, or a run that cannot continue a free prompt
        exit_on(str(err))
    sys.stdout.write(text + "\n")


def option_error(args) -> str | None:
    """The one line for a sampling option no generation can use (a negative count, temperature or k)."""
    if args.max_new_tokens < 1:
        return f"--max-new-tokens={args.max_new_tokens} must be a positive number of tokens, e.g. 200"
    if not math.isfinite(args.temperature) or args.temperature < 0:
        return f"--temperature={args.temperature} must be a finite number >= 0 (0: greedy, 1: the model's own distribution)"
    if args.top_k is not None and args.top_k < 1:
        return f"--top-k={args.top_k} must be a positive integer (the k most likely tokens sampled from), or left out for all"
    if not 0 <= args.seed <= SEED_MAX:
        return f"--seed={args.seed} must be an integer in [0, {SEED_MAX}]"
    return None


def _continue(args) -> str:
    """The prompt and what the run's model writes after it; ConfigError where the run cannot."""
    import torch

    from blocklab.experiment import Setup
    from blocklab.model.generate import generate
    from blocklab.model.transformer import ARCHITECTURES
    from blocklab.tasks.placement import Placement

    setup = Setup.from_run_dir(args.run_dir)
    if not ARCHITECTURES[setup.model_cfg.arch].generates:
        raise ConfigError(f"{args.run_dir} trained model.arch={setup.model_cfg.arch}, which fills in masked "
                          "tokens and does not continue a prompt; generate from a run with model.arch=decoder or "
                          "encoder_decoder")
    placement_error = derived_positions_error(Placement.from_pos(setup.config["pos"]))
    if placement_error:
        raise ConfigError(f"{args.run_dir} {placement_error}")
    tokenizer = setup.saved_tokenizer()
    unknown_error = unknown_characters_error(tokenizer, args.prompt)
    if unknown_error:
        raise ConfigError(unknown_error)
    ids = tokenizer.encode(args.prompt).ids
    if len(ids) > setup.model_cfg.max_len:  # past what it trained on, at a cost that grows with each token
        raise ConfigError(f"--prompt is {len(ids)} tokens, longer than the {setup.model_cfg.max_len} this run's model "
                          "takes (the longest sequence it trained or evaluated on); give a shorter prompt")
    model = setup.trained_model()
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
    return args.prompt + tokenizer.decode(new, skip_special_tokens=False)


def derived_positions_error(placement: "Placement") -> str | None:
    """Coupled ids, Abacus digit indices and randomized positions come from the task's view of each example
    (which digit of which number, a draw over [0, L)); a free prompt has none to give."""
    settings = [f"pos.{key}" for key, on in (("coupled", placement.coupled), ("abacus", placement.abacus),
                                             ("randomize", placement.random_max is not None)) if on]
    if not settings:
        return None
    return (f"trained with {', '.join(settings)}: its position streams come from the task's structure of each "
            "example, which a free prompt does not have; its results.json eval rows are its greedy decoding at "
            "every length, or generate from a run without these settings")


def unknown_characters_error(tokenizer: Tokenizer, prompt: str) -> str | None:
    """The prompt's characters the tokenizer maps to its unknown token (the copy task's <pad>, a char LM's
    <unk> without byte fallback): the model would never see them. Byte-level vocabularies have no unknown."""
    unk = getattr(tokenizer.model, "unk_token", None)
    if unk is None:
        return None
    unk_id = tokenizer.token_to_id(unk)
    encoding = tokenizer.encode(prompt)
    pieces = (prompt[start:end] for token_id, (start, end) in zip(encoding.ids, encoding.offsets) if token_id == unk_id)
    unknown = dict.fromkeys(piece for piece in pieces if piece != unk)  # the unk token typed whole is no loss
    if not unknown:
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    chars = "".join(token for token, _ in vocab if len(token) == 1)
    specials = " ".join(token for token, _ in vocab if len(token) > 1 and token != unk)
    known = repr(chars if len(chars) <= 60 else chars[:60] + "...") + (f" and {specials}" if specials else "")
    return (f"--prompt has characters this run's tokenizer does not know: {' '.join(map(repr, unknown))} "
            f"(it knows {known})")


if __name__ == "__main__":
    main()
