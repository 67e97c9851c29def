"""Tokenizers for language modelling, built with HF `tokenizers`.

char: one token per character seen in the training text, plus 256 byte tokens as a fallback,
      so an unseen character is encoded as its UTF-8 bytes and never dropped (byte_fallback=false:
      one <unk> token instead, nanoGPT's vocabulary).
bpe:  byte-level BPE trained on the training text; its base alphabet is all 256 bytes."""
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from blocklab.errors import ConfigError

BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
UNK = "<unk>"
TOKENIZER_TYPES = ("char", "bpe")


def char_tokenizer(text: str, byte_fallback: bool = True) -> Tokenizer:
    """Without byte fallback (nanoGPT's vocabulary) an unseen character becomes <unk>: smaller
    output layer, no exact round trip."""
    chars = sorted(set(text))
    vocab = {ch: i for i, ch in enumerate(chars)}
    extra = BYTE_TOKENS if byte_fallback else [UNK]
    vocab.update({tok: len(chars) + i for i, tok in enumerate(extra)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=byte_fallback,
                               unk_token=None if byte_fallback else UNK))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tok


def bpe_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    chunk = 1 << 16
    tok.train_from_iterator((text[i:i + chunk] for i in range(0, len(text), chunk)), trainer)
    if tok.get_vocab_size() < vocab_size:
        raise ConfigError(f"task.tokenizer.vocab_size={vocab_size} is larger than this corpus supports "
                          f"(BPE stopped at {tok.get_vocab_size()} tokens); lower it")
    return tok


def train_tokenizer(cfg: dict, text: str) -> Tokenizer:
    if cfg["type"] == "char":
        return char_tokenizer(text, cfg.get("byte_fallback", True))
    return bpe_tokenizer(text, cfg["vocab_size"])


def tokenizer_errors(cfg: dict) -> list[str]:
    kind, size = cfg.get("type"), cfg.get("vocab_size")
    if kind not in TOKENIZER_TYPES:
        return [f"task.tokenizer.type={kind!r} is unknown; use one of {list(TOKENIZER_TYPES)}"]
    if kind == "bpe" and (not isinstance(size, int) or size <= 256):
        return [f"task.tokenizer.vocab_size={size!r}: byte-level BPE needs an integer above 256 (the byte alphabet)"]
    return []
