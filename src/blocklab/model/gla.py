"""Gated linear attention (`attn.kind=gla`): Yang, Wang, Shen, Panda and Kim 2024, "Gated Linear Attention
Transformers with Hardware-Efficient Training" (ICML 2024), sec. 4.

A matrix state per K/V head with a data-dependent decay per key dimension (eq. in sec. 4.1):

    S_t = diag(alpha_t) S_{t-1} + k_t^T v_t,     o_t = q_t S_t,
    alpha_t = sigmoid(x_t W_a1 W_a2 + b_a)^(1/tau),   W_a1: d_model x 16, W_a2: 16 x d_k (low rank), tau = 16,

q, k, v row vectors (d_k = d_v = d_head), q scaled by attn.scale (1/sqrt(d_head), as the paper's code does).
Training runs the chunkwise parallel form (sec. 4.2): within a chunk of C tokens, with b_t = sum of log alpha
over the chunk up to t, o_t = (q_t * exp(b_t)) S_0 + sum_{s<=t} sum_i q_ti k_si exp(b_ti - b_si) v_s, and the state
passes from chunk to chunk as S_C = diag(exp(b_C)) S_0 + sum_s (k_s * exp(b_C - b_s))^T v_s. The intra-chunk
decays exp(b_t - b_s) (s <= t) are formed explicitly, (C, C, d_k) per chunk, so no exp(-b) can overflow (the
paper's secondary-level chunking serves the same end). Decoding runs the recurrence itself, one token at a time,
with S (d_k x d_v per K/V head) as the state. Each head's output is RMS-normalized before out_proj (the paper's
LayerNorm after RetNet); the paper's output gate (Swish(x W_r) * ...) is left out, so the kinds compare on how
they mix tokens. GQA/MQA: the query heads of a group read their K/V head's state. Padding: a padded token has
k = v = 0 and alpha = 1, so it changes nothing."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.linear_attention import key_valid
from blocklab.model.recurrent import RecurrentAttention, RotaryOption, float_at_least_32, grouped, padded_to_chunks


def gla_chunked(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, held: Tensor | None, chunk: int):
    """The chunkwise parallel form (module docstring). q (B, H, G, T, dk), k and log_alpha (B, H, T, dk),
    v (B, H, T, dv), held (B, H, dk, dv) or None -> (outputs (B, H, G, T, dv), final state (B, H, dk, dv))."""
    length = k.shape[-2]
    chunk = min(chunk, length)
    qc = padded_to_chunks(q, chunk)  # (B, H, G, N, C, dk); zero padding adds nothing and decays by exp(0) = 1
    kc, vc, ac = (padded_to_chunks(t, chunk) for t in (k, v, log_alpha))  # (B, H, N, C, .)
    b = ac.cumsum(-2)  # log of the decay from the chunk's start through each token
    within = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    gap = (b[..., :, None, :] - b[..., None, :, :]).masked_fill(~within[..., None], float("-inf"))
    scores = torch.einsum("bhgnti,bhnsi,bhntsi->bhgnts", qc, kc, gap.exp())  # (B, H, G, N, C, C), s <= t
    out = scores @ vc[:, :, None]
    last = b[..., -1:, :]
    local = (kc * (last - b).exp()).transpose(-2, -1) @ vc  # each chunk's own sum, decayed to its end
    decay = last.squeeze(-2).exp()[..., None]  # (B, H, N, dk, 1): the whole chunk's decay
    state = held if held is not None else k.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1])
    before = []
    for chunk_decay, chunk_sum in zip(decay.unbind(2), local.unbind(2)):  # unbind, not [:, :, n]: see delta_chunked
        before.append(state)
        state = chunk_decay * state + chunk_sum
    before = torch.stack(before, dim=2)[:, :, None]  # (B, H, 1, N, dk, dv): the state at each chunk's start
    out = out + (qc * b.exp()[:, :, None]) @ before
    return out.flatten(-3, -2)[..., :length, :], state


def gla_step(q: Tensor, k: Tensor, v: Tensor, log_alpha: Tensor, held: Tensor | None):
    """The recurrence for one token: q (B, H, G, 1, dk), k and log_alpha (B, H, 1, dk), v (B, H, 1, dv)."""
    state = k.transpose(-2, -1) @ v
    if held is not None:
        state = log_alpha.exp().transpose(-2, -1) * held + state
    return q @ state[:, :, None], state


def gla_weights(q: Tensor, k: Tensor, log_alpha: Tensor) -> Tensor:
    """(B, H, G, T, T): how much each query takes of each value, o_t = sum_s w_ts v_s, written out (analysis)."""
    b = log_alpha.cumsum(-2)
    length = k.shape[-2]
    within = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    gap = (b[..., :, None, :] - b[..., None, :, :]).masked_fill(~within[..., None], float("-inf"))
    return torch.einsum("bhgti,bhsi,bhtsi->bhgts", q, k, gap.exp())


@ATTENTION_KINDS.register("gla")
class GatedLinearAttention(RotaryOption, RecurrentAttention):
    """GLA (module docstring). Options: chunk (tokens per chunk of the parallel form), gate_rank (16, the paper's
    low rank of the gate), gate_temperature (tau = 16: alpha = sigmoid(.)^(1/tau) stays near 1, a slow decay) and
    rotary (RoPE on q and k; off, as in the paper: RotaryOption)."""

    temperature = False  # q's 1/sqrt(d_head) is no softmax temperature: param=mup sets the projections only

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 chunk: int = 8, gate_rank: int = 16, gate_temperature: float = 16.0, rotary: bool = False):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias, chunk)
        self.rotary = rotary
        self.gate_temperature = gate_temperature
        self.gate_down = nn.Linear(d_model, gate_rank, bias=False)
        self.gate_up = nn.Linear(gate_rank, self.n_kv_heads * self.d_head, bias=True)

    @classmethod
    def errors(cls, cfg, options):
        errs = super().errors(cfg, options)
        rank, tau = options.get("gate_rank"), options.get("gate_temperature")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0):
            errs.append(f"attn.gate_rank={rank!r} must be a positive integer (the low rank of GLA's gate)")
        if tau is not None and not (isinstance(tau, (int, float)) and not isinstance(tau, bool) and tau > 0):
            errs.append(f"attn.gate_temperature={tau!r} must be a number > 0 (alpha = sigmoid(.)^(1/tau))")
        return errs

    def token_inputs(self, x: Tensor) -> Tensor:
        """log alpha (B, H_kv, T, d_head): log(sigmoid(x W_a1 W_a2 + b)) / tau, in log space (no underflow)."""
        logits = self.gate_up(self.gate_down(x))
        return self._heads(F.logsigmoid(logits.float() if logits.dtype != torch.float64 else logits)
                           / self.gate_temperature)

    def attend(self, q, k, v, ctx, state):
        dtype = q.dtype
        with torch.autocast(q.device.type, enabled=False):
            q, k, v, log_alpha = float_at_least_32(q, k, v, self.pending)
            valid = key_valid(ctx, k.shape[2])
            if valid is not None:
                padding = ~valid[:, None, :, None]
                k, v, log_alpha = (t.masked_fill(padding, 0.0) for t in (k, v, log_alpha))
            q = grouped(q * self.scale, self.n_kv_heads)
            out = self.run_forms(q, k, v, log_alpha, ctx, state, gla_weights, gla_step, gla_chunked)
        return self.normed(out.flatten(1, 2).to(dtype))
