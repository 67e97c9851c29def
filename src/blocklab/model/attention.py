"""Attention kinds behind one interface, in a registry (`attn.kind`).

Every kind projects x to queries, keys and values (W_q, W_k, W_v stacked in one matrix, as
GPT-2's c_attn) and back through out_proj; a kind defines how queries meet keys (`attend`) and
what it keeps between decoding steps (`new_state`, a cache.LayerState). `softmax` covers MHA,
GQA and MQA (through n_kv_heads), causal or not, with a sparse pattern (patterns.py); its hot path is
F.scaled_dot_product_attention (or the pattern's blocked kernel), and an explicit softmax path runs
only when attention weights are asked for (analysis). Two options act on every kind: `attn.output_gate` (a sigmoid
gate on each head's output, OutputGate) and `model.value_residual` (later layers mix in the first layer's values,
ValueResidual)."""
import inspect
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blocklab.model.cache import DecodingCache, KVState, LayerState
from blocklab.model.mask import AttentionContext
from blocklab.model.patterns import ATTENTION_PATTERNS
from blocklab.model.short_conv import ConvState, ShortConv
from blocklab.registry import Registry

# The constructor arguments every kind gets from the model config; the rest are the kind's own options.
COMMON_ARGS = ("d_model", "n_heads", "n_kv_heads", "scale", "qk_norm", "dropout", "bias")
# `layer` (the block's index) is given by keyword to a kind whose constructor takes it (diff: lambda_init by depth).
ATTENTION_KINDS: Registry = Registry("attn.kind", framework_args=(*COMMON_ARGS, "layer"))


class OutputGate(nn.Module):
    """`attn.output_gate`: Qiu et al. 2025, "Gated Attention for Large Language Models" (arXiv 2505.06708), the
    gate at position G1 (after the attention output, before W_O): Y' = Y * sigmoid(X W_theta), X the attention's
    input (the block's normed input, pre-norm), one gate per head (headwise) or per channel (elementwise). The
    reference (qiuzh20/gated_attention, modeling_qwen3.py) folds W_theta into q_proj's rows; here it is its own
    projection, the same function (tests/model/test_output_gate.py maps the reference's weights onto it)."""

    def __init__(self, d_model: int, heads: int, width: int, elementwise: bool, bias: bool):
        super().__init__()
        self.heads, self.width = heads, width if elementwise else 1
        self.proj = nn.Linear(d_model, heads * self.width, bias=bias)

    def forward(self, x: Tensor, out: Tensor) -> Tensor:
        """x (B, T, d_model), out (B, T, heads, width) -> out gated."""
        return out * torch.sigmoid(self.proj(x)).unflatten(-1, (self.heads, self.width))


class ValueResidual(nn.Module):
    """`model.value_residual`: Zhou et al. 2024, "Value Residual Learning For Alleviating Attention Concentration
    In Transformers" (ResFormer, arXiv 2410.17897): every layer after the first mixes in the first layer's values,
    V_n <- lambda V_n + (1 - lambda) V_1, on the projected values before the head split. lambda = 0.5 fixed, as the
    reference (Zcchill/Value-Residual-Learning, src/modeling/modeling_llama_resformer.py: 0.5*V_1 + 0.5*V_n);
    `model.value_residual_learned`: a learned scalar per layer starting at 0.5, as modded-nanogpt's
    `v = (1 - lamb) * v + lamb * v1` (its lamb is our 1 - lambda). The first layer leaves its values in the pass's
    context, so decoding with a cache mixes the new tokens' values as recomputation does."""

    def __init__(self, first: bool, learned: bool):
        super().__init__()
        self.first = first
        self.weight = nn.Parameter(torch.tensor(0.5)) if learned and not first else None

    def forward(self, v: Tensor, ctx: AttentionContext) -> Tensor:
        if self.first:
            ctx.first_values = v
            return v
        weight = 0.5 if self.weight is None else self.weight
        return weight * v + (1 - weight) * ctx.first_values


