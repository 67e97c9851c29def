"""A Transformer layer. The block owns where normalization sits around each sublayer."""
from torch import Tensor, nn

from blocklab.model.attention import Attention, AttentionContext
from blocklab.model.ffn import FFN, dropout_layer
from blocklab.model.norm import build_norm


class Residual(nn.Module):
    """Wraps one sublayer f with its norm placement:
    pre: x + f(LN(x)) | post: LN(x + f(x)) | sandwich: x + LN2(f(LN1(x))) | deepnorm: LN(alpha x + f(x)).
    With residual=False the skip term is dropped and only the normalized branch remains."""

    def __init__(self, sublayer: nn.Module, placement: str, norm_type: str, dim: int, eps: float,
                 bias: bool, dropout: float, residual: bool = True, alpha: float = 1.0):
        super().__init__()
        self.sublayer, self.placement, self.residual, self.alpha = sublayer, placement, residual, alpha
        # Absent parts are None rather than nn.Identity: a module call per sublayer is ~5% of a decoding step.
        self.norm_in = build_norm(norm_type, dim, eps, bias) if placement in ("pre", "sandwich") else None
        self.norm_out = build_norm(norm_type, dim, eps, bias) if placement != "pre" else None
        self.dropout = dropout_layer(dropout)
        # post/deepnorm normalize the sum; sandwich normalizes the branch alone.
        self.norm_after_sum = placement in ("post", "deepnorm")
        self.plain_pre = placement == "pre" and residual and alpha == 1.0 and self.dropout is None

    def forward(self, x: Tensor, *args) -> Tensor:
        if self.plain_pre:  # the common case, without the general path's checks (~1.5% of a decoding step)
            return x + self.sublayer(self.norm_in(x), *args)
        branch = self.sublayer(x if self.norm_in is None else self.norm_in(x), *args)
        if self.dropout is not None:
            branch = self.dropout(branch)
        if self.norm_out is not None and not self.norm_after_sum:
            branch = self.norm_out(branch)
        # alpha * x costs a multiply (and its backward) per sublayer even at 1.0, the usual value.
        skip = x if self.alpha == 1.0 else self.alpha * x
        out = skip + branch if self.residual else branch
        return self.norm_out(out) if self.norm_after_sum else out


class Block(nn.Module):
    """Self-attention, optionally cross-attention to an encoder's output, then the FFN."""

    def __init__(self, cfg, layer: int, cross: bool = False):
        super().__init__()
        self.layer = layer
        wrap = dict(placement=cfg.norm.placement, norm_type=cfg.norm.type, dim=cfg.d_model, eps=cfg.norm.eps,
                    bias=cfg.bias, dropout=cfg.dropout, residual=cfg.residual, alpha=cfg.residual_alpha)
        self.attn = self._attention(cfg)
        self.attn_residual = Residual(self.attn, **wrap)
        self.cross_attn = self._attention(cfg) if cross else None
        self.cross_residual = Residual(self.cross_attn, **wrap) if cross else None
        self.ffn = FFN(cfg.d_model, cfg.d_ff, cfg.act.name, cfg.act.match_params, cfg.dropout, cfg.bias) if cfg.ffn else None
        self.ffn_residual = Residual(self.ffn, **wrap) if cfg.ffn else None

    @staticmethod
    def _attention(cfg) -> Attention:
        return Attention(cfg.d_model, cfg.n_heads, cfg.attn.n_kv_heads, cfg.attn.scale_value(cfg.d_head),
                         cfg.attn.qk_norm, cfg.dropout, cfg.bias)

    def forward(self, x: Tensor, ctx: AttentionContext, cross_ctx: AttentionContext | None = None,
                memory: Tensor | None = None) -> Tensor:
        x = self.attn_residual(x, ctx, self.layer)
        if self.cross_residual is not None:
            x = self.cross_residual(x, cross_ctx, self.layer, memory)
        return self.ffn_residual(x) if self.ffn_residual is not None else x
