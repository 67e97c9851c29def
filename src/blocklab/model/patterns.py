"""Sparse attention patterns for softmax attention (`attn.pattern`), a registry.

A pattern says which keys each query may see as a function of their absolute indices (`allows`):
the one definition behind the dense mask, the blocked kernels and the decoding cache. Causality
is laid on top (`support`): a causal model never sees a later key.

Cost: `full` is SDPA's own causal kernel. `window` and `strided` skip the work they mask out
(blocked kernels, time and memory about linear in length at a fixed window and stride). `dilated`,
`global` and `bigbird` are dense masks over full attention: they change what is seen, not the cost.
`skips_masked_work` says which, for the bench.

Options are the constructor keywords (flat keys under attn: `attn.pattern=strided attn.stride=8`);
`window` is AttnConfig's own field, which every pattern with a local window takes."""
import random

import torch
import torch.nn.functional as F
from torch import Tensor

from blocklab.registry import Registry

ATTENTION_PATTERNS: Registry = Registry("attn.pattern")


class Pattern:
    """Which (query, key) pairs attention may use. Subclasses define `allows`; blocked ones also `attend`."""

    sparse = True  # False: every key may be seen (full); a sparse pattern needs a kind that honours it
    skips_masked_work = False  # True: computes only (about) the allowed pairs; False: a dense mask
    label: str | None = None  # what results record as choices.attn (None: the pattern's name)
    cache_keys: int | None = None  # keys a decoding cache must keep back (None: all of them)

    def allows(self, i: Tensor, j: Tensor) -> Tensor:
        """Broadcast absolute query indices i against key indices j -> bool, before causality."""
        raise NotImplementedError

    def support(self, q_index: Tensor, k_index: Tensor, causal: bool) -> Tensor:
        """(Tq, Tk) bool: may query q_index[a] see key k_index[b]."""
        i, j = q_index[:, None], k_index[None, :]
        allowed = self.allows(i, j)
        return allowed & (j <= i) if causal else allowed

    def attend(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, dropout: float) -> Tensor:
        """Blocked softmax attention of q over k, v (the same tokens, no padding, no bias): (B, H, T, d_head)."""
        raise NotImplementedError(f"attn.pattern={self.registry_name} has no blocked kernel; it is a dense mask")

    @classmethod
    def errors(cls, cfg, options: dict) -> list[str]:
        """Constraints on the options (defaults filled in) and the model config, one line each."""
        return []


def _count_errors(key: str, value, cfg, least: int = 1) -> list[str]:
    """A count (window, stride, ...) must be an integer from `least` up to the context."""
    if isinstance(value, int) and not isinstance(value, bool) and least <= value <= cfg.max_len:
        return []
    noun = "a positive integer" if least == 1 else "a non-negative integer"
    return [(f"attn.{key}={value!r} must be {noun} no longer than the context (model.max_len={cfg.max_len}, "
             f"the task's longest sequence)")]


@ATTENTION_PATTERNS.register("full")
class Full(Pattern):
    """Every key (every earlier one when causal): SDPA's is_causal kernel, which skips the masked half."""

    sparse = False
    skips_masked_work = True

    def allows(self, i, j):
        return torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)


