"""Based and Taylor linear attention with left padding, without a cache: a pass of one chunk runs the within-chunk
form alone on the projected entries (model/based.py, Taylor.attend), a longer one the chunked prefix sums; in both,
padded keys weigh nothing, so each row's real outputs are what the row gives alone (its own oracle: no padding)."""
import pytest
import torch
import torch.nn.functional as F

from helpers import tokens
from variants import tiny_model

V = 50


@pytest.mark.parametrize("length", [9, 21])  # one chunk of 16 (no features formed), and two (the chunked form)
@pytest.mark.parametrize("kind", ["taylor", "based"])
def test_left_padded_rows_give_what_each_row_gives_alone(kind, length):
    options = {"chunk": 16, **({"window_size": 4} if kind == "based" else {})}
    model = tiny_model("rope", seed=0, vocab_size=V, std=0.3, tie_embeddings=False, kind=kind, n_kv_heads=2,
                       options=options)
    rows = [tokens((n,), seed=n, vocab=V) for n in (length, length - 4, 2)]
    idx = torch.stack([F.pad(row, (length - len(row), 0)) for row in rows])
    valid = torch.arange(length)[None] >= torch.tensor([length - len(row) for row in rows])[:, None]
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(idx, positions, valid)
        for i, row in enumerate(rows):
            torch.testing.assert_close(out[i, length - len(row):], model(row[None])[0], rtol=1e-10, atol=1e-12)
