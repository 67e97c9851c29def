"""What attention needs that is the same for every layer of one pass: positions, the position scheme,
and one float mask folding causality, the sparse pattern, key padding and a position bias; or, where
a pattern has a blocked kernel and nothing else is masked, that pattern and no mask at all."""
from dataclasses import dataclass, field

import torch
from torch import Tensor

from blocklab.model.cache import DecodingCache
from blocklab.model.patterns import Pattern
from blocklab.model.position import PositionScheme, default_positions


@dataclass
class AttentionContext:
    """Everything attention needs that is the same for every layer of one forward pass."""

    positions: Tensor  # (B|1, T) positions of the new tokens
    position_scheme: PositionScheme
    mask: Tensor | None  # float, broadcastable to (B, H, Tq, Tk); None on the fast causal path
    is_causal: bool
    cache: DecodingCache | None = None
    need_weights: bool = False
    # Positions and validity of all keys (held + new), which the cache keeps after the pass.
    k_positions: Tensor | None = None
    k_valid: Tensor | None = None
    # A sparse pattern to compute by its blocked kernel (Pattern.attend); None: the mask says it all.
    blocked: Pattern | None = None
    # The first layer's values (B, T, width) of this pass, which later layers mix in (model.value_residual).
    first_values: Tensor | None = field(default=None, repr=False, compare=False)
    # keys_seen's counts, computed by the first layer that asks and shared by the others of the pass.
    _keys_seen: dict = field(default_factory=dict, repr=False, compare=False)

    def keys_seen(self, q_len: int, k_len: int) -> Tensor:
        """How many keys each of the q_len new queries may attend to, out of k_len: (B|1, 1, Tq, 1).
        The queries are the last q_len of the keys (self-attention, held keys first)."""
        if (q_len, k_len) not in self._keys_seen:
            self._keys_seen[q_len, k_len] = self._count_keys(q_len, k_len)
        return self._keys_seen[q_len, k_len]

    def _count_keys(self, q_len: int, k_len: int) -> Tensor:
        device = self.positions.device
        if self.mask is not None:
            return torch.isfinite(self.mask[:, :1]).sum(-1, keepdim=True)  # every head sees the same keys
        if self.blocked is not None:
            index = torch.arange(k_len, device=device)
            return self.blocked.support(index[-q_len:], index, self.is_causal).sum(-1)[None, None, :, None]
        if self.is_causal:
            return torch.arange(k_len - q_len + 1, k_len + 1, device=device)[None, None, :, None]
        return torch.full((1, 1, q_len, 1), k_len, device=device)


def self_attention_context(idx: Tensor, positions: Tensor | None, valid: Tensor | None, cache: DecodingCache | None,
                           scheme: PositionScheme, causal: bool, pattern: Pattern | None,
                           need_weights: bool = False) -> AttentionContext:
    """Positions, mask and position bias for self-attention over `idx` (the new tokens), continuing
    from the cache if there is one. Positions default to 0..T-1, or to the cache's next ones.
    `pattern` None is full attention."""
    batch, length = idx.shape
    if positions is None:
        positions = default_positions(length, idx.device)  # shared per length, so schemes can reuse their tables
        if cache is not None and cache.positions is not None:
            positions = cache.positions[:, -1:] + 1 + positions
    if valid is not None and bool(valid.all()):
        valid = None  # no padding: nothing to mask, and SDPA can take its fast path
    q_start, k_start, k_positions, k_valid = 0, 0, positions, valid
    if cache is not None:
        positions = positions.expand(batch, length)  # the cache keeps one row per sequence
        q_start, k_start = cache.next_index, cache.start
        k_positions, k_valid = cache.with_new_keys(positions, valid)
    bias = scheme.bias(positions, k_positions)
    if (pattern is not None and pattern.sparse and pattern.skips_masked_work and k_valid is None and bias is None
            and k_positions.shape[1] == length and not need_weights):
        # Queries are the keys, nothing else to mask: the blocked kernel, no (T, T) mask built.
        return AttentionContext(positions, scheme, None, causal, cache, need_weights, k_positions, k_valid, pattern)
    mask, is_causal = build_mask(q_start, length, k_start, k_positions.shape[1], causal, pattern, k_valid, bias,
                                 idx.device)
    return AttentionContext(positions, scheme, mask, is_causal, cache, need_weights, k_positions, k_valid)


def cross_attention_context(memory: Tensor, memory_valid: Tensor | None, scheme: PositionScheme,
                            cache: DecodingCache | None, need_weights: bool = False) -> AttentionContext:
    """Decoder queries see every valid encoder position; positions are already in the memory."""
    mask = None
    if memory_valid is not None and not bool(memory_valid.all()):
        mask = torch.zeros(memory_valid.shape, dtype=torch.float32, device=memory_valid.device)
        mask = mask.masked_fill(~memory_valid, float("-inf"))[:, None, None, :]
    return AttentionContext(torch.zeros(1, 1, dtype=torch.long, device=memory.device), scheme, mask, False, cache,
                            need_weights)


def build_mask(
    q_start: int,
    q_len: int,
    k_start: int,
    k_len: int,
    causal: bool,
    pattern: Pattern | None,
    key_valid: Tensor | None,
    bias: Tensor | None,
    device=None,
) -> tuple[Tensor | None, bool]:
    """Fold causality, the sparse pattern (None: full), key padding and a position bias into one float
    mask. Queries have absolute indices q_start.., keys k_start..; the keys end with the queries themselves.

    Returns (mask, is_causal); mask is None when SDPA's own causal flag says it all."""
    sparse = pattern is not None and pattern.sparse
    if not sparse and key_valid is None and bias is None:
        if not causal or q_len == k_len:
            return None, causal  # no held keys: SDPA's own causal flag
        if q_len == 1:
            return None, False  # one new token (decoding): every key is in its past
    q_index = torch.arange(q_start, q_start + q_len, device=device)
    k_index = torch.arange(k_start, k_start + k_len, device=device)
    offset = q_index[:, None] - k_index[None, :]  # how far back each key is
    if sparse:
        allowed = pattern.support(q_index, k_index, causal)
    else:
        allowed = offset >= 0 if causal else torch.ones_like(offset, dtype=torch.bool)
    allowed = allowed[None, None]  # (1, 1, Tq, Tk)
    if key_valid is not None:
        # Padding queries still see themselves, so no softmax row is empty (no NaN); their outputs are ignored.
        allowed = (allowed & key_valid[:, None, None, :]) | (offset == 0)
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
    mask = mask.masked_fill(~allowed, float("-inf"))
    if bias is not None:
        mask = mask + bias
    return mask, False