class Attention(nn.Module):
    """What every kind shares: the stacked q/k/v projection in, out_proj back, optional RMSNorm on each
    head's queries and keys, the position scheme's rotation. Subclasses implement `attend`, and
    `new_state` if they can decode step by step. Options of a kind are its extra constructor keywords;
    `errors` and `label` are its constraints and the name results record for it."""

    honours_patterns = False  # True: it attends only where attn.pattern allows (the context's mask or blocked pattern)
    # True: it soft-caps its softmax scores under attn.softcap = c > 0, each score s = scale q.k becoming
    # c tanh(s / c) before the mask (Gemma 2's attn_logits_soft_cap, 50 there; model.transformer.softcap cites it).
    # The fused kernel cannot apply it, so attention then takes the explicit path, whose cost the attention bench
    # measures (`python -m blocklab.bench attention`, its explicit rows).
    caps_scores = False
    softcap = 0.0  # attn.softcap, set by build_attention
    mixes_values = True  # model.value_residual applies: its values are the 'v' rows of qkv_proj (not MLA's latent)
    temperature = True  # self.scale is a softmax temperature (param=mup sets it to 1/d); False: the kind has none

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, scale: float | None = None,
                 qk_norm: bool = False, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.d_head = d_model // n_heads
        self.scale = 1 / math.sqrt(self.d_head) if scale is None else scale
        self.dropout = dropout  # causality, windows and padding arrive as the context's mask
        # W_q, W_k and W_v stacked in one matrix: one matmul instead of three (`python -m blocklab.bench step`).
        self.qkv_sizes = (n_heads * self.d_head, self.n_kv_heads * self.d_head, self.n_kv_heads * self.d_head)
        self.qkv_proj = nn.Linear(d_model, sum(self.qkv_sizes), bias=bias)
        self.out_proj = nn.Linear(n_heads * self.d_head, d_model, bias=bias)
        self.q_norm = nn.RMSNorm(self.d_head) if qk_norm else None  # None, not Identity: a module call less
        self.k_norm = nn.RMSNorm(self.d_head) if qk_norm else None
        self.short_conv: ShortConv | None = None  # attn.short_conv, set by build_attention for every kind
        self.output_gate: OutputGate | None = None  # attn.output_gate, set by build_attention
        self.value_residual: ValueResidual | None = None  # model.value_residual, set by build_attention
        self.last_weights: Tensor | None = None
        # With need_weights, a kind with softmax scores also keeps them, (B, H, Tq, Tk) after any soft-cap and
        # before the mask: the diagnostics' maximum attention logit (analysis/probe.py)
        self.last_scores: Tensor | None = None

    @property
    def qk_dim(self) -> int:
        """The width of each query-key dot product, which the default scale is 1/sqrt of."""
        return self.d_head

    @classmethod
    def label(cls, cfg) -> str:
        """What results.json records as `choices.attn` for this kind under `cfg` (a ModelConfig)."""
        return cls.registry_name

    @classmethod
    def derived_options(cls, cfg) -> dict:
        """Values of options left null ('derive it') in the config, from the model config (a ModelConfig)."""
        return {}

    @classmethod
    def errors(cls, cfg, options: dict) -> list[str]:
        """Constraints on the model config and this kind's options, one line each naming key and fix."""
        return []

    @classmethod
    def uses_rotation(cls, options: dict) -> bool:
        """Whether the kind applies a rotary position scheme (RoPE) where one is chosen (results: choices.positions)."""
        return True

    def state_bytes_per_token(self, element_size: int) -> int:
        """How many bytes this layer's decoding state grows by per token (0: a fixed-size state)."""
        raise NotImplementedError

    def new_state(self) -> LayerState:
        """An empty decoding state for this layer (what it keeps between decoding steps)."""
        raise NotImplementedError(f"attn.kind={self.registry_name} cannot decode step by step")

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """The position scheme's rotation (RoPE) of the new queries and keys, before `attend`. A kind that
        applies it elsewhere (linear attention: to its feature-mapped queries and keys) overrides this."""
        return ctx.position_scheme.rotate(q, k, ctx.positions)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext, state: LayerState | None) -> Tensor:
        """(B, H, Tq, d_head) queries, (B, H_kv, Tk, d_head) keys and values of the new tokens (and the
        state held from earlier steps, if decoding) -> (B, H, Tq, d_head). When `ctx.need_weights`
        (analysis only), also set `self.last_weights` to the (B, H, Tq, Tk) weights each query gave each key."""
        raise NotImplementedError

    def projection(self, part: str) -> tuple[Tensor, Tensor | None]:
        """(weight, bias) of W_q, W_k or W_v ('q', 'k', 'v'): views of their rows of qkv_proj."""
        index = "qkv".index(part)
        return self._rows(sum(self.qkv_sizes[:index]), self.qkv_sizes[index])

    def _rows(self, start: int, size: int) -> tuple[Tensor, Tensor | None]:
        bias = self.qkv_proj.bias
        return self.qkv_proj.weight.narrow(0, start, size), None if bias is None else bias.narrow(0, start, size)

    def _heads(self, x: Tensor) -> Tensor:
        """(B, T, n * d_head) -> (B, n, T, d_head)"""
        batch, length, _ = x.shape
        return x.view(batch, length, -1, self.d_head).transpose(1, 2)

    def forward(self, x: Tensor, ctx: AttentionContext, layer: int = 0, memory: Tensor | None = None) -> Tensor:
        """Self-attention over x, or cross-attention from x to `memory` (the encoder output)."""
        state = None
        if memory is None:
            # Split before the head view: the backward then joins the three gradients straight into
            # (B, T, .) instead of also copying a transposed (B, T, heads, d_head).
            qkv = self.qkv_proj(x)
            if self.short_conv is not None:
                conv_state = None if ctx.cache is None else ctx.cache.state(("conv", layer), ConvState)
                qkv = self.short_conv(qkv, None if ctx.k_valid is None else ctx.k_valid[:, -x.shape[1]:], conv_state)
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
            if self.value_residual is not None:
                v = self.value_residual(v, ctx)
            q, k, v = self._heads(q), self._heads(k), self._value_heads(v)
            q, k = _normed(q, self.q_norm), _normed(k, self.k_norm)
            q, k = self.rotate(q, k, ctx)
            if ctx.cache is not None:
                state = ctx.cache.state(layer, self.new_state)
        else:
            q = _normed(self._heads(F.linear(x, *self.projection("q"))), self.q_norm)
            k, v = self._memory_kv(memory, ctx.cache, layer)
        return self.output(x, self.attend(q, k, v, ctx, state))

    @property
    def out_heads(self) -> int:
        """How many heads `attend` returns (the output gate's heads)."""
        return self.n_heads

    def _value_heads(self, v: Tensor) -> Tensor:
        """The values' head view; a kind whose value heads differ from its key heads (diff) overrides it."""
        return self._heads(v)

    def output(self, x: Tensor, out: Tensor) -> Tensor:
        """(B, heads, T, width) head outputs -> out_proj of their concatenation, gated first where attn.output_gate
        is set (from x, the attention's input)."""
        out = out.transpose(1, 2)
        if self.output_gate is not None:
            out = self.output_gate(x, out)
        return self.out_proj(out.flatten(2))

    def _memory_kv(self, memory: Tensor, cache: DecodingCache | None, layer: int) -> tuple[Tensor, Tensor]:
        if cache is not None and layer in cache.cross:
            return cache.cross[layer]
        q_size, k_size, v_size = self.qkv_sizes
        kv = F.linear(memory, *self._rows(q_size, k_size + v_size))
        k, v = kv.chunk(2, dim=-1)
        k, v = _normed(self._heads(k), self.k_norm), self._value_heads(v)
        if cache is not None:
            cache.cross[layer] = (k, v)
        return k, v


