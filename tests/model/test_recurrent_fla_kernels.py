"""flash-linear-attention's Triton kernels against our CPU path, for a future `attn.backend=fla` (not built yet: today
every recurrent kind runs its own PyTorch chunked form on any device). Each kernel, on a CUDA GPU in its training
precision, gives our chunked form's outputs, final state and input gradients computed in float64 on the CPU, within
the error ratio flash-linear-attention's own tests allow (RMS of the difference over RMS of the reference, fla's
`get_err_ratio`; its tests use 0.005-0.008 for these kernels in half precision).

Needs a CUDA GPU and flash-linear-attention 0.3.2 with Triton (`pip install flash-linear-attention==0.3.2`, not a
BlockLab dependency); skipped without either, like tests/test_gpu.py's CUDA tests. Conventions as in
test_recurrent_reference.py: GLA's scale d_k^-1/2 is fla's default; DeltaNet takes scale 1 (ours has none) and the
L2 norm inside the kernel (`use_qk_l2norm_in_kernel=True`, as fla's layer); Based at fla's default scale d'^-1/2."""
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)
fla_gla = pytest.importorskip("fla.ops.gla", reason="needs flash-linear-attention 0.3.2 and triton")
fla_delta = pytest.importorskip("fla.ops.delta_rule", reason="needs flash-linear-attention 0.3.2 and triton")
fla_based = pytest.importorskip("fla.ops.based", reason="needs flash-linear-attention 0.3.2 and triton")

from blocklab.model.attention import ATTENTION_KINDS  # noqa: E402
from blocklab.model.deltanet import delta_chunked  # noqa: E402
from blocklab.model.gla import gla_chunked  # noqa: E402
from blocklab.model.linear_attention import KernelAttention  # noqa: E402
from blocklab.model.mask import AttentionContext  # noqa: E402
from blocklab.model.position import NoPE  # noqa: E402

LENGTHS = [7, 100, 300]  # not multiples of fla's chunk (64); one token is checked on the CPU (Based's dq is 0 there)
B, H = 2, 3


@pytest.fixture(autouse=True)
def ieee_float32(monkeypatch):
    """Triton's float32 dots in full precision, not TF32, as fla's own tests run them (TRITON_F32_DEFAULT)."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")


def err_ratio(ours, theirs) -> float:
    """fla.utils.get_err_ratio: RMS(theirs - ours) / RMS(ours), ours the float64 reference."""
    theirs = theirs.detach().cpu().double()
    return ((theirs - ours).square().mean().sqrt() / (ours.square().mean().sqrt() + 1e-8)).item()


def pair(*tensors, dtype):
    """The same values twice: on the GPU in the kernel's dtype, and on the CPU in float64 (from the rounded ones)."""
    gpu = [t.to("cuda", d).requires_grad_() for t, d in zip(tensors, dtype)]
    cpu = [t.detach().cpu().double().requires_grad_() for t in gpu]
    return gpu, cpu


def backward(outputs, seed=0):
    """Sum of each output times a fixed random cotangent, backward; returns the cotangents (for the other side)."""
    generator = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(o.shape, generator=generator, dtype=torch.float64) for o in outputs]
    sum((o * c.to(o.device, o.dtype)).sum() for o, c in zip(outputs, cotangents)).backward()


def assert_matches(name, ours: dict, theirs: dict, limit: float):
    ratios = {key: err_ratio(ours[key], theirs[key]) for key in ours}
    assert all(r < limit for r in ratios.values()), f"{name}: error ratios {ratios} (limit {limit})"


