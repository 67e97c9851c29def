"""Each task's reference levels (tasks/references.py, Task.references): chance and the bar at which it is learned,
checked against values computed by hand: copy's chance loss ln 17 (16 characters and EOS), addition's ln 11, MQAR's
chance accuracy 2/V, an add-one unigram and a Witten-Bell bigram on a four-token corpus; results.json records them."""
import math

import numpy as np
import pytest

from blocklab.results import LEARNED_THRESHOLD
from blocklab.tasks import AdditionTask, CopyTask, MQARTask
from blocklab.tasks.references import LEARNED_EXACT_MATCH, Level, References, bigram_loss, unigram_loss

SEQ = {"min_len": 1, "max_len": 8, "eval_lengths": None, "batch_size": 4, "eval_examples": 4, "eval_seed": 0,
       "seed": 0}


def test_copy_and_addition_state_chance_and_the_exact_match_bar():
    copy = CopyTask(**SEQ).references()  # the default alphabet: 16 characters, and EOS ends every answer
    assert copy.learned == (Level("learned", "exact_match", 0.9),)
    assert copy.lines == (Level("chance", "loss", pytest.approx(math.log(17))),)
    assert math.log(17) == pytest.approx(2.833, abs=1e-3)  # the plateau the issue names (ln 17 = 2.83)
    addition = AdditionTask(**{**SEQ, "max_len": 3}).references()  # digits 0-9 and EOS
    assert addition.lines[0].value == pytest.approx(math.log(11))
    assert LEARNED_EXACT_MATCH == LEARNED_THRESHOLD  # one bar for a run's warning and for a page


def test_mqar_chance_is_one_of_the_v_over_2_values():
    refs = MQARTask(vocab_size=256, seq_len=64, num_kv_pairs=4, eval_buckets=[[64, 4]], eval_examples=4,
                    batch_size=4, seed=0).references()
    assert refs.lines[0] == Level("chance", "token_acc", 2 / 256)
    assert refs.learned == (Level("learned", "token_acc", (1 + 2 / 256) / 2),)  # halfway from chance to perfect
    assert refs.learned[0].reached(0.51) and not refs.learned[0].reached(0.26)


def test_unigram_and_bigram_losses_by_hand():
    """train 0 1 0 1 0, validation 0 1, two tokens. Unigram, add-one: (3 + 1, 2 + 1) / 7, so the validation loss is
    -(ln 4/7 + ln 3/7) / 2. Bigram: c(0,1) = 2, c(0) = 2 as a context, T(0) = 1 distinct follower, so Witten-Bell
    gives P(1|0) = (2 + 1 x 3/7) / (2 + 1) = 17/21, and the loss over the one validation pair is -ln 17/21."""
    train, val = np.array([0, 1, 0, 1, 0]), np.array([0, 1])
    assert unigram_loss(train, val, 2) == pytest.approx(-(math.log(4 / 7) + math.log(3 / 7)) / 2)
    assert bigram_loss(train, val, 2) == pytest.approx(-math.log(17 / 21))
    # a context never seen in training falls back to the unigram: token 2 never starts a pair
    assert bigram_loss(train, np.array([2, 0]), 3) == pytest.approx(-math.log(4 / 8))


def test_a_loss_bar_is_cleared_below_it_and_the_record_round_trips():
    bigram = Level("bigram", "loss", 2.5)
    assert bigram.reached(2.4) and not bigram.reached(2.5) and not bigram.reached(2.6)
    refs = References((bigram,), (Level("chance", "loss", 5.8),))
    assert References.from_dict(refs.as_dict()) == refs
    for bad in (None, [], {"learned": [{"name": "x"}]}, {"learned": [{"name": "x", "metric": "loss", "value": "nan"}]}):
        assert References.from_dict(bad) is None
