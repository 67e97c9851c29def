"""Kernelized attention (`attn.kind` linear and performer): softmax's exp(q.k) replaced by phi(q).phi(k)
with a positive feature map phi, so the sums over keys factor out of the queries (Katharopoulos et al.
2020, "Transformers are RNNs", eq. 4-6):

    y_i = phi(q_i)^T S_i / phi(q_i)^T z_i,    S_i = sum_j phi(k_j) v_j^T,    z_i = sum_j phi(k_j)

over every key j (non-causal: the global sums), or over j <= i (causal, eq. 8-9: S and z are prefix
sums, so decoding is an RNN whose state S (m x d_head) and z (m) per K/V head has a fixed size).

Training runs the parallel form. Causal prefix sums go chunk by chunk: within a chunk of C tokens the
masked quadratic form (phi(Q) phi(K)^T * lower triangle) V, across chunks the sums S, z of the chunks
before; time O(T C m d), memory linear in T (T/C states of m x d). Decoding keeps a RunningState (S, z)
in place of the KV cache. The subclasses define phi: `linear` elu(x)+1, `performer` FAVOR+.

Common to both: an additive position bias (ALiBi, T5) cannot be factorized into phi(q).phi(k), so it is
a config error, and so are a window or a sparse pattern (softmax masks: these kinds do not honour
patterns, and a running state cannot drop keys). Padded keys get phi(k) = 0 and v = 0: they contribute nothing. No attention dropout: the
weights are never formed (model.dropout still applies to embeddings and residual branches). GQA/MQA:
the query heads of a group share their K/V head's features and state. The sums run in float32 at
least, whatever autocast says: low-precision prefix sums over long sequences lose the small terms."""
import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from blocklab.model.attention import ATTENTION_KINDS, Attention
from blocklab.model.mask import AttentionContext
from blocklab.model.position import POSITION_SCHEMES
from blocklab.model.meta import counting


def at_least_float32(attend):
    """Run an `attend` with autocast off and q, k, v in float32 (or float64); the output in q's dtype."""
    @functools.wraps(attend)
    def wrapper(self, q, k, v, ctx, state):
        dtype = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            return attend(self, q.to(dtype), k.to(dtype), v.to(dtype), ctx, state).to(q.dtype)
    return wrapper


def key_valid(ctx: AttentionContext, count: int) -> Tensor | None:
    """(B, count), False at the padded keys among the `count` newest; None when none is padding. A
    self-attention context carries it as k_valid; a cross-attention one only in its (B, 1, 1, S) mask,
    0 at real keys and -inf at padding (cross-attention contexts carry no key positions)."""
    if ctx.k_valid is not None:
        return ctx.k_valid[:, -count:]
    if ctx.k_positions is None and ctx.mask is not None:
        return ctx.mask[:, 0, 0, -count:] == 0
    return None


def common_errors(kind: str, cfg) -> list[str]:
    """What no kind that replaces softmax's score matrix can honour: an additive bias. (A window or sparse
    pattern the config refuses for every kind that does not honour patterns, as these do not.)"""
    if cfg.pos.name in POSITION_SCHEMES and POSITION_SCHEMES[cfg.pos.name].adds_bias():
        return [f"pos={cfg.pos.name} adds a bias to every score, which attn.kind={kind} never forms (the bias "
                f"cannot be factorized into its features); use pos=rope, pos=none or an absolute scheme"]
    return []