@ATTENTION_PATTERNS.register("window")
class Window(Pattern):
    """Local attention: query i sees the w most recent keys i-w+1..i, itself included (|i - j| < w when
    not causal): the sliding window of Longformer (Beltagy et al. 2020) and the local part of the Sparse
    Transformer (Child et al. 2019). Blocked: queries in blocks of w against the 2w-1 keys they can
    reach, all blocks in one batched SDPA call with a small block mask: O(n w) time and memory."""

    label = "local"  # the name earlier results recorded for a windowed model
    skips_masked_work = True

    def __init__(self, window: int | None = None):
        self.window = window
        self.cache_keys = window

    @classmethod
    def errors(cls, cfg, options):
        return _count_errors("window", options["window"], cfg)

    def allows(self, i, j):
        return (i - j).abs() < self.window

    def attend(self, q, k, v, causal, scale, dropout):
        length, w = q.shape[2], self.window
        if length <= w:  # every key is within the window
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        after = 0 if causal else w - 1
        qb, kb, vb = blocks(q, w, 0, 0), blocks(k, w, w - 1, after), blocks(v, w, w - 1, after)
        mask = block_support(self, length, w, w - 1, after, causal, q.device)
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        # Blocks folded into the batch: (B * blocks, H, w, d) against (B * blocks, H_kv, keys, d). Given 5-D
        # inputs, torch's CPU SDPA takes its unfused math path, ~3x slower (`python -m blocklab.bench attention`).
        batch, n_blocks = qb.shape[0], qb.shape[2]
        mask = mask[None, :, None].expand(batch, -1, -1, -1, -1).flatten(0, 1)
        y = F.scaled_dot_product_attention(_folded(qb), _folded(kb), _folded(vb), attn_mask=mask, dropout_p=dropout,
                                           scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return y.unflatten(0, (batch, n_blocks)).transpose(1, 2).flatten(2, 3)[:, :, :length]


@ATTENTION_PATTERNS.register("strided")
class Strided(Pattern):
    """The Sparse Transformer's strided pattern (Child et al. 2019, sec. 4.1): query i sees a local block,
    |i - j| < w, and every s-th earlier key, (i - j) mod s == 0. The paper takes w = s (about sqrt(n));
    window null means that. Two disjoint key sets, computed apart and merged exactly as one softmax over
    their union: the strided part (keys of the query's residue class x[r::s] beyond the local block) is
    ordinary attention written out, giving each query its output y_s and log-sum-exp l_s; the local part
    is window's blocked SDPA (the fused kernel), with one more key per block, a "sink" whose score is l_s
    for every query (an extra head dimension: l_s on the query side, 1/scale on the sink's) and whose value
    is an extra output column. That column returns the strided part's share of the joint softmax,
    Z_s / (Z_local + Z_s), so y = y_local + share * y_s (`merged`). The local part costs O(n w); the strided
    part n^2/s scores at a fixed stride (O(n sqrt(n)) with s = sqrt(n)). With attention dropout, which
    would drop the sink as one key, the one-softmax kernel runs instead (`one_softmax`)."""

    skips_masked_work = True

    def __init__(self, stride: int | None = None, window: int | None = None):
        self.stride = stride
        self.window = stride if window is None else window

    @classmethod
    def errors(cls, cfg, options):
        window = [] if options["window"] is None else _count_errors("window", options["window"], cfg)
        return _count_errors("stride", options["stride"], cfg) + window

    def local(self, i, j):
        return (i - j).abs() < self.window

    def allows(self, i, j):
        return self.local(i, j) | ((i - j) % self.stride == 0)

    def attend(self, q, k, v, causal, scale, dropout):
        if q.shape[2] <= self.window:  # every key is within the local block
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        return self.one_softmax(q, k, v, causal, scale, dropout) if dropout else self.merged(q, k, v, causal, scale)

    def classes(self, x: Tensor) -> Tensor:
        """(B, H, T, d) -> (B, H, s, T/s, d): residue class r (tokens r, r + s, ...) in row r, zeros past T."""
        rows = -(-x.shape[2] // self.stride)
        return F.pad(x, (0, 0, 0, rows * self.stride - x.shape[2])).unflatten(2, (rows, self.stride)).transpose(2, 3)

    def strided_support(self, length: int, causal: bool) -> Tensor:
        """(s, T/s, T/s) bool: may query t*s + r see key u*s + r (class r) in the strided part: the pattern
        allows it, the local block does not (that is the local part's), the key is a real token."""
        rows = -(-length // self.stride)
        index = torch.arange(rows * self.stride).view(rows, self.stride).T  # (s, rows): class r, member t
        i, j = index[:, :, None], index[:, None, :]
        seen = self.allows(i, j) & ~self.local(i, j) & (j < length)
        return seen & (j <= i) if causal else seen

    def masks(self, length: int, causal: bool, device, dtype) -> tuple[Tensor, Tensor]:
        """The strided part's support with every row given a key (a query with none sees its whole class,
        for a finite log-sum-exp, and its sink is masked out); the local part's float mask over each
        query block's keys (block_support's, local pairs only) and its sink: (blocks, w, keys + 1)."""
        w, after = self.window, 0 if causal else self.window - 1
        seen = self.strided_support(length, causal)
        empty = ~seen.any(-1)  # (s, rows): the queries without a strided key
        # The local pairs depend on i - j alone: one (w, keys) table for every block, then its real keys.
        i, j = torch.arange(w - 1, 2 * w - 1)[:, None], torch.arange(2 * w - 1 + after)[None, :]
        local = self.local(i, j) & (j <= i) if causal else self.local(i, j)
        keys = block_index(length, w, w - 1, after)  # (blocks, keys) absolute indices
        queries = block_index(length, w, 0, 0)  # (blocks, w)
        allowed = (local & ((keys >= 0) & (keys < length))[:, None, :]) | (queries >= length)[:, :, None]
        no_sink = F.pad(empty.T.flatten(), (0, queries.numel() - empty.numel()), value=True).view_as(queries)
        allowed = torch.cat((allowed, ~no_sink[:, :, None]), dim=-1)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
        return (seen | empty[..., None]).to(device), mask.to(device)

    def merged(self, q, k, v, causal, scale):
        """Strided part written out, local part and merge in one fused SDPA call (class docstring)."""
        (batch, heads, length, dim), kv_heads, w = q.shape, k.shape[1], self.window
        seen, mask = self.masks(length, causal, q.device, q.dtype)
        # Strided part, in the residue classes; the query heads of a GQA group share their K/V head.
        qc = self.classes(q).unflatten(1, (kv_heads, -1))  # (B, H_kv, G, s, rows, d)
        kc, vc = self.classes(k)[:, :, None], self.classes(v)[:, :, None]
        scores = (qc @ kc.transpose(-1, -2)).mul_(scale).masked_fill_(~seen, float("-inf"))
        lse = scores.logsumexp(-1, keepdim=True)  # (B, H_kv, G, s, rows, 1)
        y_strided = scores.softmax(-1) @ vc

        def tokens(x):  # (B, H_kv, G, s, rows, e) -> (B, H, T, e)
            return x.flatten(1, 2).transpose(2, 3).flatten(2, 3)[:, :, :length]

        # Local part: an extra head dimension carries l_s on the queries, 0 on the keys, 1/scale on the sink,
        # whose value is 1 in an extra column: the column returns the strided part's share of the softmax.
        after = 0 if causal else w - 1
        qb = blocks(torch.cat((q, tokens(lse)), dim=-1), w, 0, 0)
        kb, vb = (blocks(F.pad(x, (0, 1)), w, w - 1, after) for x in (k, v))
        sink = q.new_zeros(batch, kv_heads, kb.shape[2], 1, dim + 1)
        kb = torch.cat((kb, sink.index_fill(-1, torch.tensor([dim], device=q.device), 1 / scale)), dim=3)
        vb = torch.cat((vb, sink.index_fill(-1, torch.tensor([dim], device=q.device), 1.0)), dim=3)
        mask = mask[:, None] if batch == 1 else mask[:, None].repeat(batch, 1, 1, 1)  # as _folded orders blocks
        y = F.scaled_dot_product_attention(_folded(qb), _folded(kb), _folded(vb), attn_mask=mask, scale=scale,
                                           enable_gqa=heads != kv_heads)
        y = y.unflatten(0, (batch, -1)).transpose(1, 2).flatten(2, 3)[:, :, :length]
        return y[..., :dim] + y[..., dim:] * tokens(y_strided)

    def one_softmax(self, q, k, v, causal, scale, dropout):
        """The same attention as one written-out softmax over both score sets, dropout on its weights."""
        (batch, heads, length, dim), w, s = q.shape, self.window, self.stride
        k, v = (x.repeat_interleave(heads // k.shape[1], dim=1) for x in (k, v))
        # Local part: window's blocks, keeping the pairs the local block allows.
        after = 0 if causal else w - 1
        kb, vb = blocks(k, w, w - 1, after), blocks(v, w, w - 1, after)
        local = (blocks(q, w, 0, 0) @ kb.transpose(-1, -2)).mul_(scale)
        i, j = block_index(length, w, 0, 0)[:, :, None], block_index(length, w, w - 1, after)[:, None, :]
        seen = block_support(self, length, w, w - 1, after, causal, q.device) & self.local(i, j).to(q.device)
        local = local.masked_fill_(~seen, float("-inf")).flatten(2, 3)[:, :, :length]
        # Strided part: row t, column r of the (T/s, s) reshape is token t*s + r, so each column is a
        # residue class; there, keys of the same class beyond the local block.
        rows = -(-length // s)
        qs, ks, vs = (F.pad(x, (0, 0, 0, rows * s - length)).view(batch, heads, rows, s, dim) for x in (q, k, v))
        strided = torch.einsum("bhtrd,bhurd->bhtru", qs, ks).mul_(scale)
        index = torch.arange(rows * s, device=q.device).view(rows, s)
        i, j = index[:, :, None], index.T[None]  # (rows, s, 1) queries, (1, s, rows) keys of their class
        seen = self.allows(i, j) & ~self.local(i, j) & (j < length)
        seen = seen & (j <= i) if causal else seen
        strided = strided.masked_fill_(~seen, float("-inf")).flatten(2, 3)[:, :, :length]
        # One softmax over both sets (disjoint: the strided part leaves out the local block).
        probs = torch.cat((local, strided), dim=-1).softmax(dim=-1)
        probs = F.dropout(probs, dropout) if dropout else probs
        p_local, p_strided = probs.split((local.shape[-1], rows), dim=-1)
        y = F.pad(p_local, (0, 0, 0, kb.shape[2] * w - length)).unflatten(2, (-1, w)) @ vb
        y_strided = torch.einsum("bhtru,bhurd->bhtrd", F.pad(p_strided, (0, 0, 0, rows * s - length))
                                 .unflatten(2, (rows, s)), vs)
        return y.flatten(2, 3)[:, :, :length] + y_strided.flatten(2, 3)[:, :, :length]


@ATTENTION_PATTERNS.register("dilated")
class Dilated(Pattern):
    """A window with gaps (the dilated sliding window of Longformer, Beltagy et al. 2020, sec. 3.1): query
    i sees w keys i - d*m, m = 0..w-1, reaching d*(w-1) back. A dense mask over full attention: it saves
    no compute."""

    def __init__(self, window: int | None = None, dilation: int = 2):
        self.window, self.dilation = window, dilation
        self.cache_keys = None if window is None else dilation * (window - 1) + 1

    @classmethod
    def errors(cls, cfg, options):
        errs = _count_errors("window", options["window"], cfg) + _count_errors("dilation", options["dilation"], cfg)
        reach = None if errs else options["dilation"] * (options["window"] - 1) + 1
        if reach is not None and reach > cfg.max_len:
            errs.append(f"attn.dilation={options['dilation']} with attn.window={options['window']} reaches {reach} "
                        f"keys back, beyond the context (model.max_len={cfg.max_len}); lower one of them")
        return errs

    def allows(self, i, j):
        back = (i - j).abs()
        return (back % self.dilation == 0) & (back <= self.dilation * (self.window - 1))


@ATTENTION_PATTERNS.register("global")
class Global(Pattern):
    """Longformer (Beltagy et al. 2020): a sliding window of w plus global attention on the first g
    tokens, which attend to every key and are attended by every query (causal where causal). A dense
    mask over full attention: it saves no compute."""

    def __init__(self, window: int | None = None, n_global: int = 1):
        self.window, self.n_global = window, n_global

    @classmethod
    def errors(cls, cfg, options):
        return _count_errors("window", options["window"], cfg) + _count_errors("n_global", options["n_global"], cfg)

    def allows(self, i, j):
        return ((i - j).abs() < self.window) | (i < self.n_global) | (j < self.n_global)


@ATTENTION_PATTERNS.register("bigbird")
class BigBird(Pattern):
    """BigBird (Zaheer et al. 2020): a sliding window of w, g global tokens (as `global`), and r random
    keys per query block of `block` queries, fixed by `seed`. A block's random keys are drawn among the
    keys before it, so the pattern never depends on the sequence length and causal queries see them all
    (block 0 has none). A dense mask over full attention: it saves no compute."""

    def __init__(self, window: int | None = None, n_global: int = 1, n_random: int = 2, block: int = 16,
                 seed: int = 0):
        self.window, self.n_global, self.n_random, self.block, self.seed = window, n_global, n_random, block, seed
        self._table = torch.empty(0, n_random, dtype=torch.long)  # random keys per query block, grown on demand

    @classmethod
    def errors(cls, cfg, options):
        seed = options["seed"]
        errs = _count_errors("window", options["window"], cfg) + _count_errors("block", options["block"], cfg)
        errs += [line for key in ("n_global", "n_random") for line in _count_errors(key, options[key], cfg, least=0)]
        if not isinstance(seed, int) or isinstance(seed, bool):
            errs.append(f"attn.seed={seed!r} must be an integer (it fixes the random keys)")
        return errs

    def random_keys(self, n_blocks: int) -> Tensor:
        """(n_blocks, n_random) key indices, -1 where a block has fewer earlier keys than n_random."""
        rows = [self._draw(b) for b in range(len(self._table), n_blocks)]
        if rows:
            drawn = torch.tensor(rows, dtype=torch.long).reshape(len(rows), self.n_random)
            self._table = torch.cat((self._table, drawn))
        return self._table[:n_blocks]

    def _draw(self, block: int) -> list[int]:
        earlier = block * self.block
        rng = random.Random(f"{self.seed}/{block}")  # a string seed: the same keys in every process
        keys = rng.sample(range(earlier), min(self.n_random, earlier))
        return keys + [-1] * (self.n_random - len(keys))

    def allows(self, i, j):
        near = ((i - j).abs() < self.window) | (i < self.n_global) | (j < self.n_global)
        query_block = i // self.block
        picked = self.random_keys(int(query_block.max()) + 1).to(i.device)[query_block]  # (..., n_random)
        return near | (picked == j[..., None]).any(-1)


def build_pattern(attn) -> Pattern:
    """The configured pattern of an AttnConfig."""
    return ATTENTION_PATTERNS[attn.pattern_name](**attn.pattern_args)


def blocks(x: Tensor, size: int, before: int, after: int) -> Tensor:
    """(B, H, T, d) -> (B, H, n, before + size + after, d): block b holds rows b*size - before up to
    (b+1)*size + after - 1, zeros outside 0..T-1 (a view of one padded copy)."""
    n = -(-x.shape[2] // size)
    padded = F.pad(x, (0, 0, before, n * size - x.shape[2] + after))
    return padded.unfold(2, before + size + after, size).transpose(-1, -2)


def _folded(blocked: Tensor) -> Tensor:
    """(B, H, n, rows, d) -> (B * n, H, rows, d)"""
    return blocked.transpose(1, 2).flatten(0, 1)


def block_index(length: int, size: int, before: int, after: int) -> Tensor:
    """The absolute indices `blocks` puts in each block: (n, before + size + after)."""
    n = -(-length // size)
    return torch.arange(-before, n * size + after).unfold(0, before + size + after, size)


def block_support(pattern: Pattern, length: int, size: int, before: int, after: int, causal: bool,
                  device=None) -> Tensor:
    """(n, size, keys) bool: the pattern's support between each query block and its key block. Keys
    outside 0..T-1 are never seen; padding queries (past T, discarded) see all, so no row is empty."""
    i = block_index(length, size, 0, 0)[:, :, None]
    j = block_index(length, size, before, after)[:, None, :]
    seen = pattern.allows(i, j) & (j >= 0) & (j < length)
    seen = seen & (j <= i) if causal else seen
    return (seen | (i >= length)).to(device)
