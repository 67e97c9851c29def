"""Language modelling: corpus loading, tokenizers, caching, training and extrapolation rows."""
import math
import random
import re
from collections import Counter

import pytest

from blocklab.errors import ConfigError
from blocklab.tasks import build_task
from blocklab.tasks import lm as lm_module
from blocklab.tasks.corpus import builtin_text_file
from blocklab.tasks.tokenizer import bpe_tokenizer, char_tokenizer
from blocklab.results import read_results
from conftest import run_in_process
from helpers import refused

UNSEEN = "naïve café — ✓ 東京 🙂\ttab\r\n"


def grammar_text(n_sentences=3000, seed=0) -> str:
    """A small corpus with structure a model can learn beyond unigram statistics."""
    rng = random.Random(seed)
    subjects, verbs, objects = ["the cat", "a dog", "my friend", "the king"], ["sees", "eats", "likes"], \
        ["the fish.", "a bone.", "the moon.", "bread."]
    return "\n".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}" for _ in range(n_sentences))


def lm_cfg(path, cache, **over):
    cfg = {"name": "lm", "data": {"path": str(path), "hub": None, "hub_config": None, "text_column": "text",
                                  "val_fraction": 0.1, "encoding_errors": "strict"},
           "tokenizer": {"type": "char", "vocab_size": None}, "block_size": 16, "batch_size": 8,
           "eval_multipliers": [1, 2, 4], "eval_max_tokens": 4096, "cache_dir": str(cache)}
    for key, value in over.items():
        section, _, field = key.partition("__")
        if field:
            cfg[section] = {**cfg[section], field: value}
        else:
            cfg[key] = value
    return cfg


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(grammar_text(), encoding="utf-8")
    return path


def test_char_tokenizer_round_trips_unseen_characters():
    tok = char_tokenizer("hello world\n")
    for text in ("hello", UNSEEN, ""):
        assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode("hello").ids) == 5  # one token per known character


def test_bpe_tokenizer_round_trips_and_merges():
    text = grammar_text(500)
    tok = bpe_tokenizer(text, 300)
    assert tok.get_vocab_size() == 300
    for sample in (text[:200], UNSEEN):
        assert tok.decode(tok.encode(sample).ids) == sample
    assert len(tok.encode(text[:200]).ids) < 200  # merges compress


def test_bpe_vocab_larger_than_corpus_supports_is_an_error():
    with pytest.raises(ConfigError, match=r"task.tokenizer.vocab_size=5000 is larger than this corpus supports"):
        bpe_tokenizer("abab abab", 5000)


def test_second_load_uses_the_cache_without_retraining(corpus, tmp_path, monkeypatch):
    first = build_task(lm_cfg(corpus, tmp_path / "cache"), 0)
    assert first.meta["cache_hit"] is False

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(lm_module, "train_tokenizer", no_training)
    second = build_task(lm_cfg(corpus, tmp_path / "cache"), 0)
    assert second.meta["cache_hit"] is True
    assert (second.train_ids == first.train_ids).all() and second.tok.to_str() == first.tok.to_str()
    with pytest.raises(AssertionError, match="trained again"):  # other settings: another cache entry
        build_task(lm_cfg(corpus, tmp_path / "cache", tokenizer__type="bpe", tokenizer__vocab_size=300), 0)


def test_split_is_the_tail_and_windows_do_not_overlap(corpus, tmp_path):
    task = build_task(lm_cfg(corpus, tmp_path / "cache"), 0)
    text = corpus.read_text()
    cut = int(len(text) * 0.9)
    assert task.tok.decode(task.val_ids.tolist()) == text[cut:]
    windows = task.windows(16)
    assert windows.shape[1] == 17 and (windows[1:, 0] == windows[:-1, -1]).all()
    batch = next(iter(task.train_batches()))
    assert (batch["input"][:, 1:] == batch["target"][:, :-1]).all() and batch["input"].shape == (8, 16)


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text(""), "is empty"),
    (lambda p: p.write_text("too short"), "too short for task.block_size=16"),
    (lambda p: p.write_bytes(b"valid text \xff\xfe broken " * 50), "not valid UTF-8"),
])
def test_bad_data_is_a_one_line_error(setup, message, tmp_path):
    path = tmp_path / "data.txt"
    setup(path)
    with refused("task.") as err:
        build_task(lm_cfg(path, tmp_path / "cache"), 0)
    assert re.search(message, str(err.value)), str(err.value)


