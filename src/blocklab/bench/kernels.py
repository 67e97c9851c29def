"""`python -m blocklab.bench kernels`: which of SDPA's kernels each position scheme lets attention use, and what a
training step of one attention layer costs under each, on the GPU where torch sees one (bfloat16 autocast, as
`trainer=gpu` trains), else on the CPU (float32).

A scheme that adds a float bias to the scores (ALiBi, T5, FIRE) hands SDPA a mask, which its flash kernel does not
take; NoPE and RoPE on a causal decoder pass only the causal flag. Each scheme is timed with SDPA free to choose
(`auto`) and restricted to one kernel at a time (`torch.nn.attention.sdpa_kernel`): a kernel that refuses the call
is reported as not allowed, with the first line of torch's reason. Forward + backward of one layer (projections
included, causal, batch of several sequences), timed in turn with the other variants of its length (median of the
rounds), the device's queued work waited for; peak memory from the GPU's allocator (no CPU figure)."""
import warnings
from collections import defaultdict
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from blocklab.bench.attention import HEADS, NOPE, Layer, inside_attention, reference
from blocklab.bench.common import interleaved, verdict
from blocklab.hardware import finish_queued_work
from blocklab.model.position import POSITION_SCHEMES

KERNELS = {"auto": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "math": SDPBackend.MATH}
SIZES = {"full": dict(lengths=(1024, 4096), d_model=256, batch=8, rounds=5, iters=3),
         "tiny": dict(lengths=(32,), d_model=32, batch=2, rounds=1, iters=1)}
ROPE_TARGET = 1.2  # RoPE rotates q and k outside the kernel: it should cost little more than NoPE on the flash path


def schemes() -> list[str]:
    """NoPE and every registered scheme that acts inside attention (the others only add to the embeddings)."""
    return [NOPE, *(name for name in POSITION_SCHEMES if name != NOPE and inside_attention(name))]


class KernelStep:
    """One layer's training step on `device`, SDPA held to one kernel (None: its own choice)."""

    def __init__(self, pos: str, kernel, s: dict, n: int, device: torch.device):
        self.layer = Layer(reference(), s["d_model"], n, n, pos)
        self.layer.attn.to(device)
        self.layer.scheme.to(device)
        self.kernel, self.device = kernel, device
        self.x = torch.randn(s["batch"], n, s["d_model"], device=device, requires_grad=True)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    def __call__(self):
        with sdpa_kernel([self.kernel]) if self.kernel is not None else nullcontext(), self.autocast:
            self.layer.step(self.x)
        finish_queued_work(self.device)

    def refusal(self) -> str | None:
        """Why the kernel will not run this step (None: it runs): torch warns each kernel's reason, then raises."""
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                self()
            except RuntimeError as err:
                reasons = [str(w.message).strip().splitlines()[0] for w in said] or [str(err).strip().splitlines()[0]]
                return " / ".join(dict.fromkeys(reason[:120] for reason in reasons))
        return None

    def peak_mb(self) -> float | None:
        if self.device.type != "cuda":
            return None
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self()
        return round((torch.cuda.max_memory_allocated(self.device) - before) / 2 ** 20, 1)


def kernels(size: str = "full") -> dict:
    s = SIZES[size]
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    rows, refused = [], {}
    for n in s["lengths"]:
        steps = {(pos, name): KernelStep(pos, kernel, s, n, device) for pos in schemes() for name, kernel in KERNELS.items()}
        for key, step in list(steps.items()):
            if reason := step.refusal():
                refused[key + (n,)] = reason
                del steps[key]
        times = interleaved(steps, s["rounds"], s["iters"], warmup=1)
        nope = times[NOPE, "auto"]["ms_median"]
        where = {"device": device.type, "precision": precision, "length": n}
        rows += [{**where, "pos": pos, "kernel": name, "ms": round(t["ms_median"], 3),
                  "vs_nope_auto": round(t["ms_median"] / nope, 2), "peak_mb": steps[pos, name].peak_mb()}
                 for (pos, name), t in times.items()]
        rows += [{**where, "pos": pos, "kernel": name, "ms": None, "vs_nope_auto": None, "peak_mb": None,
                  "refused": reason[:60]} for (pos, name, length), reason in refused.items() if length == n]
    longest = max(s["lengths"])
    auto = {r["pos"]: r["ms"] for r in rows if r["length"] == longest and r["kernel"] == "auto"}
    by_reason = defaultdict(list)
    for (pos, name, n), reason in refused.items():
        by_reason[reason].append(f"{pos}/{name} at {n}")
    notes = [f"{device.type}, {precision}: d_model {s['d_model']}, {HEADS} heads, batch {s['batch']}, causal; one "
             "layer's forward + backward.",
             *(f"refused ({', '.join(cases)}): {reason}" for reason, cases in by_reason.items())]
    return {"rows": rows, "notes": notes, "device": str(device),
            "targets": {"rope_vs_nope": verdict(auto["rope"] / auto[NOPE], ROPE_TARGET)}}
