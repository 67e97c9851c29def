"""DeltaNet (`attn.kind=deltanet`): linear attention updated by the delta rule. Schlag, Irie and Schmidhuber 2021,
"Linear Transformers Are Secretly Fast Weight Programmers" (ICML 2021), sec. 4.2; its parallel form over the
sequence: Yang, Wang, Zhang, Shen and Kim 2024, "Parallelizing Linear Transformers with the Delta Rule over
Sequence Length" (NeurIPS 2024), sec. 3.

Per K/V head, with S (d_v x d_k) the state, column vectors, L2-normalized keys and queries:

    S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,    o_t = S_t q_t,    beta_t = sigmoid(x_t W_beta),

that is S_t = S_{t-1} + beta_t (v_t - S_{t-1} k_t) k_t^T: the value stored under k_t is moved toward v_t by beta_t
(the delta rule), instead of being added to whatever was stored there. Below, the same in rows (S^T, d_k x d_v).

Training runs the chunkwise form (Yang et al. 2024, sec. 3.2-3.3): within a chunk of C tokens starting from
state S, the pseudo-values u_t = beta_t (v_t - k_t S - sum_{s<t} (k_t . k_s) u_s) solve a unit lower-triangular
system, (I + tril(diag(beta) K K^T, -1)) U = diag(beta) (V - K S), so with the UT transform
T = (I + tril(diag(beta) K K^T, -1))^(-1) diag(beta), W = T K, U' = T V (all chunks at once, by triangular solves):
U = U' - W S, O = Q S + tril(Q K^T) U, and the next chunk starts from S + K^T U. Decoding runs the recurrence.
Each head's output is RMS-normalized before out_proj, as the paper's layer does. GQA/MQA: the query heads of a
group read their K/V head's state. Padding: a padded token has k = v = 0, so (I - beta k k^T) = I: it changes
nothing. attn.scale does not apply (q and k are unit vectors)."""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.linear_attention import key_valid
from blocklab.model.recurrent import RecurrentAttention, RotaryOption, float_at_least_32, grouped, padded_to_chunks


# attn.qk_activation: applied to q and k before their L2 norm. flash-linear-attention's DeltaNet layer takes SiLU by
# default (`qk_activation="silu"`, fla/layers/delta_net.py), the paper's Table 1 ablates it; none: the bare L2 norm.
# attn.v_activation: applied to v. That layer always takes SiLU there (`F.silu(self.v_proj(x))`, or its value
# convolution's activation='silu'); none: the bare projection, as runs saved before the option.
QK_ACTIVATIONS = {"silu": F.silu, "none": lambda t: t}


def ut_transform(k: Tensor, beta: Tensor, *rhs: Tensor) -> list[Tensor]:
    """T x for each x in rhs, T = (I + tril(diag(beta) K K^T, -1))^(-1) diag(beta), per chunk: k (..., C, dk),
    beta (..., C), each x (..., C, .)."""
    lower = (beta[..., :, None] * (k @ k.transpose(-2, -1))).tril(-1)
    system = lower + torch.eye(k.shape[-2], dtype=k.dtype, device=k.device)
    return [torch.linalg.solve_triangular(system, beta[..., None] * x, upper=False, unitriangular=True) for x in rhs]


def delta_chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, held: Tensor | None, chunk: int):
    """The chunkwise form (module docstring). q (B, H, G, T, dk), k (B, H, T, dk), v (B, H, T, dv), beta (B, H, T),
    held (B, H, dk, dv) or None -> (outputs (B, H, G, T, dv), final state (B, H, dk, dv))."""
    length = k.shape[-2]
    chunk = min(chunk, length)
    qc = padded_to_chunks(q, chunk)  # (B, H, G, N, C, dk)
    kc, vc = padded_to_chunks(k, chunk), padded_to_chunks(v, chunk)  # (B, H, N, C, .)
    bc = padded_to_chunks(beta, chunk, dim=-1)  # (B, H, N, C)
    w, u = ut_transform(kc, bc, kc, vc)
    scores = (qc @ kc[:, :, None].transpose(-2, -1)).tril()  # (B, H, G, N, C, C), s <= t
    state = held if held is not None else k.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1])
    outs = []
    # unbind, not indexing: each index's backward would write a zero tensor the size of the whole sequence
    for qn, kn, wn, un, sn in zip(qc.unbind(3), kc.unbind(2), w.unbind(2), u.unbind(2), scores.unbind(3)):
        pseudo = un - wn @ state  # (B, H, C, dv)
        outs.append(qn @ state[:, :, None] + sn @ pseudo[:, :, None])
        state = state + kn.transpose(-2, -1) @ pseudo
    return torch.stack(outs, dim=3).flatten(-3, -2)[..., :length, :], state


