"""exact_match_given_length (task.eval_given_length; Newman et al. 2020's oracle length): greedy decoding told
where the answer ends. A model that writes every answer right but never stops scores 0 exact and 1 given the
length; one that stops right after a wrong token scores 0 on both."""
import pytest
import torch
from torch import nn

from blocklab.errors import ConfigError
from blocklab.tasks import build_task


def copy_task(given=True):
    return build_task(dict(name="copy", alphabet="abcdef", min_len=2, max_len=6, eval_lengths=[3, 6],
                           batch_size=8, eval_examples=16, eval_seed=1, eval_given_length=given), 0)


class Copier(nn.Module):
    """Decodes by rule, with the KV cache's call pattern (the prompt, then one token a call): writes each
    prompt's characters back, then `after` (a token id, or None for the prompt's first character). `wrong`:
    (place, token) written instead of the character there."""

    is_encoder_decoder = False

    def __init__(self, vocab: int, after: int | None, wrong: tuple[int, int] | None = None):
        super().__init__()
        self.vocab, self.after, self.wrong = vocab, after, wrong
        self.anchor = nn.Parameter(torch.zeros(1))  # generate reads the device from the parameters

    def new_cache(self):
        return None

    def forward(self, idx, positions=None, valid=None, cache=None, **streams):
        if idx.shape[1] > 1:  # a teacher-forced batch or a left-padded prompt `x SEP`: start over
            self.chars = [row[v][:-1].tolist() if v is not None else row.tolist() for row, v in
                          zip(idx, valid if valid is not None else [None] * len(idx))]
            self.step = 0
        else:
            self.step += 1
        logits = torch.zeros(idx.shape[0], idx.shape[1], self.vocab)
        for row, chars in enumerate(self.chars):
            token = chars[self.step] if self.step < len(chars) else (chars[0] if self.after is None else self.after)
            if self.wrong and self.step == self.wrong[0]:
                token = self.wrong[1]
            logits[row, -1, token] = 1.0
        return logits


def test_answers_right_but_never_ended_score_zero_exact_and_one_given_the_length():
    task = copy_task()
    row = task.evaluate_length(Copier(task.vocab_size, after=None), 6)
    assert row["exact_match"] == 0.0 and row["exact_match_given_length"] == 1.0


def test_answers_ended_right_score_one_on_both():
    task = copy_task()
    row = task.evaluate_length(Copier(task.vocab_size, after=task.eos_id), 6)
    assert row["exact_match"] == 1.0 and row["exact_match_given_length"] == 1.0


def test_a_wrong_token_before_the_end_is_wrong_given_the_length_too():
    task = copy_task()
    row = task.evaluate_length(Copier(task.vocab_size, after=None, wrong=(1, task.ids["<sep>"])), 6)
    assert row["exact_match"] == 0.0 and row["exact_match_given_length"] == 0.0


def test_off_by_default_and_a_bad_value_is_a_one_line_error():
    assert "exact_match_given_length" not in copy_task(given=False).evaluate_length(
        Copier(copy_task().vocab_size, after=None), 3)
    with pytest.raises(ConfigError, match=r"task.eval_given_length='yes' must be true or false"):
        copy_task(given="yes")
