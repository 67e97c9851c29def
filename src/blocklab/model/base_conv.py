"""The gated short convolution (`attn.kind=base_conv`): the BaseConv layers of Based (Arora et al. 2024, "Simple
linear attention language models balance the recall-throughput tradeoff", ICML, sec. 4 and app. E; from Zoology,
Arora et al. 2024, sec. 5), as the authors' LM code runs them (HazyResearch/based, based/models/mixers/convolution.py,
BaseConv, with kernel_size 3 and expand_proj 4 in train/configs/experiment/reference/based-360m.yaml):

    [u, g] = x W_in,    y = (silu(conv_K(u)) * g) W_out,

conv_K a depthwise causal convolution of width K over each channel of u (u_t mixed with its K-1 predecessors, zeros
before the first token and at padding), u and g of expand x d_model channels each. A token mixer with no attention: a
layer of a hybrid stack (attn.layers), beside Taylor and sliding-window layers (model/based.py). Zoology's MQAR
variant (zoology/mixers/base_conv.py) differs: no SiLU, no output projection, its input added back inside the layer.

It reuses attention's two projections: qkv_proj holds W_in as (no queries, u, g) (`projection('k')` is u's rows,
`projection('v')` g's), out_proj is W_out, so the init schemes treat it as they treat attention. Decoding keeps the
last K-1 inputs of u (short_conv's ConvState): fixed in size, and a cached step equals recomputation. Its
`last_weights` (analysis; not attention): per head (a slice of u's channels), the mean |tap| at each offset, over
the taps each token reaches, normalized to sum 1: where the layer reads from, not a softmax."""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.attention import ATTENTION_KINDS, Attention
from blocklab.model.linear_attention import is_positive_int, with_defaults
from blocklab.model.recurrent import recurrent_errors
from blocklab.model.short_conv import ConvState


def causal_conv(x: Tensor, weight: Tensor, valid: Tensor | None, state: ConvState | None) -> Tensor:
    """y_t = sum_j weight[:, 0, K-1-j] * x_{t-j} per channel: x (B, T, C) of the new tokens, weight (C, 1, K); x is 0
    before the first token and where valid (B, T) is False; `state` holds the last K-1 inputs between calls."""
    x = x if valid is None else x.masked_fill(~valid[..., None], 0.0)
    width = weight.shape[-1]
    held = state.inputs if state is not None and state.inputs is not None else \
        x.new_zeros(x.shape[0], width - 1, x.shape[2])
    seq = torch.cat((held.to(x.dtype), x), dim=1)
    if state is not None:
        state.inputs = seq[:, seq.shape[1] - (width - 1):]
    return F.conv1d(seq.transpose(1, 2), weight.to(x.dtype), groups=x.shape[2]).transpose(1, 2)


@ATTENTION_KINDS.register("base_conv")
class BaseConv(Attention):
    """The gated short convolution (module docstring). Options: kernel_size (K, 3 in the paper), expand (u and g have
    expand x d_model channels; the reference's expand_proj 4 gives 2)."""

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 kernel_size: int = 3, expand: int = 2):
        super().__init__(d_model, n_heads, None, scale, False, dropout, bias)
        inner = expand * d_model
        self.qkv_sizes = (0, inner, inner)  # no queries; u, then the gate g
        self.qkv_proj = nn.Linear(d_model, 2 * inner, bias=bias)
        self.out_proj = nn.Linear(inner, d_model, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(inner, 1, kernel_size))
        nn.init.kaiming_uniform_(self.conv_weight, a=5 ** 0.5)  # nn.Conv1d's own init, as the reference's

    @classmethod
    def uses_rotation(cls, options: dict) -> bool:
        return False

    @classmethod
    def errors(cls, cfg, options):
        errs = recurrent_errors(cls.registry_name, cfg, options)
        merged = with_defaults(cls.registry_name, options)
        for key, what in (("kernel_size", "the convolution's width"), ("expand", "u's channels per d_model")):
            if not is_positive_int(merged[key]):
                errs.append(f"attn.{key}={merged[key]!r} must be a positive integer ({what})")
        attn = cfg.attn
        unused = [f"attn.{key}={value!r}" for key, value, default in (
            ("n_kv_heads", attn.n_kv_heads, None), ("qk_norm", attn.qk_norm, False),
            ("short_conv", attn.short_conv, 0), ("scale", attn.scale, None), ("scale_factor", attn.scale_factor, 1.0))
            if value != default and not (key == "scale" and value == "default")]
        if unused:
            errs.append(f"{', '.join(unused)} do not apply to attn.kind=base_conv (no queries or keys; its "
                        f"convolution's width is attn.kernel_size): leave them at their defaults")
        return errs

    def state_bytes_per_token(self, element_size: int) -> int:
        return 0  # the last K-1 inputs: fixed in size

    def new_state(self) -> ConvState:
        return ConvState()

    def forward(self, x: Tensor, ctx, layer: int = 0, memory: Tensor | None = None) -> Tensor:
        u, gate = self.qkv_proj(x).split(self.qkv_sizes[1:], dim=-1)
        valid = None if ctx.k_valid is None else ctx.k_valid[:, -x.shape[1]:]
        state = None if ctx.cache is None else ctx.cache.state(layer, self.new_state)
        mixed = F.silu(causal_conv(u, self.conv_weight, valid, state)) * gate
        if ctx.need_weights:
            self.last_weights = self.tap_weights(x.shape[0], x.shape[1]).to(x.dtype)
        return self.out_proj(mixed)

    def tap_weights(self, batch: int, length: int) -> Tensor:
        """(B, H, T, T): per head, the mean |tap| at each offset back, normalized over the taps each token reaches."""
        width = self.conv_weight.shape[-1]
        taps = self.conv_weight.detach().abs()[:, 0].unflatten(0, (self.n_heads, -1)).mean(1).flip(-1)  # (H, K): back
        index = torch.arange(length, device=taps.device)
        back = index[:, None] - index[None, :]
        reach = (back >= 0) & (back < width)
        weights = torch.where(reach, taps[:, back.clamp(0, width - 1)], torch.zeros((), device=taps.device))
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
        return weights.expand(batch, -1, -1, -1)
