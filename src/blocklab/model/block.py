"""A Transformer layer. The block owns where normalization sits around each sublayer."""
import torch
from torch import Tensor, nn

from blocklab.model.attention import build_attention
from blocklab.model.mask import AttentionContext
from blocklab.model.ffn import build_ffn, dropout_layer
from blocklab.model.norm import PLACEMENTS, Placement, build_norm, is_masked


class Residual(nn.Module):
    """Wraps one sublayer f with its norm placement (norm.PLACEMENTS says where the norms sit).
    With residual=False the skip term is dropped and only the normalized branch remains. `gate`, if
    set, is a learned scalar on the branch starting at that value (ReZero's alpha, Fixup's multiplier).
    A norm whose statistics span tokens (BatchNorm) is given the padding mask `valid`."""

    def __init__(self, sublayer: nn.Module, placement: Placement, norm_type: str, dim: int, eps: float,
                 bias: bool, dropout: float, residual: bool = True, alpha: float = 1.0, affine: bool = True,
                 gate: float | None = None, norm_options: dict | None = None):
        super().__init__()
        self.sublayer, self.residual, self.alpha = sublayer, residual, alpha
        # Absent parts are None rather than nn.Identity: a module call per sublayer costs decoding time.
        options = norm_options or {}
        self.norm_in = build_norm(norm_type, dim, eps, bias, affine, **options) if placement.norm_in else None
        self.norm_out = build_norm(norm_type, dim, eps, bias, affine, **options) if placement.norm_out else None
        self.masked = is_masked(self.norm_in) or is_masked(self.norm_out)
        self.gate = None if gate is None else nn.Parameter(torch.tensor(float(gate)))
        self.dropout = dropout_layer(dropout)
        self.norm_after_sum = placement.norm_after_sum
        self.plain_pre = (self.norm_in is not None and self.norm_out is None and residual and alpha == 1.0
                          and self.dropout is None and self.gate is None and not self.masked)

    def _norm(self, norm: nn.Module, x: Tensor, valid: Tensor | None) -> Tensor:
        return norm(x, valid) if self.masked else norm(x)

    def forward(self, x: Tensor, *args, valid: Tensor | None = None) -> Tensor:
        if self.plain_pre:  # the common case, x + f(LN(x)), without the general path's checks
            return x + self.sublayer(self.norm_in(x), *args)
        branch = self.sublayer(x if self.norm_in is None else self._norm(self.norm_in, x, valid), *args)
        if self.dropout is not None:
            branch = self.dropout(branch)
        if self.norm_out is not None and not self.norm_after_sum:
            branch = self._norm(self.norm_out, branch, valid)
        if self.gate is not None:
            branch = self.gate * branch
        # alpha * x costs a multiply (and its backward) per sublayer even at 1.0, the usual value.
        skip = x if self.alpha == 1.0 else self.alpha * x
        out = skip + branch if self.residual else branch
        return self._norm(self.norm_out, out, valid) if self.norm_after_sum and self.norm_out is not None else out


def token_valid(ctx: AttentionContext, length: int) -> Tensor | None:
    """The padding mask (B, T) of the pass's `length` new tokens, from the context's key mask, which
    ends with them (None: no padding)."""
    return None if ctx.k_valid is None else ctx.k_valid[:, -length:]


class Block(nn.Module):
    """Self-attention, optionally cross-attention to an encoder's output, then the FFN."""

    def __init__(self, cfg, layer: int, cross: bool = False):
        super().__init__()
        self.layer = layer
        cfg = cfg.layer(layer)  # its attention kind, in a hybrid stack (attn.layers)
        wrap = dict(placement=PLACEMENTS[cfg.norm.placement], norm_type=cfg.norm.type, dim=cfg.d_model, eps=cfg.norm.eps,
                    bias=cfg.bias, dropout=cfg.dropout, residual=cfg.residual, alpha=cfg.residual_alpha,
                    affine=cfg.norm.affine, gate=cfg.branch_gate, norm_options=cfg.norm.options)
        self.attn = build_attention(cfg, layer)
        self.attn_residual = Residual(self.attn, **wrap)
        self.cross_attn = build_attention(cfg, layer, cross=True) if cross else None
        self.cross_residual = Residual(self.cross_attn, **wrap) if cross else None
        self.ffn = build_ffn(cfg) if cfg.ffn else None
        self.ffn_residual = Residual(self.ffn, **wrap) if cfg.ffn else None

    def forward(self, x: Tensor, ctx: AttentionContext, cross_ctx: AttentionContext | None = None,
                memory: Tensor | None = None) -> Tensor:
        # Only a norm with statistics over tokens reads the padding mask; the rest never build it.
        valid = token_valid(ctx, x.shape[1]) if self.attn_residual.masked else None
        x = self.attn_residual(x, ctx, self.layer, valid=valid)
        if self.cross_residual is not None:
            x = self.cross_residual(x, cross_ctx, self.layer, memory, valid=valid)
        return self.ffn_residual(x, valid=valid) if self.ffn_residual is not None else x
