"""`python -m blocklab.bench malloc`: training steps of the default copy model under glibc's default malloc and under
`hardware.keep_freed_memory()`, which every run sets. A process cannot undo the setting, so each variant runs in
processes of its own, alternated (default, kept, default, kept, ...) so that the machine's drift hits both alike.
Minor page faults a step show the cause: memory handed back to the kernel at one step and faulted in at the next."""
import json
import statistics
import subprocess
import sys

import torch

from blocklab.bench.common import verdict
from blocklab.hardware import MMAP_THRESHOLD_MAX, TRIM_THRESHOLD

VARIANTS = ("default", "kept")

_STEPS = """
import json, resource, sys, time
import torch
variant, size, threads, warmup, chunks, steps = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
if variant == "kept":
    from blocklab.hardware import keep_freed_memory
    assert keep_freed_memory(), "glibc's mallopt refused the setting"
torch.set_num_threads(threads)
from blocklab.bench.common import default_copy_step
train_step = default_copy_step(size)
for _ in range(warmup):
    train_step()
faults, ms = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
for chunk in range(chunks):
    start = time.perf_counter()
    for _ in range(steps):
        train_step()
    ms.append(1000 * (time.perf_counter() - start) / steps)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / (chunks * steps)
print(json.dumps({"ms": min(ms), "faults_per_step": faults}))
"""


def train_steps(variant: str, size: str, threads: int, warmup: int, chunks: int, steps: int) -> dict:
    """In a process of its own: `warmup` untimed steps, then `chunks` chunks of `steps`; ms a step of the best chunk,
    and minor page faults a step over all chunks."""
    args = [variant, size, str(threads), str(warmup), str(chunks), str(steps)]
    out = subprocess.run([sys.executable, "-c", _STEPS, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def malloc(size: str = "full") -> dict:
    """Per variant and thread count: the median over processes of each process's best chunk of steps."""
    pairs, warmup, chunks, steps = (3, 30, 5, 30) if size == "full" else (1, 2, 1, 2)
    # The run's threads, and a sweep job's one beside another (tiny: one process a variant, one thread).
    threads = sorted({torch.get_num_threads(), 1}, reverse=True) if size == "full" else [1]
    rows, targets = [], {}
    for n in threads:
        runs = {variant: [] for variant in VARIANTS}
        for _ in range(pairs):
            for variant in VARIANTS:
                runs[variant].append(train_steps(variant, size, n, warmup, chunks, steps))
        ms = {v: statistics.median(r["ms"] for r in runs[v]) for v in VARIANTS}
        for variant in VARIANTS:
            rows.append({"threads": n, "malloc": variant, "ms_per_step": round(ms[variant], 2),
                         "faults_per_step": round(statistics.median(r["faults_per_step"] for r in runs[variant])),
                         "vs_default": round(ms[variant] / ms["default"], 3)})
        targets[f"kept_vs_default_{n}_threads"] = verdict(ms["kept"] / ms["default"], 1.0)
    notes = [f"{pairs} processes a variant and thread count, alternated; each trains {warmup} untimed steps, then "
             f"{chunks} chunks of {steps} and keeps its best chunk. Kept: blocks up to {MMAP_THRESHOLD_MAX >> 20} MiB from "
             f"the heap and up to {TRIM_THRESHOLD >> 20} MiB of freed heap kept mapped (mallopt)."]
    return {"rows": rows, "notes": notes, "targets": targets}
