"""Pure functions from tensors to numbers. Attention weights are (B, H, Tq, Tk) row-stochastic."""
import math

import torch
from torch import Tensor


def spectral_norms(weights: Tensor) -> Tensor:
    """||A||_2 (largest singular value) of each example's and head's attention matrix: (B, H)."""
    return torch.linalg.matrix_norm(weights.double(), ord=2)


def generic_bounds(n_keys: int) -> tuple[float, float]:
    """Any row-stochastic n x n matrix has 1 <= ||A||_2 <= sqrt(n)."""
    return 1.0, math.sqrt(n_keys)


def prenorm_bound(n_keys: int, max_score: float) -> float:
    """If every attention score lies in [-M, M], each row's weights are within exp(2M) of each other,
    and ||A||_2 <= sqrt(n / (1 + (n - 1) exp(-2M)))."""
    return math.sqrt(n_keys / (1 + (n_keys - 1) * math.exp(-2 * max_score)))


def prenorm_bound_masked(support: Tensor, max_score: Tensor) -> Tensor:
    """The same bound for attention under a mask (causal, a sparse pattern, padding), by the seed's own steps:
    query i attends to its n_i allowed keys, so A_ij <= a_i = 1 / (1 + (n_i - 1) exp(-2M)), and
    ||A||_2 <= sqrt(max column sum) <= sqrt(max_j sum_{i allows j} a_i). With every key allowed this is
    prenorm_bound; a causal mask at M = 0 gives sqrt(H_n) (harmonic number), not 1: the uniform causal matrix
    is not column-stochastic. support (B, H, Tq, Tk) bool: the keys each query may attend to; max_score (H,):
    M per head. Returns the bound per head over the batch, (H,)."""
    n = support.sum(-1).clamp_min(1).double()  # (B, H, Tq)
    alpha = 1 / (1 + (n - 1) * torch.exp(-2 * max_score.double())[None, :, None])
    columns = (support.double() * alpha[..., None]).sum(-2)  # (B, H, Tk)
    return columns.amax(dim=(0, 2)).sqrt()


def attention_entropy(weights: Tensor, rows: Tensor | None = None) -> Tensor:
    """Mean entropy (nats) of each head's attention rows: (H,). rows (B, Tq) bool: average over these only."""
    return _row_mean(-(weights * weights.clamp_min(1e-12).log()).sum(-1), rows)


def attention_distance(weights: Tensor, rows: Tensor | None = None) -> Tensor:
    """Mean |query index - key index| under each head's attention (self-attention): (H,). rows as above."""
    tq, tk = weights.shape[-2:]
    offset = (torch.arange(tq)[:, None] + (tk - tq) - torch.arange(tk)[None]).abs().to(weights.dtype)
    return _row_mean((weights * offset).sum(-1), rows)


def first_token_share(weights: Tensor, valid: Tensor | None = None) -> Tensor:
    """The attention sink (Xiao et al. 2024; the measure of Qiu et al. 2025, "Gated Attention for Large Language
    Models", sec. 4.3): each head's weight on the sequence's first token, averaged over the queries after it (the first
    query of a causal row has no other key to attend to) and over real tokens only: (H,). weights (B, H, Tq, Tk) of
    self-attention over right-padded rows (key 0 is each row's first token); valid (B, Tq) False at padding."""
    rows = torch.ones(weights.shape[0], weights.shape[2], dtype=torch.bool) if valid is None else valid.clone()
    rows[:, 0] = False
    return _row_mean(weights[..., 0], rows)


def max_score(scores: Tensor, weights: Tensor, valid: Tensor | None = None) -> float:
    """The largest pre-softmax attention score a real query gives a key it may attend to: the attention-logit growth
    of Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training instabilities", sec. 3.1.1,
    after Dehghani et al. 2023), max over heads and (query, key) pairs. scores (B, H, Tq, Tk) as the softmax reads
    them (after any soft-cap, before the mask); weights their softmax under the mask: a masked key has weight 0, an
    allowed one that underflows to 0 cannot hold its row's maximum. valid (B, Tq): the real queries."""
    allowed = weights > 0
    if valid is not None:
        allowed = allowed & valid[:, None, :, None]
    return float(scores.double().masked_fill(~allowed, float("-inf")).max())


def output_logit_stats(logits: Tensor, valid: Tensor | None = None) -> dict[str, float]:
    """The output logits at the real positions (logits (B, T, V)): their maximum, and the mean of log Z, the softmax's
    log-normalizer logsumexp_v z_v, that z-loss keeps near 0 (Wortsman et al. 2023, sec. 3.1.2: output logit
    divergence; PaLM, Chowdhery et al. 2022, sec. 5)."""
    z = logits.double() if valid is None else logits.double()[valid]
    return {"max_output_logit": float(z.max()), "mean_log_z": float(z.logsumexp(-1).mean())}


def attention_on(weights: Tensor, reads: Tensor) -> Tensor:
    """Each head's attention on the keys its queries must read, summed over those keys and averaged over the
    queries that must read any: (H,). weights (B, H, Tq, Tk); reads (B, Tq, Tk) bool: query q must read key k."""
    return _row_mean((weights * reads[:, None].to(weights.dtype)).sum(-1), reads.any(-1))


def _row_mean(per_row: Tensor, rows: Tensor | None) -> Tensor:
    """(B, H, Tq) -> (H,): the mean over examples and query rows, or over the rows marked in rows (B, Tq)."""
    if rows is None:
        return per_row.mean(dim=(0, 2))
    mask = rows[:, None, :].to(per_row.dtype)
    return (per_row * mask).sum(dim=(0, 2)) / mask.sum().clamp_min(1)


def head_similarity(weights: Tensor) -> Tensor:
    """Cosine similarity between heads' attention patterns (flattened over batch and positions): (H, H)."""
    flat = weights.transpose(0, 1).flatten(1)
    flat = flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return flat @ flat.T


def mean_off_diagonal(matrix: Tensor) -> float | None:
    """Mean over pairs i != j; None for a 1 x 1 matrix (one head has no pair to compare)."""
    n = matrix.shape[0]
    return float((matrix.sum() - matrix.diagonal().sum()) / (n * (n - 1))) if n > 1 else None


def norm_1_inf(x: Tensor) -> Tensor:
    """Dong et al.'s composite norm sqrt(||X||_1 ||X||_inf) of each (T, D) matrix in a batch."""
    col = x.abs().sum(-2).amax(-1)  # max column sum
    row = x.abs().sum(-1).amax(-1)  # max row sum
    return (col * row).sqrt()


def relative_residual(x: Tensor, valid: Tensor | None = None) -> dict[str, float]:
    """||X - 1 xbar^T|| / ||X|| for token representations X (B, T, D), averaged over the batch:
    0 when all tokens are the same vector (rank collapse), near 1 for unrelated tokens."""
    x = x.double()
    if valid is None:
        valid = torch.ones(x.shape[:2], dtype=torch.bool)
    results = {"fro": [], "l1_inf": []}
    for sample, keep in zip(x, valid):
        tokens = sample[keep]
        residual = tokens - tokens.mean(dim=0, keepdim=True)
        results["fro"].append(float(residual.norm() / tokens.norm().clamp_min(1e-30)))
        results["l1_inf"].append(float(norm_1_inf(residual) / norm_1_inf(tokens).clamp_min(1e-30)))
    return {key: sum(values) / len(values) for key, values in results.items()}


def sparsity(hidden: Tensor, eps: float) -> float:
    """Fraction of FFN hidden activations with |h| <= eps."""
    return float((hidden.abs() <= eps).float().mean())


def rms(x: Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())
