"""Abacus embeddings (McLeish et al. 2024, "Transformers Can Do Arithmetic with the Right Embeddings"):
each digit gets a learned vector for its index within its own number, added to its token embedding,
so the i-th digits of every number look alike however far apart they sit. The indices come from the
task (tasks/placement.py, the digit_index stream: 1, 2, 3 ... by significance, 0 for other tokens);
the random training offset that lets longer numbers use trained rows is applied to the data, not here."""
from torch import Tensor, nn


class AbacusEmbedding(nn.Module):
    def __init__(self, size: int, d_model: int):
        super().__init__()
        self.table = nn.Embedding(size, d_model)

    def forward(self, x: Tensor, digit_index: Tensor | None) -> Tensor:
        if digit_index is None:
            raise ValueError("this model has Abacus embeddings (pos.abacus=true): pass each token's digit_index, "
                             "as the task's batches and generate(streams=...) do")
        if digit_index.numel() and int(digit_index.max()) >= self.table.num_embeddings:
            raise ValueError(f"digit index {int(digit_index.max())} is past the Abacus table "
                             f"({self.table.num_embeddings} rows); a number is longer than any the model was sized for")
        # Row 0 (not a digit) adds nothing, whatever the init scheme wrote into it.
        return x + self.table(digit_index) * (digit_index > 0).unsqueeze(-1).to(x.dtype)


def abacus_size(offset: int, max_len: int) -> int:
    """Rows for sequences up to max_len tokens: 0 (no digit), then every index a number can have plus the offset."""
    return offset + max_len + 1
