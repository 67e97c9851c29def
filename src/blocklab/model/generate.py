"""Autoregressive decoding: greedy or sampled, with or without the KV cache."""
from contextlib import contextmanager

import torch
from torch import Tensor


def left_pad(prompts: list[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """Stack prompts of different lengths, padded on the left so every row ends at the same column."""
    width = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        idx[row, width - len(prompt):] = prompt
        valid[row, width - len(prompt):] = True
    return idx, valid


def _next_token(logits: Tensor, temperature: float, top_k: int | None, generator) -> Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def right_pad(prompts: list[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    idx, valid = left_pad([p.flip(0) for p in prompts], pad_id)
    return idx.flip(1), valid.flip(1)


@contextmanager
def decoding():
    """What a decoding loop runs under: inference_mode (cheaper per op than no_grad; nothing decoded
    is differentiated) and torch's own CPU kernels instead of oneDNN's. Decoding steps are a few
    thousand numbers per op, where oneDNN's fixed set-up per call (float32 exact GELU most of all)
    costs more than the work; `python -m blocklab.bench decode` measures the result."""
    # Saved and restored by hand: torch.backends.mkldnn.flags() also resets oneDNN's TF32 setting, with a warning.
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.backends.mkldnn.enabled = previous


def _stacked_streams(streams: list[dict[str, Tensor]], prompts: list[Tensor], width: int, max_new_tokens: int,
                     device) -> dict[str, Tensor]:
    """Each row's streams (prompt and new tokens) left-padded like its prompt: name -> (B, width + max_new_tokens)."""
    out = {}
    for name in streams[0]:
        stacked = torch.zeros(len(prompts), width + max_new_tokens, dtype=torch.long)
        for row, (prompt, stream) in enumerate(zip(prompts, streams)):
            needed = len(prompt) + max_new_tokens
            if len(stream[name]) < needed:
                raise ValueError(f"the {name} stream of row {row} covers {len(stream[name])} tokens; the prompt and "
                                 f"the new tokens need {needed}")
            stacked[row, width - len(prompt):] = stream[name][:needed]
        out[name] = stacked.to(device)
    return out


@decoding()
def generate(model, prompts: list[Tensor], max_new_tokens: int, eos_id: int | None = None, pad_id: int = 0,
             temperature: float = 0.0, top_k: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True, bos_id: int | None = None,
             streams: list[dict[str, Tensor]] | None = None, min_new_tokens: Tensor | None = None) -> Tensor:
    """Continue each prompt; returns the new tokens (B, <= max_new_tokens), `pad_id` after a row's EOS.
    temperature 0 is greedy. Rows of different lengths are left-padded with explicit positions,
    so each row is decoded exactly as it would be alone. An encoder-decoder model reads the
    prompts as its sources and starts the decoder from `bos_id`. `streams` (one dict per row, of
    position ids and/or digit indices over the prompt and the new tokens; tasks/placement.py) replace
    the positions 0, 1, 2 ... and feed a model's Abacus embeddings. `min_new_tokens` (B,): a row cannot end
    (write `eos_id`) before that many new tokens."""
    device = next(model.parameters()).device
    streams = streams if streams and streams[0] else None
    if model.is_encoder_decoder and streams is not None:
        raise ValueError("position streams are for decoder-only models")
    if model.is_encoder_decoder:
        source, source_valid = (t.to(device) for t in right_pad(prompts, pad_id))
        extra = {"source": source, "source_valid": source_valid}
        idx = torch.full((len(prompts), 1), bos_id, dtype=torch.long, device=device)
        valid = torch.ones_like(idx, dtype=torch.bool)
    else:
        extra = {}
        idx, valid = (t.to(device) for t in left_pad(prompts, pad_id))
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    width = idx.shape[1]
    ahead = {} if streams is None else _stacked_streams(streams, prompts, width, max_new_tokens, device)
    if "positions" in ahead:
        positions = ahead.pop("positions")
        positions, ahead_positions = positions[:, :width], positions[:, width:]
    else:
        ahead_positions = None
    extra.update({name: stream[:, :width] for name, stream in ahead.items()})
    cache = model.new_cache() if use_cache else None
    logits = model(idx, positions, valid, cache, **extra)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out = []
    for step in range(max_new_tokens):
        scores = logits[:, -1]
        if min_new_tokens is not None:
            early = (step < min_new_tokens.to(device))[:, None] & (torch.arange(scores.shape[-1], device=device) == eos_id)
            scores = scores.masked_fill(early, float("-inf"))
        token = _next_token(scores, temperature, top_k, generator)
        if eos_id is not None:  # without an EOS no row is ever done
            token = token.masked_fill(done, pad_id)
            done |= token == eos_id
        out.append(token)
        if step == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
            break
        column = slice(width + step, width + step + 1)  # the token just chosen
        next_positions = positions[:, -1:] + 1 if ahead_positions is None else ahead_positions[:, step:step + 1]
        if use_cache:
            new = {name: stream[:, column] for name, stream in ahead.items()}
            logits = model(token[:, None], None if ahead_positions is None else next_positions, cache=cache, **new)
        else:
            idx = torch.cat((idx, token[:, None]), dim=1)
            positions = torch.cat((positions, next_positions), dim=1)
            valid = torch.cat((valid, torch.ones_like(valid[:, :1])), dim=1)
            extra.update({name: stream[:, :width + step + 1] for name, stream in ahead.items()})
            logits = model(idx, positions, valid, **extra)
    return torch.stack(out, dim=1) if out else torch.empty(len(prompts), 0, dtype=torch.long, device=device)