@ATTENTION_KINDS.register("softmax")
class SoftmaxAttention(Attention):
    """softmax(scale q k^T + mask) v per head (Vaswani et al. 2017), with MHA, GQA (Ainslie et al. 2023)
    and MQA (Shazeer 2019) through n_kv_heads, and any sparse pattern (attn.pattern). Decoding keeps
    every key and value (a KV cache), or the pattern's reach back."""

    honours_patterns = True

    caps_scores = True

    @classmethod
    def label(cls, cfg) -> str:
        pattern = ATTENTION_PATTERNS.get(cfg.attn.pattern_name)
        if pattern is not None and pattern.sparse:
            return pattern.label or pattern.registry_name
        kv = cfg.attn.n_kv_heads or cfg.n_heads
        return "mha" if kv == cfg.n_heads else "mqa" if kv == 1 else "gqa"

    def state_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.n_kv_heads * self.d_head * element_size

    def new_state(self) -> KVState:
        return KVState()

    def attend(self, q, k, v, ctx, state):
        if state is not None:
            k, v = state.extend(k, v)
        if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # Mixed precision: the projections run in bfloat16, attention itself in float32, because
            # torch's bfloat16 SDPA on CPU is slower than its float32 kernel (`python -m blocklab.bench step`).
            with torch.autocast("cpu", enabled=False):
                return self._attend(q.float(), k.float(), v.float(), ctx)
        return self._attend(q, k, v, ctx)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: AttentionContext) -> Tensor:
        """softmax(scale q k^T + mask) v per head: (B, H, Tq, d_head)."""
        dropout = self.dropout if self.training else 0.0
        if ctx.need_weights or self.softcap:
            y, weights, scores = self.explicit(q, k, v, ctx.mask, ctx.is_causal, dropout)
            if ctx.need_weights:
                self.last_weights, self.last_scores = weights, scores
            return y
        if ctx.blocked is not None:  # a sparse pattern that skips what it masks out
            return ctx.blocked.attend(q, k, v, ctx.is_causal, self.scale, dropout)
        # The mask must share q's dtype: torch's CPU SDPA silently mis-reads a float32 mask with
        # float64 q/k/v from length 16 on (masks are built in float32; .to is free when they match).
        mask = None if ctx.mask is None else ctx.mask.to(q.dtype)
        if mask is not None and mask.is_cuda:
            # CUDA's memory-efficient kernel needs the mask's last dimension contiguous; T5's and FIRE's biases are
            # permuted views, which sent SDPA to its math path (`python -m blocklab.bench kernels`).
            mask = mask.contiguous()
        if mask is not None and mask.requires_grad and dropout == 0.0 and torch.is_grad_enabled():
            return LearnedBiasAttention.apply(q, k, v, mask, self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=ctx.is_causal, dropout_p=dropout,
                                              scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads)

    def explicit(self, q, k, v, mask, is_causal, dropout) -> tuple[Tensor, Tensor, Tensor]:
        """softmax(q k^T * scale + mask) v, written out so the weights (and the scores, soft-capped, before the
        mask) can be returned."""
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        capped = scores
        if is_causal:
            tq, tk = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
        if mask is not None:
            scores = scores + mask
        weights = scores.softmax(dim=-1)
        return F.dropout(weights, dropout) @ v, weights, capped