@pytest.mark.parametrize("length", LENGTHS)
def test_fla_chunk_gla_equals_our_chunked_form(length):
    K = V = 64
    torch.manual_seed(0)
    gate = F.logsigmoid(torch.randn(B, length, H, K)) / 16  # the layer's log alpha, tau = 16
    (q, k, v, g, h0), (q64, k64, v64, g64, h064) = pair(
        torch.randn(B, length, H, K), torch.randn(B, length, H, K), torch.randn(B, length, H, V), gate,
        torch.randn(B, H, K, V), dtype=[torch.float32] * 5)
    o, ht = fla_gla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    backward([o, ht])
    heads = lambda t: t.transpose(1, 2)  # noqa: E731  (B, T, H, d) -> (B, H, T, d)
    out, final = gla_chunked(heads(q64 * K ** -0.5)[:, :, None], heads(k64), heads(v64), heads(g64), h064, 8)
    out = heads(out[:, :, 0])
    backward([out, final])
    assert_matches("chunk_gla", {"o": out, "ht": final, "dq": q64.grad, "dk": k64.grad, "dv": v64.grad,
                                 "dg": g64.grad, "dh0": h064.grad},
                   {"o": o, "ht": ht, "dq": q.grad, "dk": k.grad, "dv": v.grad, "dg": g.grad, "dh0": h0.grad}, 5e-3)


@pytest.mark.parametrize("length", LENGTHS)
def test_fla_chunk_delta_rule_equals_our_chunked_form(length):
    """In float16, as fla's tests run it (its chunk kernel refuses float32), the state in float32."""
    K = V = 64
    torch.manual_seed(0)
    (q, k, v, beta, h0), (q64, k64, v64, beta64, h064) = pair(
        torch.randn(B, length, H, K), torch.randn(B, length, H, K), torch.randn(B, length, H, V),
        torch.rand(B, length, H).sigmoid(), torch.randn(B, H, K, V), dtype=[torch.float16] * 4 + [torch.float32])
    o, ht = fla_delta.chunk_delta_rule(q, k, v, beta, scale=1.0, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
    backward([o, ht])
    heads = lambda t: t.transpose(1, 2)  # noqa: E731
    unit_q, unit_k = F.normalize(q64, dim=-1), F.normalize(k64, dim=-1)
    out, final = delta_chunked(heads(unit_q)[:, :, None], heads(unit_k), heads(v64), heads(beta64), h064, 32)
    out = heads(out[:, :, 0])
    backward([out, final])
    assert_matches("chunk_delta_rule", {"o": out, "ht": final, "dq": q64.grad, "dk": k64.grad, "dv": v64.grad,
                                        "dbeta": beta64.grad, "dh0": h064.grad},
                   {"o": o, "ht": ht, "dq": q.grad, "dk": k.grad, "dv": v.grad, "dbeta": beta.grad,
                    "dh0": h0.grad}, 1e-2)


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("kernel", ["parallel_based", "fused_chunk_based"])
def test_fla_based_kernels_equal_our_taylor_path(kernel, length):
    """Our Based layer's Taylor path (KernelAttention.attend on its features) with d_head = d' = 16 and its feature
    projection the identity, so fla's kernels read the same features."""
    F_DIM = 16
    layer = ATTENTION_KINDS["based"](H * F_DIM, H, chunk=64, feature_dim=F_DIM).double()
    with torch.no_grad():
        layer.feature_proj.weight.copy_(torch.eye(F_DIM))
    torch.manual_seed(0)
    (q, k, v), (q64, k64, v64) = pair(*(torch.randn(B, length, H, F_DIM) for _ in range(3)), dtype=[torch.float32] * 3)
    o = getattr(fla_based, kernel)(q, k, v, use_norm=True)
    backward([o])
    positions = torch.arange(length)[None]
    ctx = AttentionContext(positions=positions, position_scheme=NoPE(H * F_DIM, H, F_DIM), mask=None,
                           is_causal=True, k_positions=positions)
    heads = lambda t: t.transpose(1, 2)  # noqa: E731
    out = heads(KernelAttention.attend(layer, heads(q64), heads(k64), heads(v64), ctx, None))
    backward([out])
    assert_matches(kernel, {"o": out, "dq": q64.grad, "dk": k64.grad, "dv": v64.grad},
                   {"o": o, "dq": q.grad, "dk": k.grad, "dv": v.grad}, 5e-3)
