"""How much signal task.nsp's sentence pairs carry, measured without a Transformer (sweeps/mlm_nsp.yaml's notes).

The mlm task's pairs (tasks/mlm.py, sentence_pairs) split a window of block_size - 3 characters at a uniform point;
B is the rest of the window or a same-length span from elsewhere. A random B is itself real text, so the only cue is
at the join: does B's start continue A's end? A character n-gram model fit on the training split scores that join,

    score = log P(B's first k characters | A's last n-1 characters) - log P(the same | B's own characters only),

and calls a pair `is_next` when the score is above the median (half the pairs are). Its accuracy on unmasked
validation pairs is what local continuity alone can give; the Transformer sees the pairs with 15% of characters
masked. Witten-Bell interpolated n-grams (Chen & Goodman 1998, sec. 2.5), as tasks/references.py's bigram loss.

    OMP_NUM_THREADS=1 python scripts/nsp_ngram_oracle.py [pairs]      # a few seconds"""
import os
import sys
from collections import Counter

import numpy as np
import torch

from blocklab.tasks.mlm import random_spans, sentence_pairs


def ngram_model(ids: np.ndarray, order: int):
    """P(w | context) for contexts of up to order-1 tokens, Witten-Bell interpolated down to add-one unigrams."""
    ids = ids.tolist()
    vocab = max(ids) + 1
    uni = np.bincount(ids, minlength=vocab) + 1.0
    uni /= uni.sum()
    counts = [Counter(tuple(ids[i - n:i + 1]) for i in range(n, len(ids))) for n in range(1, order)]
    ctx = [Counter(tuple(ids[i - n:i]) for i in range(n, len(ids))) for n in range(1, order)]
    types = [Counter(key[:-1] for key in c) for c in counts]

    def prob(context: tuple, w: int) -> float:
        p = uni[w]
        for n in range(1, min(order - 1, len(context)) + 1):
            h = tuple(context[-n:])
            c, t = ctx[n - 1][h], types[n - 1][h]
            if c:
                p = (counts[n - 1][h + (w,)] + t * p) / (c + t)
        return p

    return prob


def main(pairs: int = 4000, order: int = 5, k: int = 4, block: int = 64) -> None:
    from blocklab.tasks.mlm import MLMTask
    task = MLMTask(data={"path": None, "hub": None, "hub_config": None, "text_column": "text", "val_fraction": 0.1,
                         "encoding_errors": "strict"},
                   tokenizer={"type": "char", "vocab_size": None, "byte_fallback": True}, block_size=block,
                   batch_size=32, eval_multipliers=[1], eval_max_tokens=65536,
                   cache_dir=os.environ.get("BLOCKLAB_CACHE", "~/.cache/blocklab"), seed=0, nsp=True)
    prob = ngram_model(task.train_ids, order)
    val = torch.from_numpy(task.val_ids.astype(np.int64))
    g = torch.Generator().manual_seed(0)
    first = random_spans(val, pairs, block - 3, g)
    pair = sentence_pairs(first, random_spans(val, pairs, block - 3, g), g, -1, -2)
    scores = []
    for row, seg, special in zip(pair["input"].tolist(), pair["segment"].tolist(), pair["special"].tolist()):
        b0 = seg.index(1)  # B's first position, after A's [SEP]
        a = [t for t, s, sp in zip(row[:b0], seg[:b0], special[:b0]) if not sp]
        b = [t for t, sp in zip(row[b0:], special[b0:]) if not sp]
        joined = sum(np.log(prob(tuple(a[-(order - 1):] + b[:j]), b[j])) for j in range(min(k, len(b))))
        alone = sum(np.log(prob(tuple(b[:j]), b[j])) for j in range(min(k, len(b))))
        scores.append(joined - alone)
    scores = np.array(scores)
    is_next = pair["is_next"].numpy()
    acc = float(((scores > np.median(scores)) == is_next).mean())
    print(f"{pairs} validation pairs, {order}-gram over the join's first {k} characters of B: "
          f"accuracy {acc:.3f} (chance 0.5; the learned bar 0.75)")


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:2]))
