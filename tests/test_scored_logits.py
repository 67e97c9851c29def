"""The training step computes the output layer only at the positions its loss reads (target not IGNORE: MQAR's
queries, copy's and addition's answers, MLM's masked tokens). On the same weights and batch, the loss, its per-token
values and the gradients equal those of the full-logits path it replaced (logits at every position, cross-entropy with
ignore_index); the plain forward still gives logits everywhere; a model without `at` (a plugin architecture) trains
as before; MQAR's evaluation scores the same either way."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blocklab.experiment import Setup
from blocklab.tasks.base import IGNORE, model_inputs
from blocklab.train.module import LitTransformer
from conftest import compose_config

SMALL = ["logger=none", "diagnostics=none", "model.d_model=32", "task.batch_size=8"]
TASKS = {
    "mqar": ["task=mqar", "task.vocab_size=512", "task.eval_examples=16"],
    "copy": ["task=copy"],
    "addition": ["task=addition"],
    "copy seq2seq": ["task=copy", "model.arch=encoder_decoder"],
    "mlm": ["task=mlm", "task.block_size=32"],
}


def setup_and_lit(overrides: list[str]):
    setup = Setup.from_config(compose_config([*SMALL, *overrides]))
    torch.manual_seed(0)
    return setup, LitTransformer(setup.model_cfg, setup.config["optim"]).double()


def full_logits_loss(lit, batch, reduction="mean"):
    """The loss as the step computed it before: logits at every position, the unscored ones ignored."""
    logits = lit.model(batch["input"], **model_inputs(batch))
    return F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=IGNORE, reduction=reduction)


def gradients(lit, loss):
    lit.model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in lit.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(TASKS))
def test_the_loss_at_the_scored_positions_equals_the_full_logits_loss(name):
    setup, lit = setup_and_lit(TASKS[name])
    batch = next(iter(setup.task.train_batches(0)))
    scored = batch["target"] != IGNORE
    assert 0 < int(scored.sum()) < scored.numel()  # a masked loss: some positions read, not all
    if "mlm" in name:
        batch.pop("is_next", None)
    old, new = full_logits_loss(lit, batch), lit.batch_loss(batch)
    torch.testing.assert_close(new, old, rtol=1e-12, atol=1e-12)
    old_grads, new_grads = gradients(lit, full_logits_loss(lit, batch)), gradients(lit, lit.batch_loss(batch))
    assert old_grads.keys() == new_grads.keys()
    for key in old_grads:
        torch.testing.assert_close(new_grads[key], old_grads[key], rtol=1e-10, atol=1e-12)
    # validation: the per-token losses of the scored positions, summed as validation_step sums them
    with torch.no_grad():
        torch.testing.assert_close(lit.batch_loss(batch, reduction="none").sum(),
                                   full_logits_loss(lit, batch, reduction="none").sum(), rtol=1e-12, atol=1e-12)


def test_float32_loss_matches_to_float_tolerance_at_the_default_mqar_vocabulary():
    setup = Setup.from_config(compose_config(["logger=none", "diagnostics=none", "task=mqar", "task.batch_size=8"]))
    torch.manual_seed(0)
    lit = LitTransformer(setup.model_cfg, setup.config["optim"])
    batch = next(iter(setup.task.train_batches(0)))
    assert setup.task.vocab_size == 8192
    torch.testing.assert_close(lit.batch_loss(batch), full_logits_loss(lit, batch), rtol=1e-6, atol=1e-6)


def test_the_plain_forward_gives_logits_everywhere_and_at_picks_rows():
    setup, lit = setup_and_lit(TASKS["mqar"])
    batch = next(iter(setup.task.train_batches(0)))
    full = lit.model(batch["input"])
    assert full.shape == (*batch["input"].shape, setup.task.vocab_size)
    at = torch.tensor([0, 5, 17, batch["input"].numel() - 1])
    torch.testing.assert_close(lit.model(batch["input"], at=at), full.flatten(0, 1)[at])


def test_a_language_model_batch_is_scored_everywhere_by_the_plain_forward(monkeypatch):
    """Every position scored (task=lm): nothing to select, so the forward is called without `at`."""
    setup, lit = setup_and_lit(["task=lm", "task.block_size=16"])
    batch = next(iter(setup.task.train_batches(0)))
    seen = []
    forward = lit.model.forward
    monkeypatch.setattr(lit.model, "forward", lambda *a, **k: seen.append("at" in k) or forward(*a, **k))
    torch.testing.assert_close(lit.batch_loss(batch), full_logits_loss(lit, batch))
    assert seen[0] is False


class NoAt(nn.Module):
    """A model without `at` (as a plugin architecture may be): logits at every position."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, idx, **kwargs):
        assert "at" not in kwargs
        return self.inner(idx, **kwargs)


def test_a_model_without_at_is_scored_from_its_full_logits():
    setup, lit = setup_and_lit(TASKS["copy"])
    batch = next(iter(setup.task.train_batches(0)))
    expected = lit.batch_loss(batch)
    lit.model = NoAt(lit.model)
    torch.testing.assert_close(lit.batch_loss(batch), expected)


def test_mqar_evaluation_is_the_same_with_and_without_at():
    setup, lit = setup_and_lit(TASKS["mqar"])
    rows, plain = setup.task.evaluate(lit.model), setup.task.evaluate(NoAt(lit.model))
    for row, other in zip(rows, plain, strict=True):
        assert row.keys() == other.keys()
        for key in row:
            assert row[key] == pytest.approx(other[key], rel=1e-12), key