def delta_step(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, held: Tensor | None):
    """The recurrence for one token (rows): S <- S + beta k^T (v - k S); o = q S. q (B, H, G, 1, dk),
    k (B, H, 1, dk), v (B, H, 1, dv), beta (B, H, 1)."""
    state = held if held is not None else k.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1])
    state = state + beta[..., None] * k.transpose(-2, -1) @ (v - k @ state)
    return q @ state[:, :, None], state


def delta_weights(q: Tensor, k: Tensor, beta: Tensor) -> Tensor:
    """(B, H, G, T, T): o_t = sum_s w_ts v_s from an empty state, written out: tril(Q K^T) T (analysis)."""
    eye = torch.eye(k.shape[-2], dtype=k.dtype, device=k.device).expand(*k.shape[:2], -1, -1)
    (transform,) = ut_transform(k, beta, eye)
    return (q @ k[:, :, None].transpose(-2, -1)).tril() @ transform[:, :, None]


@ATTENTION_KINDS.register("deltanet")
class DeltaNet(RotaryOption, RecurrentAttention):
    """DeltaNet (module docstring). Options: chunk (tokens per chunk of the parallel form), rotary (RoPE on q and k;
    off, as in the paper: RotaryOption), qk_activation (silu, flash-linear-attention's default, or none: applied to
    q and k before their L2 norm) and v_activation (silu, as flash-linear-attention's layer always does, or none)."""

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 chunk: int = 32, rotary: bool = False, qk_activation: str = "silu", v_activation: str = "silu"):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias, chunk)
        self.beta_proj = nn.Linear(d_model, self.n_kv_heads, bias=bias)
        self.rotary, self.qk_activation, self.v_activation = rotary, qk_activation, v_activation

    @classmethod
    def old_run_options(cls, options: dict) -> dict:
        """A run saved before attn.rotary, attn.qk_activation and attn.v_activation rotated q and k, took no SiLU on q
        and k, and none on v (each key as saved where it was)."""
        options = super().old_run_options(options)
        return {**{"qk_activation": "none", "v_activation": "none"}, **options}

    @classmethod
    def errors(cls, cfg, options):
        errs = super().errors(cfg, options)
        if options.get("qk_activation", "silu") not in QK_ACTIVATIONS:
            errs.append(f"attn.qk_activation={options['qk_activation']!r} must be one of {sorted(QK_ACTIVATIONS)} "
                        "(silu: flash-linear-attention's default, before the L2 norm)")
        if options.get("v_activation", "silu") not in QK_ACTIVATIONS:
            errs.append(f"attn.v_activation={options['v_activation']!r} must be one of {sorted(QK_ACTIVATIONS)} "
                        "(silu: flash-linear-attention's layer applies it to v)")
        if cfg.attn.scale not in (None, "default") or cfg.attn.scale_factor != 1:
            errs.append("attn.scale and attn.scale_factor do not apply to attn.kind=deltanet (its queries and keys are "
                        "unit vectors); set attn.scale=null attn.scale_factor=1")
        return errs

    def token_inputs(self, x: Tensor) -> Tensor:
        """beta (B, H_kv, T) = sigmoid(x W_beta): how far each token moves the value stored under its key."""
        return torch.sigmoid(self.beta_proj(x)).transpose(1, 2)

    def attend(self, q, k, v, ctx, state):
        dtype = q.dtype
        with torch.autocast(q.device.type, enabled=False):
            q, k, v, beta = float_at_least_32(q, k, v, self.pending)
            q, k = QK_ACTIVATIONS[self.qk_activation](q), QK_ACTIVATIONS[self.qk_activation](k)
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            v = QK_ACTIVATIONS[self.v_activation](v)
            valid = key_valid(ctx, k.shape[2])
            if valid is not None:
                padding = ~valid[:, None, :, None]
                k, v = k.masked_fill(padding, 0.0), v.masked_fill(padding, 0.0)
            q = grouped(q, self.n_kv_heads)
            out = self.run_forms(q, k, v, beta, ctx, state, delta_weights, delta_step, delta_chunked)
        return self.normed(out.flatten(1, 2).to(dtype))