def with_defaults(kind: str, options: dict) -> dict:
    """The kind's options as configured, its defaults where left out or null."""
    return {**ATTENTION_KINDS.options(kind), **{k: v for k, v in options.items() if v is not None}}


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def prefix_sums(qf: Tensor, kf: Tensor, x: Tensor, held: Tensor | None, causal: bool, chunk: int,
                scores=None):
    """out_i = qf_i^T H_i with H_i = held + sum_j kf_j x_j^T over every key j (not causal), or over
    j <= i (causal: the new keys are the new queries), chunk by chunk. qf (B, Hkv, G, T, m), kf (B, Hkv,
    T, m), x (B, Hkv, T, e), held (B, Hkv, m, e) or None -> (out (B, Hkv, G, T, e), final H (B, Hkv, m, e)).
    `scores(qc, kc)`: the products qf_i.kf_j within a chunk, (..., C, m) x (..., C, m) -> (..., C, C), where a
    kind computes them cheaper than from its m features (default: qc kc^T)."""
    if not causal or kf.shape[-2] == 1:  # one new key (a decoding step): the recurrence itself, H += kf x^T
        total = kf.transpose(-2, -1) @ x
        total = total if held is None else held + total
        return qf @ total[:, :, None], total
    length = kf.shape[-2]
    chunk = min(chunk, length)  # a pass shorter than a chunk is one chunk
    # Zero features past the end add nothing; then (..., chunks, C, .)
    pad = -length % chunk  # (F.pad copies even when it adds nothing)
    qc, kc, xc = ((F.pad(t, (0, 0, 0, pad)) if pad else t).unflatten(-2, (-1, chunk)) for t in (qf, kf, x))
    sums = kc.transpose(-2, -1) @ xc  # (B, Hkv, N, m, e): each chunk's sum of kf x^T
    running = sums.cumsum(2)
    before = torch.cat((torch.zeros_like(sums[:, :, :1]), running[:, :, :-1]), dim=2)  # the chunks before each
    if held is not None:
        before, running = before + held[:, :, None], running + held[:, :, None]
    pairs = qc @ kc[:, :, None].transpose(-2, -1) if scores is None else scores(qc, kc[:, :, None])
    within = pairs.tril() @ xc[:, :, None]  # keys j <= i of the same chunk
    out = within + qc @ before[:, :, None]
    return out.flatten(-3, -2)[..., :length, :], running[:, :, -1]


class RunningState:
    """A kernelized kind's decoding state, per K/V head: the sums S = sum phi(k) v^T and z = sum phi(k)
    of every key so far (one tensor [S | z] of m x (d_head + 1); two, S and z, when RoPE rotates S's
    features), of a fixed size however many tokens were decoded. `shift` is the log of a factor taken out
    of every held phi(k) (FAVOR+'s stabilizer), so held and new keys are summed at one scale."""

    def __init__(self):
        self.sums: list[Tensor] = []
        self.shift: Tensor | None = None

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.sums, *([] if self.shift is None else [self.shift])])

    def drop_oldest(self, count: int) -> None:
        raise ValueError("a running state holds sums, not keys, so it cannot forget the oldest keys; "
                         "linear attention kinds take no window (attn.window=null)")

    def rescaled(self, kf: Tensor, shift: Tensor | None) -> Tensor:
        """New key features kf (exp(shift) taken out), with kf and the held sums brought to one factor."""
        if shift is None:
            return kf
        if not self.sums:
            self.shift = shift
            return kf
        common = torch.maximum(self.shift, shift)
        self.sums = [s * (self.shift - common).exp() for s in self.sums]
        self.shift = common
        return kf * (shift - common).exp()


