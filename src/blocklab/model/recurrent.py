"""What the recurrent attention kinds (gla, deltanet, based) share: a causal recurrence whose decoding state has a
fixed size, so each declares state_bytes_per_token 0 and keeps a `FixedState` in the decoding cache in place of keys.

Each is causal only (the recurrence sums the past), so a bidirectional model (attn.causal=false, an encoder, an
encoder-decoder's encoder and cross-attention) is a config error, as is an additive position bias (it cannot be
folded into a running state). Per-token quantities computed from the layer input x rather than from q, k, v (GLA's
decay, DeltaNet's beta) come from `token_inputs(x)`, which `forward` hands to `attend` as `self.pending`."""
import torch
from torch import Tensor, nn

from blocklab.model.attention import Attention
from blocklab.model.linear_attention import common_errors, is_positive_int, with_defaults
from blocklab.model.architectures import ARCHITECTURES


def recurrent_errors(kind: str, cfg, options: dict) -> list[str]:
    errs = common_errors(kind, cfg)
    arch = ARCHITECTURES.get(cfg.arch)
    if not cfg.attn.causal:
        errs.append(f"attn.causal=false: attn.kind={kind} is a causal recurrence (its state sums the past only); "
                    f"set attn.causal=true or use another kind")
    elif arch is not None and (arch.is_encoder_only or arch.is_encoder_decoder):
        errs.append(f"model.arch={cfg.arch} needs bidirectional attention (its encoder) that attn.kind={kind}, a causal "
                    f"recurrence, cannot give; use model.arch=decoder or another kind")
    chunk = with_defaults(kind, options).get("chunk")
    if chunk is not None and not is_positive_int(chunk):
        errs.append(f"attn.chunk={chunk!r} must be a positive integer (tokens per chunk of the parallel form)")
    return errs


class FixedState:
    """A recurrent kind's decoding state: named tensors of a size fixed at the first step (the running matrix S;
    Based's window of keys). It holds no keys a pattern could drop."""

    def __init__(self):
        self.tensors: dict[str, Tensor] = {}

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def drop_oldest(self, count: int) -> None:
        raise ValueError("a recurrent state holds no keys to forget; recurrent kinds take no window (attn.window=null)")


def float_at_least_32(*tensors: Tensor) -> list[Tensor]:
    """The recurrences in float32 at least (float64 stays), whatever autocast says: long products of decays and
    sums of outer products lose their small terms in bfloat16."""
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return [t.to(dtype) for t in tensors]


class RecurrentAttention(Attention):
    """Base of the kinds above. Option `chunk`: tokens per chunk of the parallel (training) form; any value gives
    the same result. `head_norm`: RMSNorm on each head's output before out_proj, as GLA (sec. 4.4, after RetNet)
    and DeltaNet put it, since their outputs are unnormalized sums."""

    head_norm = True

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 chunk: int = 32):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias)
        self.chunk = chunk
        self.out_norm = nn.RMSNorm(self.d_head) if self.head_norm else None
        self.pending: Tensor | None = None

    @classmethod
    def errors(cls, cfg, options):
        return recurrent_errors(cls.registry_name, cfg, options)

    def state_bytes_per_token(self, element_size: int) -> int:
        return 0  # a fixed-size state

    def new_state(self) -> FixedState:
        return FixedState()

    def token_inputs(self, x: Tensor) -> Tensor | None:
        """Per-token quantities the kind computes from the layer input x (B, T, d_model); None: none."""
        return None

    def forward(self, x, ctx, layer=0, memory=None):
        self.pending = self.token_inputs(x)
        try:
            return super().forward(x, ctx, layer, memory)
        finally:
            self.pending = None

    def run_forms(self, q, k, v, gate, ctx, state, weights_form, step_form, chunked_form) -> Tensor:
        """The kind's output from grouped queries: the explicit weights when they are asked for (analysis), one
        recurrent step while decoding a single token, else the chunked parallel form; the state carried on."""
        held = None if state is None else state.get("S")
        if ctx.need_weights:
            if state is not None:
                raise ValueError("attention weights are not available while decoding with a recurrent state")
            weights = weights_form(q, k, gate)
            self.last_weights = weights.flatten(1, 2)
            return weights @ v[:, :, None]
        if state is not None and k.shape[2] == 1:
            out, final = step_form(q, k, v, gate, held)
        else:
            out, final = chunked_form(q, k, v, gate, held, self.chunk)
        if state is not None:
            state.tensors["S"] = final
        return out

    def normed(self, out: Tensor) -> Tensor:
        """(B, H, T, d_head) outputs, each head's RMS-normalized."""
        return out if self.out_norm is None else self.out_norm(out)


class RotaryOption:
    """attn.rotary for GLA and DeltaNet: RoPE on q and k, off by default. Neither paper, nor flash-linear-attention's
    layers, nor Zoology's MQAR models give these kinds positions (their decay and delta rule order the tokens), so
    under pos=rope the kind skips the rotation unless asked, and results.json's `choices.positions` says `none`. A
    run saved before the option rotated them (`old_run_options`)."""

    rotary = False

    def rotate(self, q, k, ctx):
        return super().rotate(q, k, ctx) if self.rotary else (q, k)

    @classmethod
    def uses_rotation(cls, options: dict) -> bool:
        return bool(options.get("rotary", False))

    @classmethod
    def old_run_options(cls, options: dict) -> dict:
        return options if "rotary" in options else {**options, "rotary": True}


def grouped(q: Tensor, n_kv_heads: int) -> Tensor:
    """(B, H, T, d) queries -> (B, H_kv, G, T, d): the query heads that share each K/V head's state."""
    return q.unflatten(1, (n_kv_heads, -1))


def padded_to_chunks(x: Tensor, chunk: int, dim: int = -2) -> Tensor:
    """x with zeros appended along `dim` to a multiple of chunk, split there into (chunks, chunk)."""
    length = x.shape[dim]
    pad = -length % chunk
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat((x, x.new_zeros(shape)), dim=dim)
    return x.unflatten(dim, (-1, chunk))
