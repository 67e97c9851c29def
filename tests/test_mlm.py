"""Encoder-only models and masked LM (BERT, Devlin et al. 2019): the 15% / 80-10-10 masking recipe, loss and
accuracy on the selected positions only, bidirectional attention, batches fixed per (seed, step), one-line
errors, and a run end to end; next-sentence prediction (task.nsp): the pair layout, special tokens never
masked, the classifier's loss added to the masked-LM loss."""
import math
import random
import re

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import binomtest, chisquare
from torch import nn

from blocklab.errors import ConfigError
from blocklab.experiment import Setup
from blocklab.model import ModelConfig, build_model
from blocklab.model.config import AttnConfig, PosConfig
from blocklab.results import read_results
from blocklab.tasks import build_task, task_errors
from blocklab.tasks.base import IGNORE
from blocklab.tasks.mlm import MASK, SentencePairs, mask_tokens, sentence_pairs
from blocklab.train.module import LitTransformer
from conftest import compose_config, run_in_process
from helpers import refused


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    words = ["the cat", "a dog", "my friend", "the king", "sees", "eats", "likes", "the fish.", "a bone.", "bread."]
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(3)) for _ in range(2000)))
    return path


def task_cfg(corpus, cache, name="mlm", **over):
    cfg = {"name": name, "data": {"path": str(corpus), "hub": None, "hub_config": None, "text_column": "text",
                                  "val_fraction": 0.1, "encoding_errors": "strict"},
           "tokenizer": {"type": "char", "vocab_size": None}, "block_size": 32, "batch_size": 16,
           "eval_multipliers": [1, 2, 4], "eval_max_tokens": 4096, "cache_dir": str(cache)}
    if name == "mlm":
        cfg.update(mask_prob=0.15, mask_token_prob=0.8, random_token_prob=0.1, eval_seed=1234)
    return {**cfg, **over}


@pytest.fixture(scope="module")
def tasks(corpus, tmp_path_factory):
    """The MLM task and the LM task over the same corpus, whose windows the MLM task masks."""
    cache = tmp_path_factory.mktemp("cache")
    return build_task(task_cfg(corpus, cache), 0), build_task(task_cfg(corpus, cache, name="lm"), 0)


# ------------------------------------------------------------------ the masking recipe


def test_masking_proportions_over_many_samples():
    """15% of each sequence selected; of those, 80% [MASK], 10% a random token, 10% unchanged (Devlin et al.)."""
    vocab, mask_id, length = 50, 50, 40
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (5000, length), generator=generator)
    inputs, target = mask_tokens(tokens, generator, mask_id, vocab, 0.15, 0.8, 0.1)
    selected = target != IGNORE
    assert (selected.sum(1) == round(0.15 * length)).all()  # 6 of 40 in every row
    assert torch.equal(target[selected], tokens[selected])  # the originals are the targets
    assert torch.equal(inputs[~selected], tokens[~selected])  # nothing else is touched
    n = int(selected.sum())
    masked = inputs[selected] == mask_id
    unchanged = inputs[selected] == tokens[selected]
    replaced = ~masked & ~unchanged
    # A random replacement equals the original with probability 1/vocab: it then counts as unchanged.
    for count, p in ((masked, 0.8), (replaced, 0.1 * (1 - 1 / vocab)), (unchanged, 0.1 + 0.1 / vocab)):
        assert binomtest(int(count.sum()), n, p).pvalue > 1e-3
    # Random tokens are uniform over the vocabulary, never [MASK].
    random_ids = inputs[selected][~masked & ~unchanged]
    assert int(random_ids.max()) < vocab
    assert chisquare(torch.bincount(random_ids, minlength=vocab).numpy()).pvalue > 1e-3
    # Which positions are selected is uniform over the sequence.
    assert chisquare(selected.sum(0).numpy()).pvalue > 1e-3


def test_every_sequence_has_a_target_and_settings_are_honoured():
    tokens = torch.arange(10).repeat(4000, 1)
    generator = torch.Generator().manual_seed(1)
    _, target = mask_tokens(tokens[:, :3], generator, 99, 10, 0.15, 0.8, 0.1)
    assert ((target != IGNORE).sum(1) == 1).all()  # round(0.45) = 0: still one per row, as BERT's max(1, ...)
    inputs, target = mask_tokens(tokens, generator, 99, 10, 0.5, 0.0, 1.0)
    selected = target != IGNORE
    assert (selected.sum(1) == 5).all() and not (inputs == 99).any()  # all replaced by random tokens
    inputs, _ = mask_tokens(tokens, generator, 99, 10, 0.3, 1.0, 0.0)
    assert ((inputs == 99).sum(1) == 3).all()