class KernelAttention(Attention):
    """phi(q) phi(k)^T attention, normalized (module docstring); a subclass defines `features`. Option
    `chunk`: tokens per chunk of the causal parallel form (any value gives the same result)."""

    rotates_features = False  # True: RoPE rotates phi(q), phi(k) in the numerator (RoFormer sec. 3.4), not q, k

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 chunk: int = 64):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias)
        self.chunk = chunk

    @classmethod
    def errors(cls, cfg, options):
        errs = common_errors(cls.registry_name, cfg)
        chunk = with_defaults(cls.registry_name, options)["chunk"]
        if not is_positive_int(chunk):
            errs.append(f"attn.chunk={chunk!r} must be a positive integer (tokens per chunk of the causal prefix sums)")
        return errs

    def features(self, x: Tensor, is_query: bool) -> tuple[Tensor, Tensor | None]:
        """Positive features (B, n, T, m) of queries or keys (B, n, T, d_head), with the log of a factor
        taken out of them (None: none). Queries may take out one per query (it cancels between numerator
        and denominator); keys only one per sequence and head, which the decoding state keeps."""
        raise NotImplementedError

    def state_bytes_per_token(self, element_size: int) -> int:
        return 0  # a fixed-size state

    chunk_scores = None  # prefix_sums' `scores`: a kind whose phi(q).phi(k) has a cheaper closed form sets it

    def new_state(self) -> RunningState:
        return RunningState()

    def rotate(self, q, k, ctx):
        return (q, k) if self.rotates_features else super().rotate(q, k, ctx)

    @at_least_float32
    def attend(self, q, k, v, ctx, state):
        self_attention = ctx.k_positions is not None  # cross-attention: keys are the encoder's, unrotated
        causal = self_attention and ctx.position_scheme.causal  # the mask folds causality away; the scheme knows
        qf, _ = self.features(q, True)
        kf, shift = self.features(k, False)
        valid = key_valid(ctx, k.shape[2])
        if valid is not None:
            padding = ~valid[:, None, :, None]
            kf, v = kf.masked_fill(padding, 0.0), v.masked_fill(padding, 0.0)
        if state is not None:
            kf = state.rescaled(kf, shift)
        qn, kn = qf, kf  # the numerator's features
        if self.rotates_features and self_attention:
            qn, kn = ctx.position_scheme.rotate(qf, kf, ctx.positions)
        rotated = qn is not qf  # a scheme without a rotation returns its inputs
        qf, qn = (t.unflatten(1, (self.n_kv_heads, -1)) for t in (qf, qn))  # (B, Hkv, G, T, m)
        if ctx.need_weights:
            if state is not None:
                raise ValueError("attention weights are not available while decoding with a running state")
            return self.explicit(qf, kf, qn, kn, v, causal).flatten(1, 2)
        ones = v.new_ones(*v.shape[:-1], 1)
        # (query features, key features, what each key carries): numerator with v, denominator with 1.
        terms = [(qn, kn, v), (qf, kf, ones)] if rotated else [(qf, kf, torch.cat((v, ones), dim=-1))]
        held = state.sums if state is not None and state.sums else [None] * len(terms)
        results = [prefix_sums(*term, h, causal, self.chunk, self.chunk_scores) for term, h in zip(terms, held)]
        if state is not None:
            state.sums = [final for _, final in results]
        out = torch.cat([part for part, _ in results], dim=-1)
        num, den = out[..., :-1], out[..., -1:]
        # A query with no real key before it (left padding) has 0 / 0: 0, not NaN (its output is ignored).
        return (num / den.clamp_min(torch.finfo(den.dtype).tiny)).flatten(1, 2)

    def explicit(self, qf, kf, qn, kn, v, causal: bool) -> Tensor:
        """The same attention written out with its (Tq, Tk) weights, kept in last_weights (analysis)."""
        num = qn @ kn[:, :, None].transpose(-2, -1)  # (B, Hkv, G, Tq, Tk)
        den = qf @ kf[:, :, None].transpose(-2, -1)
        if causal:
            num, den = num.tril(), den.tril()
        weights = num / den.sum(-1, keepdim=True).clamp_min(torch.finfo(den.dtype).tiny)
        self.last_weights = weights.flatten(1, 2)
        return weights @ v[:, :, None]


@ATTENTION_KINDS.register("linear")
class LinearAttention(KernelAttention):
    """Katharopoulos et al. 2020, eq. 7: phi(x) = elu(x) + 1, m = d_head features. It has no temperature,
    so attn.scale does not apply. RoPE rotates the feature-mapped queries and keys in the numerator only,
    as RoFormer (Su et al. 2021, sec. 3.4, eq. 19) does: the numerator then depends on relative positions,
    the unrotated denominator stays positive (the weights no longer sum to 1 exactly)."""

    rotates_features = True
    temperature = False  # param=mup sets the projections only

    @classmethod
    def errors(cls, cfg, options):
        errs = super().errors(cfg, options)
        if cfg.attn.scale not in (None, "default"):
            errs.append(f"attn.scale={cfg.attn.scale!r} does not apply to attn.kind=linear (elu(x)+1 features have "
                        f"no temperature); set attn.scale=null")
        if cfg.attn.scale_factor != 1:
            errs.append(f"attn.scale_factor={cfg.attn.scale_factor!r} does not apply to attn.kind=linear (elu(x)+1 "
                        f"features have no temperature); set attn.scale_factor=1")
        return errs

    def features(self, x, is_query):
        return F.elu(x) + 1, None