def build_attention(cfg, layer: int = 0, cross: bool = False) -> Attention:
    """The configured kind for layer `layer` of a ModelConfig (cross: the decoder's cross-attention, which has no
    value residual)."""
    kind = ATTENTION_KINDS[cfg.attn.kind]
    options = {**kind.derived_options(cfg), **{k: v for k, v in cfg.attn.options.items() if v is not None}}
    if "layer" in inspect.signature(kind).parameters:
        options["layer"] = layer
    attention = kind(cfg.d_model, cfg.n_heads, cfg.attn.n_kv_heads, cfg.attn.scale_value(cfg.d_head),
                     cfg.attn.qk_norm, cfg.dropout, cfg.bias, **options)
    if attention.temperature and cfg.attn.scale in (None, "default"):  # the kind's default scale: param's to set
        attention.scale = cfg.param.rule().attention_scale(attention.scale, attention.qk_dim)
    if cfg.attn.short_conv:
        attention.short_conv = ShortConv(sum(attention.qkv_sizes), cfg.attn.short_conv)
    attention.softcap = float(cfg.attn.softcap)
    gate = cfg.attn.output_gate
    if gate != "none":
        heads = attention.out_heads
        attention.output_gate = OutputGate(cfg.d_model, heads, attention.out_proj.in_features // heads,
                                           gate == "elementwise", cfg.bias)
    if cfg.value_residual and not cross:
        attention.value_residual = ValueResidual(first=layer == 0, learned=cfg.value_residual_learned)
    return attention


def _normed(x: Tensor, norm: nn.Module | None) -> Tensor:
    return x if norm is None else norm(x)


class LearnedBiasAttention(torch.autograd.Function):
    """SDPA with a float mask that is trained (T5's bias). Given a mask that needs gradients, torch's
    CPU SDPA falls back to its unfused math path, whose empty-row checks (isneginf, all, where) and
    copies are slow (`python -m blocklab.bench step`, t5_bias vs none). Here the forward is SDPA's fused kernel with the
    mask as a constant, and the backward is softmax attention's gradient written out: with
    P = softmax(S), S = scale q k^T + mask, dS = P * (dP - rowsum(dO * O)) is also the mask's gradient.
    Only without dropout (the fused forward's dropout pattern cannot be replayed); every query sees
    at least one key (build_mask guarantees it), so no softmax row is empty."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=None)
    def forward(ctx, q, k, v, mask, scale):
        # detached: SDPA picks its kernel by requires_grad, even where autograd is off as here
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.detach(), scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        ctx.save_for_backward(q, k, v, mask, out)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")  # the backward runs in the forward's precision (float32), not an outer autocast's
    def backward(ctx, grad_out):
        q, k, v, mask, out = ctx.saved_tensors
        group = q.shape[1] // k.shape[1]  # query heads per K/V head (GQA/MQA)
        k_all, v_all = (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        # In place where a temporary is not needed again: each is a (B, H, T, T) pass saved.
        probs = torch.softmax((q @ k_all.transpose(-2, -1)).mul_(ctx.scale).add_(mask), dim=-1)
        grad_probs = grad_out @ v_all.transpose(-2, -1)
        grad_scores = grad_probs.sub_((grad_out * out).sum(-1, keepdim=True)).mul_(probs)
        grad_q = (grad_scores @ k_all).mul_(ctx.scale)
        grad_k = (grad_scores.transpose(-2, -1) @ q).mul_(ctx.scale)
        grad_v = probs.transpose(-2, -1) @ grad_out
        if group > 1:  # each K/V head served `group` query heads
            grad_k, grad_v = (g.unflatten(1, (-1, group)).sum(2) for g in (grad_k, grad_v))
        return grad_q, grad_k, grad_v, grad_scores.sum_to_size(mask.shape), None  # mask may be broadcast