def test_the_task_masks_lm_windows_with_a_mask_token_of_its_own(tasks):
    mlm, lm = tasks
    assert mlm.vocab_size == lm.vocab_size + 1 and mlm.mask_id == lm.vocab_size
    assert mlm.tokenizer().token_to_id(MASK) == mlm.mask_id and lm.tokenizer().token_to_id(MASK) is None
    for masked, plain, _ in zip(mlm.train_batches(), lm.train_batches(), range(20)):
        window = plain["input"]  # the same window of text at the same step
        selected = masked["target"] != IGNORE
        assert (selected.sum(1) == round(0.15 * mlm.block_size)).all()
        assert torch.equal(masked["target"][selected], window[selected])
        assert torch.equal(masked["input"][~selected], window[~selected])
        assert (masked["input"][selected] == mlm.mask_id).any()
    for batch in [*mlm.validation_batches(), mlm.probe_batch(4)]:
        selected = batch["target"] != IGNORE
        assert (selected.sum(1) == round(0.15 * batch["input"].shape[1])).all()


def test_batches_are_fixed_per_seed_and_step(corpus, tasks, tmp_path):
    """Batch k is a pure function of (seed, k), so a resumed run sees what an uninterrupted one would; the
    evaluation masks depend on eval_seed only."""
    mlm, _ = tasks
    stream = iter(mlm.train_batches())
    batches = [next(stream) for _ in range(5)]
    resumed = next(iter(mlm.train_batches(start_step=3)))
    assert all(torch.equal(resumed[k], batches[3][k]) for k in ("input", "target"))
    assert not torch.equal(batches[3]["target"], batches[4]["target"])
    other_seed = build_task(task_cfg(corpus, tmp_path / "cache"), 1)
    assert not torch.equal(next(iter(other_seed.train_batches()))["target"], batches[0]["target"])
    for a, b in zip(mlm.validation_batches(), other_seed.validation_batches()):
        assert torch.equal(a["input"], b["input"]) and torch.equal(a["target"], b["target"])
    other_eval = build_task(task_cfg(corpus, tmp_path / "cache", eval_seed=7), 0)
    assert not torch.equal(other_eval.validation_batches()[0]["target"], mlm.validation_batches()[0]["target"])


# ------------------------------------------------------------------ loss and metrics on selected positions only


class EchoInput(nn.Module):
    """Predicts, with confidence `scale`, that each position holds the token it was given: right everywhere the
    input is the original token, wrong at [MASK] and at random replacements."""

    def __init__(self, vocab: int, scale: float = 20.0):
        super().__init__()
        self.vocab, self.scale, self.dummy = vocab, scale, nn.Parameter(torch.zeros(()))

    def forward(self, idx, **kwargs):
        return F.one_hot(idx, self.vocab).float() * self.scale


def test_loss_and_accuracy_cover_the_selected_positions_only(tasks):
    mlm, _ = tasks
    echo = EchoInput(mlm.vocab_size)
    # Right at every unselected position and at the ~10% selected ones left unchanged; wrong at the rest.
    wrong = math.log1p((mlm.vocab_size - 1) * math.exp(-20.0)) + 20.0  # CE of a confident wrong guess
    right = math.log1p((mlm.vocab_size - 1) * math.exp(-20.0))
    for row in mlm.evaluate(echo):
        acc = row["token_acc"]
        assert 0.06 < acc < 0.16  # 10% unchanged + 10%/vocab random hits, over ~500-1000 selected tokens
        assert row["masked_tokens"] == row["n"] * round(0.15 * row["length"])
        # Over every position the loss would be ~0.15 of this, the accuracy ~0.87.
        assert row["loss"] == pytest.approx(acc * right + (1 - acc) * wrong, rel=1e-4)
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
    # The training loss the module minimizes is the same selected-only mean.
    lit = LitTransformer(ModelConfig(arch="encoder", vocab_size=mlm.vocab_size), {})
    lit.model = echo
    batch = next(iter(mlm.train_batches()))
    selected = batch["target"] != IGNORE
    acc = float((batch["input"][selected] == batch["target"][selected]).float().mean())
    assert float(lit.batch_loss(batch)) == pytest.approx(acc * right + (1 - acc) * wrong, rel=1e-4)


