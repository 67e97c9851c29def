"""Forgetting attention (`attn.kind=forgetting`): Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a
Forget Gate" (ICLR; arXiv 2503.02130), the basic FoX layer (its "Pro" extras, output gate and norm, and key shift,
are left out; attn.output_gate adds an output gate to any kind). Reference code: zhixuan-lin/forgetting-transformer
(commit 883f260), model/forgetting_transformer/modeling_forgetting_transformer.py and ops/forgetting_attention.py.

    f_t = sigmoid(w_f^T x_t + b_f)                  one scalar per head and token (the code's fgate_proj)
    o_i = sum_{j<=i} exp(q_i.k_j / sqrt(d) + D_ij) v_j / sum_{j<=i} exp(q_i.k_j / sqrt(d) + D_ij)
    D_ij = sum_{l=j+1..i} log f_l = c_i - c_j,       c_i = sum_{l<=i} log f_l    (eqs. 5-8)

The decay D is added to the scores as a float mask, so the hot path is F.scaled_dot_product_attention's fused
kernel, with softmax attention's gradient written out for the mask's share (attention.LearnedBiasAttention): torch
2.13's flex_attention, the kernel for modified scores, has no backward on the CPU ("FlexAttention does not support
backward on CPU"). `python -m blocklab.bench attention` prints its cost against SDPA. Decoding keeps the keys, the
values and each key's c_j (the log-decay sums), so a step continues the sum from the last one. Causal only; it
needs no position scheme (the paper's FoX runs with pos=none) but takes any."""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.architectures import ARCHITECTURES
from blocklab.model.attention import ATTENTION_KINDS, Attention, LearnedBiasAttention
from blocklab.model.cache import KVState


class ForgetState(KVState):
    """Softmax attention's keys and values, and c_j (B, H, T) of every held key, in float32 at least."""

    def __init__(self):
        super().__init__()
        self.decay: Tensor | None = None

    def extend_decay(self, log_f: Tensor) -> Tensor:
        """The new tokens' log f (B, H, Tnew) -> c of every held and new key."""
        new = log_f.cumsum(-1) if self.decay is None else self.decay[..., -1:] + log_f.cumsum(-1)
        self.decay = new if self.decay is None else torch.cat((self.decay, new), dim=-1)
        return self.decay

    def drop_oldest(self, count: int) -> None:
        super().drop_oldest(count)
        self.decay = self.decay[..., count:]

    def bytes(self) -> int:
        return super().bytes() + (0 if self.decay is None else self.decay.numel() * self.decay.element_size())


@ATTENTION_KINDS.register("forgetting")
class ForgettingAttention(Attention):
    """Softmax attention (MHA/GQA/MQA) whose scores get the forget gates' cumulative log-decay."""

    adds_score_bias = True  # the decay is unbounded below: score bounds from q and k alone (analysis) do not hold

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias)
        self.forget_proj = nn.Linear(d_model, n_heads, bias=True)  # the reference's fgate_proj (always a bias)
        self.pending: Tensor | None = None  # log f of this pass's tokens, (B, H, T)

    @classmethod
    def errors(cls, cfg, options):
        errs = []
        if not cfg.attn.causal:
            errs.append("attn.kind=forgetting decays the scores with distance into the past, which needs a causal "
                        "model: use attn.causal=true")
        if cfg.arch in ARCHITECTURES and ARCHITECTURES[cfg.arch].is_encoder_decoder:
            errs.append(f"attn.kind=forgetting gates self-attention over one stream; model.arch={cfg.arch} also "
                        "cross-attends to an encoder: use model.arch=decoder")
        return errs

    def state_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.n_kv_heads * self.d_head * element_size + self.n_heads * max(element_size, 4)

    def new_state(self) -> ForgetState:
        return ForgetState()

    def forward(self, x, ctx, layer=0, memory=None):
        logits = self.forget_proj(x)
        # float32 at least: the sums c_i of many small log f lose their terms in bfloat16
        self.pending = F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32))).transpose(1, 2)
        try:
            return super().forward(x, ctx, layer, memory)
        finally:
            self.pending = None

    def attend(self, q, k, v, ctx, state):
        log_f = self.pending
        if state is not None:
            k, v = state.extend(k, v)
            decay = state.extend_decay(log_f)
        else:
            decay = log_f.cumsum(-1)
        dtype = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):  # as softmax attention: float32 at least
            out = self._attend(q.to(dtype), k.to(dtype), v.to(dtype), self.decay_mask(decay, q.shape[-2], ctx),
                               ctx.need_weights)
        return out.to(q.dtype)

    @staticmethod
    def decay_mask(decay: Tensor, q_len: int, ctx) -> Tensor:
        """D_ij = c_i - c_j (B, H, Tq, Tk), with the context's causality, padding and any position bias."""
        mask = decay[..., -q_len:, None] - decay[..., None, :]
        if ctx.is_causal:
            tq, tk = mask.shape[-2:]
            mask = mask.masked_fill(torch.ones(tq, tk, dtype=torch.bool, device=mask.device).triu(1 + tk - tq),
                                    float("-inf"))
        return mask if ctx.mask is None else mask + ctx.mask.to(mask.dtype)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, need_weights: bool) -> Tensor:
        dropout = self.dropout if self.training else 0.0
        if need_weights:
            repeat = self.n_heads // self.n_kv_heads
            k_all, v_all = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            self.last_weights = ((q @ k_all.transpose(-2, -1)) * self.scale + mask).softmax(dim=-1)
            return F.dropout(self.last_weights, dropout) @ v_all
        if mask.requires_grad and dropout == 0.0 and torch.is_grad_enabled():
            return LearnedBiasAttention.apply(q, k, v, mask, self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale,
                                              enable_gqa=self.n_kv_heads != self.n_heads)
