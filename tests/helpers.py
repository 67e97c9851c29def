"""Helpers more than one test file needs: one home each (fixtures live in conftest.py). Importable as `helpers`
(pyproject's pytest `pythonpath` puts tests/ on the path)."""
import contextlib
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch

from blocklab.errors import ConfigError

V = 20  # the model tests' vocabulary (variants.tiny_cfg's default)


def tokens(shape, seed: int = 1, vocab: int = V) -> torch.Tensor:
    """Token ids drawn from their own generator: the same ids whatever ran before."""
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- reference computations

def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """Attention weights written out: softmax over the last dim of `scores`, only over the keys `allowed`
    ((..., Tq, Tk) bool, broadcast; None: every key) and, if causal, no key after the query."""
    if causal:
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1)


def dense_attention(q, k, v, scale: float, allowed: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """softmax(scale q k^T) v over the allowed keys, dense: the definition every fast kernel is checked against.
    q (B, H, Tq, D); k, v (B, H_kv, Tk, D), each K/V head repeated for its group of H / H_kv query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return masked_softmax(q @ k.transpose(-1, -2) * scale, allowed, causal) @ v


@torch.no_grad()
def greedy_reference(model, prompt: torch.Tensor, steps: int, eos: int | None = None, min_new: int = 0):
    """Greedy decoding the slow way, to check generate() against: one prompt, no padding, no cache, the whole
    sequence recomputed every step; the EOS logit is -inf for the first `min_new` steps."""
    seq = prompt.clone()
    for step in range(steps):
        logits = model(seq[None])[0, -1].clone()
        if eos is not None and step < min_new:
            logits[eos] = float("-inf")
        seq = torch.cat((seq, logits.argmax()[None]))
    return seq[len(prompt):]


@torch.no_grad()
def assert_cached_steps_equal_full(model, idx: torch.Tensor, prefix: int, then: int = 0, tol: float = 1e-10,
                                   after_step=None):
    """Decoding with the model's cache: the first `prefix` tokens in one call (then `then` more in a second), then
    one token a call, gives the logits of one full forward pass. after_step(cache, t), if given, inspects the cache
    after token t."""
    full = model(idx)
    cache = model.new_cache()
    torch.testing.assert_close(model(idx[:, :prefix], cache=cache), full[:, :prefix], rtol=tol, atol=tol)
    if then:
        chunk = slice(prefix, prefix + then)
        torch.testing.assert_close(model(idx[:, chunk], cache=cache), full[:, chunk], rtol=tol, atol=tol)
    for t in range(prefix + then, idx.shape[1]):
        torch.testing.assert_close(model(idx[:, t:t + 1], cache=cache)[:, 0], full[:, t], rtol=tol, atol=tol)
        if after_step is not None:
            after_step(cache, t)
    return cache


# ------------------------------------------------------------------------------------------- bad input

def assert_refused_cli(proc: subprocess.CompletedProcess, message: str, *unwritten: Path) -> str:
    """The project's answer to bad input from the command line: exit 2 and ONE line on stderr that names the
    problem (`message` in it), before any of `unwritten` was made. Returns the line."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    for path in unwritten:
        assert not path.exists(), path
    return lines[0]


@contextlib.contextmanager
def refused(message: str, *unwritten: Path, error: type[Exception] = ConfigError):
    """The same in process: the body raises `error` whose text is one line with `message` in it, and none of
    `unwritten` exists afterwards. Yields pytest's ExceptionInfo."""
    with pytest.raises(error) as info:
        yield info
    text = str(info.value)
    assert len(text.splitlines()) == 1 and message in text, text
    for path in unwritten:
        assert not path.exists(), path


# ------------------------------------------------------------------------------------------- processes

def wait_until(condition, proc: subprocess.Popen | None = None, timeout: float = 300, every: float = 0.2) -> bool:
    """Poll `condition()` until it holds, `proc` has exited, or `timeout` seconds pass; whether it held. For a test
    that signals a run once it reached a point (a checkpoint written, a result recorded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        if condition():
            return True
        time.sleep(every)
    return bool(condition())


# ------------------------------------------------------------------------------------------- training

def loss_fell(results: dict, points: int = 5) -> bool:
    """Whether training lowered the loss: the mean of the last `points` of results.json's train_loss_curve (one
    point a step in a short run) below the mean of the first `points`, every point finite."""
    curve = [loss for _, loss in results["train_loss_curve"]]
    assert len(curve) >= 2 * points and all(map(math.isfinite, curve)), curve
    return sum(curve[-points:]) < sum(curve[:points])


def assert_learned_and_changed(results: dict, default: dict) -> None:
    """A run of an option: completed, its loss fell, and the option changed what was trained. Runs are
    deterministic (same seed, same metrics), so an option the model ignored would reproduce the loss curve of
    `default` (the same run without the option) bit for bit."""
    assert results["status"] == "completed", results.get("error")
    assert loss_fell(results), results["train_loss_curve"]
    assert results["train_loss_curve"] != default["train_loss_curve"], "the option left training as it was"