def test_an_oracle_scores_perfectly_and_rows_follow_the_lm_lengths(tasks):
    mlm, lm = tasks

    class Oracle(EchoInput):
        """Knows the original text: evaluation reads the LM task's windows of each length, in order."""

        def forward(self, idx, **kwargs):
            windows = self.windows.setdefault(idx.shape[1], iter(lm._batches(idx.shape[1])))
            return F.one_hot(next(windows)["input"], self.vocab).float() * self.scale

    oracle = Oracle(mlm.vocab_size)
    oracle.windows = {}
    rows = mlm.evaluate(oracle)
    assert [r["length"] for r in rows] == [32, 64, 128] and [r["multiplier"] for r in rows] == [1, 2, 4]
    assert [r["in_distribution"] for r in rows] == [True, False, False]
    assert all(r["token_acc"] == 1.0 and r["loss"] < 1e-6 and r["exact_match"] is None for r in rows)


# ------------------------------------------------------------------ the encoder is bidirectional


@pytest.mark.parametrize("pos, attn", [("rope", {}), ("learned", {}), ("alibi", {}), ("t5_bias", {}),
                                       ("sinusoidal", {"kind": "linear"}), ("rope", {"n_kv_heads": 1})])
def test_encoder_attention_is_not_causal(pos, attn):
    """Changing the last token changes the first position's output (a causal model's would not move), and
    every query gives weight to later keys."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch="encoder", vocab_size=20, d_model=32, n_heads=4, n_layers=2, max_len=16,
                      pos=PosConfig(name=pos), attn=AttnConfig(causal=True, **attn))  # causal=true is overridden
    assert cfg.errors() == []
    encoder, decoder = build_model(cfg).eval(), build_model(ModelConfig(**{**vars(cfg), "arch": "decoder"})).eval()
    assert encoder.is_encoder_only and not encoder.cfg.attn.causal and not encoder.generates
    idx = torch.randint(19, (3, 12))
    changed = idx.clone()
    changed[:, -1] = 19
    with torch.no_grad():
        delta = (encoder(idx) - encoder(changed))[:, :-1].abs().amax(dim=(0, 2))
        causal_delta = (decoder(idx) - decoder(changed))[:, :-1].abs().max()
    assert (delta > 1e-5).all()  # every earlier position sees the last token
    assert causal_delta < 1e-5  # the same stack, causal, does not
    if not attn:  # softmax attention: the weights themselves
        _, weights = encoder(idx, need_weights=True)
        later = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)
        assert all((w[..., later] > 0).all() for w in weights)


# ------------------------------------------------------------------ bad input, one line, before any work


def test_mlm_on_a_causal_decoder_is_a_one_line_error(run_dir):
    for arch in ("decoder", "encoder_decoder"):
        with pytest.raises(ConfigError) as err:
            run_in_process(["task=mlm", f"model.arch={arch}", "trainer=debug", "logger=none"], run_dir)
        assert str(err.value) == ("task=mlm predicts masked tokens from both sides, which needs a bidirectional "
                                  "encoder-only model: use model.arch=encoder")
        assert not run_dir.exists()


def test_an_encoder_on_a_next_token_task_is_a_one_line_error(run_dir):
    with pytest.raises(ConfigError) as err:
        run_in_process(["model.arch=encoder", "task=copy", "trainer=debug", "logger=none"], run_dir)
    assert str(err.value) == ("model.arch=encoder is bidirectional, so every position sees the token task=copy asks "
                              "it to predict next; use a masked task (mlm) or model.arch=decoder")
    assert not run_dir.exists()
    assert task_errors({"name": "lm"}, encoder_only=True)[0].startswith("model.arch=encoder is bidirectional")


@pytest.mark.parametrize("override, message", [
    ("task.mask_prob=1.5", "task.mask_prob=1.5 must be a number in [0, 1]"),
    ("task.mask_prob=0", "task.mask_prob=0 selects no token to predict"),
    ("task.random_token_prob=-0.1", "task.random_token_prob=-0.1 must be a number in [0, 1]"),
    ("task.mask_token_prob=0.95", "task.mask_token_prob + task.random_token_prob = 1.05 > 1"),
    ("task.eval_seed=x", "task.eval_seed='x' must be a number"),
    ("task.eval_seed=1.5", "task.eval_seed=1.5 must be an integer"),
    ("+task.mask_rate=0.2", "task.mask_rate is not an option of task.name=mlm; did you mean task.mask_prob?"),
])
def test_bad_masking_options_are_one_line_errors(override, message, run_dir):
    with refused(message, run_dir) as err:
        Setup.from_config(compose_config(["task=mlm", override], run_dir))
    assert str(err.value).startswith(message)


def test_task_mlm_picks_the_encoder():
    cfg = compose_config(["task=mlm"])
    assert cfg.model.arch == "encoder" and cfg.attn.causal is False and cfg.task.block_size == 64


# ------------------------------------------------------------------ end to end


def test_mlm_runs_end_to_end(corpus, run_dir, tmp_path, capsys):
    run_in_process(["model.arch=encoder", "task=mlm", "trainer=debug", "logger=none", f"task.data.path={corpus}",
                    f"task.cache_dir={tmp_path / 'cache'}", "task.eval_max_tokens=4096"], run_dir)
    results = read_results(run_dir)
    assert results["status"] == "completed" and results["task"] == "mlm"
    rows = results["eval"]
    assert [(r["length"], r["multiplier"], r["in_distribution"]) for r in rows] == \
        [(64, 1, True), (128, 2, False), (256, 4, False), (512, 8, False)]
    for row in rows:
        assert 0 <= row["token_acc"] <= 1 and row["masked_tokens"] > 0
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
    assert results["final_val_loss"] == rows[0]["loss"]
    assert results["decode"] == {"kv_cache_bytes_per_token": None, "tokens_per_s": None}
    setup = Setup.from_run_dir(run_dir, with_task=True)
    assert setup.saved_tokenizer().token_to_id(MASK) == setup.task.mask_id
    assert setup.trained_model().is_encoder_only
    from blocklab.generate import main as generate_main
    with pytest.raises(SystemExit) as refused:
        generate_main([str(run_dir), "--prompt", "ab"])
    assert refused.value.code == 2
    assert re.search("model.arch=encoder, which fills in masked tokens.*model.arch=decoder", capsys.readouterr().err)


@pytest.mark.slow
def test_mlm_learns_from_both_sides(corpus, run_dir, tmp_path):
    """Masked characters of a small grammar are predictable from their neighbours: the trained encoder's masked
    accuracy beats predicting the commonest character by far."""
    run_in_process(["task=mlm", "logger=none", f"task.data.path={corpus}", f"task.cache_dir={tmp_path / 'cache'}",
                    "task.block_size=32", "task.eval_max_tokens=8192", "trainer.max_steps=300",
                    "trainer.val_check_interval=150", "diagnostics=none"], run_dir)
    results = read_results(run_dir)
    text = corpus.read_text()
    commonest = max(text.count(ch) for ch in set(text)) / len(text)
    assert results["eval"][0]["token_acc"] > commonest + 0.3


# ------------------------------------------------------------------ next-sentence prediction (task.nsp)

CLS_ID, SEP_ID = 98, 99


def test_sentence_pairs_follow_berts_layout():
    """[CLS] A [SEP] B [SEP]: A is a prefix of the window, B its continuation (is_next) or the same-length tail
    of another span; segment 0 through the first [SEP], 1 after; continuations in half the pairs."""
    generator = torch.Generator().manual_seed(0)
    rows, n = 4000, 9
    first = torch.randint(0, 40, (rows, n), generator=generator)
    other = torch.randint(40, 80, (rows, n), generator=generator)  # told apart from `first` by value
    pair = sentence_pairs(first, other, generator, CLS_ID, SEP_ID)
    assert pair["input"].shape == pair["segment"].shape == pair["special"].shape == (rows, n + 3)
    splits = set()
    for i in range(rows):
        ids = pair["input"][i].tolist()
        seps = [j for j, t in enumerate(ids) if t == SEP_ID]
        assert ids[0] == CLS_ID and len(seps) == 2 and seps[1] == n + 2
        s = seps[0] - 1  # A's length
        splits.add(s)
        second = first[i] if pair["is_next"][i] else other[i]
        assert ids[1:s + 1] == first[i, :s].tolist() and ids[s + 2:n + 2] == second[s:].tolist()
        assert pair["segment"][i].tolist() == [0] * (s + 2) + [1] * (n + 1 - s)
        assert pair["special"][i].nonzero().flatten().tolist() == [0, s + 1, n + 2]
    assert splits == set(range(1, n))  # every split point of [1, n-1] occurs
    assert binomtest(int(pair["is_next"].sum()), rows, 0.5).pvalue > 1e-3


def test_special_tokens_are_never_masked():
    """Selection draws from the maskable positions only, 15% of them per row."""
    generator = torch.Generator().manual_seed(1)
    pair = sentence_pairs(torch.randint(0, 40, (500, 37)), torch.randint(0, 40, (500, 37)), generator, CLS_ID, SEP_ID)
    inputs, target = mask_tokens(pair["input"], generator, 97, 40, 0.15, 0.8, 0.1, ~pair["special"])
    selected = target != IGNORE
    assert not (selected & pair["special"]).any()
    assert (inputs[pair["special"]] == pair["input"][pair["special"]]).all()  # [CLS] and [SEP] stay
    assert selected.sum(dim=1).tolist() == [round(0.15 * 37)] * 500


def test_without_maskable_positions_masking_is_unchanged():
    """The option leaves plain masked LM bit for bit as it was: every position maskable is the same draw."""
    tokens = torch.randint(0, 40, (64, 30))
    plain = mask_tokens(tokens, torch.Generator().manual_seed(3), 97, 40, 0.15, 0.8, 0.1)
    everything = mask_tokens(tokens, torch.Generator().manual_seed(3), 97, 40, 0.15, 0.8, 0.1,
                             torch.ones_like(tokens, dtype=torch.bool))
    assert all(torch.equal(a, b) for a, b in zip(plain, everything))


@pytest.fixture(scope="module")
def nsp_task(corpus, tmp_path_factory):
    return build_task(task_cfg(corpus, tmp_path_factory.mktemp("nsp_cache"), nsp=True), 0)


def test_pair_batches_are_fixed_per_seed_and_step(nsp_task):
    """Batch k is a function of (seed, k): a resume from step 3 sees the batches an uninterrupted run sees."""
    straight, resumed = iter(SentencePairs(nsp_task, 0)), iter(SentencePairs(nsp_task, 3))
    batches = [next(straight) for _ in range(5)]
    for expected in batches[3:]:
        got = next(resumed)
        assert all(torch.equal(got[key], expected[key]) for key in expected)
    batch = batches[0]
    assert batch["input"].shape == (16, 32) and (batch["input"][:, 0] == nsp_task.cls_id).all()
    assert nsp_task.vocab_size == nsp_task.n_corpus_tokens + 3 and nsp_task.segments == 2
    assert not torch.equal(batches[0]["input"], batches[1]["input"])


def nsp_model(task, **over) -> LitTransformer:
    cfg = ModelConfig(arch="encoder", vocab_size=task.vocab_size, d_model=32, n_heads=2, max_len=256,
                      segments=task.segments, attn=AttnConfig(causal=False), **over)
    return LitTransformer(cfg, {"lr": 1e-3, "min_lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                "warmup_steps": 0})


def test_the_loss_trained_on_is_masked_lm_plus_the_pair_cross_entropy(nsp_task):
    torch.manual_seed(0)
    lit = nsp_model(nsp_task)
    batch = next(iter(SentencePairs(nsp_task, 0)))
    token_loss, pair_loss, _ = lit.losses(batch)
    logits, sentence = lit.model(batch["input"], segment=batch["segment"], sentence=True)
    assert sentence.shape == (16, 2)
    assert torch.allclose(token_loss, F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(),
                                                      ignore_index=IGNORE))
    assert torch.allclose(pair_loss, F.cross_entropy(sentence, batch["is_next"].long()))
    # The segment ids reach the model: the same tokens read as one sentence give other outputs.
    assert not torch.allclose(lit.model(batch["input"], segment=torch.zeros_like(batch["segment"])), logits)


def test_next_sentence_gradient_matches_finite_differences(nsp_task):
    """The pair classifier's loss, through the segment embedding, against central differences (float64)."""
    torch.manual_seed(0)
    lit = nsp_model(nsp_task).double()
    batch = {k: v[:4] for k, v in next(iter(SentencePairs(nsp_task, 0))).items()}
    weight = lit.model.segment_emb.weight
    loss = lit.losses(batch)[1]
    grad, = torch.autograd.grad(loss, weight)
    eps = 1e-6
    for index in [(0, 0), (1, 5), (1, 31)]:
        with torch.no_grad():
            weight[index] += eps
            up = lit.losses(batch)[1].item()
            weight[index] -= 2 * eps
            down = lit.losses(batch)[1].item()
            weight[index] += eps
        assert grad[index].item() == pytest.approx((up - down) / (2 * eps), rel=1e-4, abs=1e-9)