def orthogonal_gaussian(m: int, d: int) -> Tensor:
    """(m, d) random features: blocks of d exactly orthogonal directions (Haar: QR of a Gaussian matrix,
    signs fixed by R's diagonal), each row scaled to the norm of its own d-dim Gaussian vector (chi(d)
    distributed), so each row is marginally N(0, I_d) (Choromanski et al. 2021, sec. 2.4, 'regular')."""
    if counting():  # the shape only (model/size.py), not m/d QR decompositions
        return torch.empty(m, d)
    blocks = []
    for _ in range(math.ceil(m / d)):
        q, r = torch.linalg.qr(torch.randn(d, d))
        blocks.append((q * r.diagonal().sign()).T)
    return torch.cat(blocks)[:m] * torch.randn(m, d).norm(dim=1, keepdim=True)


@ATTENTION_KINDS.register("performer")
class Performer(KernelAttention):
    """FAVOR+ (Choromanski et al. 2021): positive random features of the softmax kernel (Lemma 1, eq. 7),
    phi(x) = exp(w_i^T x - |x|^2 / 2) / sqrt(m) for m orthogonal random w_i, so that
    E[phi(q).phi(k)] = exp(q.k). softmax(scale q k^T) is approximated with x = sqrt(scale) q and
    sqrt(scale) k. Options: n_features (m), redraw_interval (draw new w every N training forward calls;
    null: never). The w are a buffer, so checkpoints and decoding are deterministic.
    Stabilizer (as the paper's code): each query's largest exponent is taken out (it cancels); for keys
    the largest over the pass, which the decoding state keeps, rescaling its sums when a larger comes.
    RoPE rotates q and k before the features, as for softmax: FAVOR+ then approximates RoPE softmax
    attention (the features have m != d_head dimensions, which the rotation does not fit)."""

    def __init__(self, d_model, n_heads, n_kv_heads=None, scale=None, qk_norm=False, dropout=0.0, bias=True,
                 chunk: int = 64, n_features: int = 64, redraw_interval: int | None = None):
        super().__init__(d_model, n_heads, n_kv_heads, scale, qk_norm, dropout, bias, chunk)
        self.n_features, self.redraw_interval = n_features, redraw_interval
        self.register_buffer("random_features", orthogonal_gaussian(n_features, self.d_head))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))  # training forward calls, for redraws

    @classmethod
    def errors(cls, cfg, options):
        errs = super().errors(cfg, options)
        options = with_defaults(cls.registry_name, options)
        if not is_positive_int(options["n_features"]):
            errs.append(f"attn.n_features={options['n_features']!r} must be a positive integer (random features "
                        f"per head; more approximate softmax better)")
        interval = options["redraw_interval"]
        if interval is not None and not is_positive_int(interval):
            errs.append(f"attn.redraw_interval={interval!r} must be a positive integer (training calls between "
                        f"redraws) or null (never redraw)")
        return errs

    @torch.no_grad()
    def redraw(self) -> None:
        self.random_features.copy_(orthogonal_gaussian(self.n_features, self.d_head))

    def attend(self, q, k, v, ctx, state):
        if self.training and self.redraw_interval:
            if self.calls > 0 and self.calls % self.redraw_interval == 0:
                self.redraw()
            self.calls += 1
        return super().attend(q, k, v, ctx, state)

    def features(self, x, is_query):
        x = x * math.sqrt(self.scale)
        exponent = x @ self.random_features.to(x.dtype).T - (x * x).sum(-1, keepdim=True) / 2
        shift = exponent.amax(-1 if is_query else (-2, -1), keepdim=True).detach()
        return (exponent - shift).exp() / math.sqrt(self.n_features), shift
