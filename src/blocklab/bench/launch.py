"""`python -m blocklab.bench launch`: one whole sweep as a user launches it (`python train.py -m sweep=causal_mask
logger=none`: 2 settings x 3 seeds), two ways, each a fresh process writing a fresh folder, back to back:
- jobs one after another (`hydra.launcher.n_jobs=1`, every core each; how sweeps ran before any throughput work),
- jobs side by side (the default: joblib, an even share of the cores each).
It prints each way's wall time, its speed-up over one after another, and its results (mean exact match on the
trained lengths, mean final training loss), which must agree within seed noise. Where torch sees a GPU, the
sweep runs on it (`trainer=gpu`). Whole sweeps cannot be interleaved in one process: run it twice to see how
much the machine drifts."""
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from blocklab.bench.common import verdict
from blocklab.folder import read_json

TARGET = 2.0  # the issue's: the default sweeps' total time falls by at least 2x
WAYS = {
    "jobs one after another": ["hydra.launcher.n_jobs=1"],
    "jobs side by side": [],
}


def sweep_command(size: str, folder: Path) -> list[str]:
    command = [sys.executable, "-m", "blocklab.train", "-m", "sweep=causal_mask", "logger=none",
               f"hydra.sweep.dir={folder}"]
    if torch.cuda.is_available():
        command.append("trainer=gpu")
    if size == "tiny":
        command += ["trainer.max_steps=10", "task.eval_examples=8", "diagnostics=none", "seed=0,1"]
    return command


def outcome(folder: Path) -> dict:
    """What the sweep's runs measured: mean exact match on the trained lengths and mean final training loss."""
    runs = [read_json(folder, p.relative_to(folder)) for p in sorted(folder.glob("*/results.json"))]
    exact = [statistics.mean(e["exact_match"] for e in r["eval"] if e["in_distribution"]) for r in runs]
    return {"runs": len(runs), "exact_match_in": round(statistics.mean(exact), 3),
            "final_train_loss": round(statistics.mean(r["final_train_loss"] for r in runs), 4)}


def launch(size: str = "full") -> dict:
    rows = []
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}  # as a user's shell has it
    with tempfile.TemporaryDirectory() as tmp:
        for way, extra in WAYS.items():
            folder = Path(tmp) / way.replace(" ", "_")
            start = time.perf_counter()
            proc = subprocess.run([*sweep_command(size, folder), *extra], capture_output=True, text=True, env=env)
            wall = time.perf_counter() - start
            if proc.returncode != 0:
                raise RuntimeError(f"the sweep ({way}) failed:\n{proc.stderr[-2000:]}")
            rows.append({"way": way, "s": round(wall, 1), **outcome(folder)})
    base = rows[0]["s"]
    for row in rows:
        row["vs_one_after_another"] = round(base / row["s"], 2)
    best = max(rows[1:], key=lambda row: row["vs_one_after_another"])
    where = "the GPU (trainer=gpu)" if torch.cuda.is_available() else "the CPU"
    notes = [f"on {where}; the fastest way is {best['way']}, {best['vs_one_after_another']}x one after another.",
             "Results differ between ways only at round-off (threads, batched matmuls), which training grows into "
             "seed-sized differences: compare them against the seeds' spread, not for equality."]
    return {"rows": rows, "sweep": "causal_mask", "notes": notes,
            "targets": {"sweep_speedup": verdict(best["vs_one_after_another"], TARGET, lower_is_better=False)}}