def test_without_the_pair_loss_the_same_pairs_train_the_masked_lm_alone(corpus, nsp_task, tmp_path):
    """task.nsp_loss=false: the batches are nsp=true's pairs, token for token, with nothing for the classifier
    (no is_next), so the loss trained on is the masked-LM cross-entropy alone; the task states no pair bar."""
    plain = build_task(task_cfg(corpus, tmp_path / "cache", nsp=True, nsp_loss=False), 0)
    with_loss, without = next(iter(SentencePairs(nsp_task, 2))), next(iter(SentencePairs(plain, 2)))
    assert "is_next" in with_loss and "is_next" not in without
    assert all(torch.equal(with_loss[k], without[k]) for k in without)
    torch.manual_seed(0)
    lit = nsp_model(plain)
    token_loss, pair_loss, _ = lit.losses(without)
    logits = lit.model(without["input"], segment=without["segment"])
    assert pair_loss is None
    assert torch.allclose(token_loss, F.cross_entropy(logits.flatten(0, 1), without["target"].flatten(),
                                                      ignore_index=IGNORE))
    assert [x.metric for x in plain.references().learned] == ["loss"]
    assert all(x.metric != "next_sentence_acc" for x in plain.references().lines)


@pytest.mark.parametrize("override, message", [
    ("task.nsp=yes", "task.nsp='yes' must be true or false"),
    ("task.nsp_loss=1", "task.nsp_loss=1 must be true or false"),
    ("task.block_size=4", "task.nsp=true with task.block_size=4: a pair [CLS] A [SEP] B [SEP] needs at least 5"),
])
def test_bad_pair_options_are_one_line_errors(override, message, run_dir):
    with refused(message, run_dir) as err:
        Setup.from_config(compose_config(["task=mlm", "task.nsp=true", override], run_dir))
    assert str(err.value).startswith(message)