def test_non_utf8_can_be_replaced(tmp_path):
    path = tmp_path / "data.txt"
    path.write_bytes(b"valid text \xff broken " * 50)
    task = build_task(lm_cfg(path, tmp_path / "cache", data__encoding_errors="replace"), 0)
    assert "\ufffd" in task.tok.decode(task.train_ids[:40].tolist())


def test_folder_of_text_files(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(grammar_text(300, seed=i))
    task = build_task(lm_cfg(folder, tmp_path / "cache"), 0)
    assert len(task.train_ids) > 3 * 300 * 10 * 0.8


def test_hub_offline_fails_fast_with_advice(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr("blocklab.tasks.corpus.reachable", lambda host, timeout=3.0: False)
    cfg = lm_cfg(tmp_path, tmp_path / "cache", data__path=None, data__hub="Salesforce/wikitext",
                 data__hub_config="wikitext-2-raw-v1")
    with pytest.raises(ConfigError, match=r"hub is unreachable.*task.data.path=FILE"):
        build_task(cfg, 0)


def test_builtin_corpus_is_shakespeare_plain_text(tmp_path):
    text = builtin_text_file(tmp_path).read_text(encoding="utf-8")
    assert len(text) > 3_000_000
    assert "HAMLET:\n" in text and "To be, or not to be" in text
    assert "**" not in text and "\n#" not in text  # markdown removed


def unigram_entropy_nats(ids) -> float:
    counts = Counter(ids.tolist())
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def test_lm_trains_below_unigram_entropy_with_extrapolation_rows(corpus, tmp_path):
    run_dir = tmp_path / "run"
    run_in_process(["task=lm", "logger=none", f"task.data.path={corpus}", f"task.cache_dir={tmp_path / 'cache'}",
                    "task.block_size=32", "task.eval_max_tokens=8192", "trainer.max_steps=150",
                    "trainer.val_check_interval=75"], run_dir)
    results = read_results(run_dir)
    task = build_task(lm_cfg(corpus, tmp_path / "cache", block_size=32), 0)
    assert results["final_val_loss"] < unigram_entropy_nats(task.val_ids) - 0.5
    rows = results["eval"]
    assert [r["length"] for r in rows] == [32, 64, 128, 256]
    assert [r["in_distribution"] for r in rows] == [True, False, False, False]
    first = rows[0]
    assert first["perplexity"] == pytest.approx(math.exp(first["loss"]))
    assert first["bits_per_char"] == pytest.approx(first["loss"] / math.log(2), rel=0.01)  # ~1 token per char
    assert (run_dir / "tokenizer.json").exists()


def test_default_lm_runs_on_the_builtin_corpus(tmp_path):
    run_in_process(["trainer=debug", "logger=none", "task=lm", f"task.cache_dir={tmp_path / 'cache'}", "task.eval_max_tokens=2048"],
                   tmp_path / "run")
    results = read_results(tmp_path / "run")
    assert results["status"] == "completed" and results["task"] == "lm"
    assert len(results["eval"]) == 4


def test_char_tokenizer_without_byte_fallback_is_nanogpt_sized():
    tok = char_tokenizer("hello world\n", byte_fallback=False)
    assert tok.get_vocab_size() == len(set("hello world\n")) + 1  # + <unk>
    assert tok.decode(tok.encode("hello").ids) == "hello"
    assert tok.encode("hé").tokens == ["h", "<unk>"]