def test_the_pair_loss_off_needs_the_pairs(run_dir):
    message = "task.nsp_loss=false drops the classifier of task.nsp's sentence pairs"
    with refused(message, run_dir) as err:
        Setup.from_config(compose_config(["task=mlm", "task.nsp_loss=false"], run_dir))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("nsp_loss", [True, False])
def test_nsp_runs_end_to_end(corpus, run_dir, tmp_path, nsp_loss):
    run_in_process(["task=mlm", "task.nsp=true", f"task.nsp_loss={str(nsp_loss).lower()}", "trainer=debug",
                    "logger=none", f"task.data.path={corpus}", f"task.cache_dir={tmp_path / 'cache'}",
                    "task.eval_max_tokens=4096"], run_dir)
    results = read_results(run_dir)
    assert results["status"] == "completed"
    assert all(row["masked_tokens"] > 0 for row in results["eval"])
    if nsp_loss:
        assert all(0 <= row["next_sentence_acc"] <= 1 for row in results["eval"])
    else:  # no classifier trained, none scored
        assert all("next_sentence_acc" not in row for row in results["eval"])
    model = Setup.from_run_dir(run_dir).trained_model()
    assert model.cfg.segments == 2 and model.segment_emb is not None  # model.json and the checkpoint agree


def test_reference_levels_are_the_corpus_own_baselines(corpus, tasks, tmp_path):
    """The LM is learned below its corpus' bigram loss; the masked LM below the unigram's (a token guessed without
    its context), and with next-sentence prediction its pair classifier halfway from chance, 0.5, to perfect. The
    baselines' arithmetic is checked by hand in tests/test_references.py; here, that each task fits them on its own
    training split and scores them on its validation split."""
    from blocklab.tasks.references import Level, bigram_loss, unigram_loss

    mlm, lm = tasks
    bigram, unigram = bigram_loss(lm.train_ids, lm.val_ids, lm.vocab_size), unigram_loss(lm.train_ids, lm.val_ids, lm.vocab_size)
    assert lm.references().learned == (Level("bigram", "loss", bigram),)
    assert bigram < unigram < math.log(lm.vocab_size)  # the text has structure a bigram model catches
    assert mlm.references().learned == (Level("unigram", "loss", unigram_loss(mlm.train_ids, mlm.val_ids,
                                                                                 mlm.n_corpus_tokens)),)
    nsp = build_task(task_cfg(corpus, tmp_path / "cache", nsp=True), 0).references()
    assert nsp.learned[1] == Level("learned", "next_sentence_acc", 0.75)
    assert Level("chance", "next_sentence_acc", 0.5) in nsp.lines
