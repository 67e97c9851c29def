"""`python -m blocklab.bench debug_mqar`: the wall time of `python -m blocklab.train trainer=debug logger=none
task=mqar` (what `python train.py ...` runs, start to exit: start-up, 20 training steps with their two validations
of one batch, the end's evaluation at 32 examples per length (trainer=debug's caps), diagnostics, decoding and memory
costs) for each attention preset (conf/attn) and for
experiment=based_hybrid, as a ratio to the same debug run of task=copy with MHA. The runs alternate (copy, kind, copy,
kind, ..., copy) so that a shared machine's load falls on both alike; a kind's ratio is its time over the mean of the
copy runs on either side of it. Target: at most 2x for every kind (issue 54). Beside wall time, each run's CPU time
(user + system, from the OS): on a machine shared with other work it is the steadier figure. The runs take the
environment's threads (OMP_NUM_THREADS). --quick: Based alone, 2 steps and 16 examples per length (figures
meaningless)."""
import os
import resource
import subprocess
import sys
import tempfile
import time

from blocklab.bench.common import attn_presets, verdict

TARGET = 2.0  # debug MQAR wall time / debug copy MHA wall time, at most
COPY = ["task=copy", "attn=mha"]
HYBRID = "experiment=based_hybrid"  # a hybrid stack of layer kinds: no attn preset of its own
TINY = ["trainer.max_steps=2", "task.eval_examples=16"]


def kinds(size: str) -> dict[str, list[str]]:
    """name -> the overrides of its MQAR debug run."""
    names = ["based"] if size == "tiny" else attn_presets()
    runs = {name: ["task=mqar", f"attn={name}"] for name in names}
    if size != "tiny":
        runs["based_hybrid"] = [HYBRID, "task=mqar"]
    return runs


def timed(overrides: list[str], run_dir: str) -> tuple[float, float]:
    """(wall, CPU) seconds of `python -m blocklab.train trainer=debug logger=none OVERRIDES`, launch to exit."""
    command = [sys.executable, "-m", "blocklab.train", "trainer=debug", "logger=none", *overrides,
               f"hydra.run.dir={run_dir}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def debug_mqar(size: str = "full") -> dict:
    extra = TINY if size == "tiny" else []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = (f"{tmp}/{i}" for i in range(10 ** 6))
        copies = [timed([*COPY, *extra], next(dirs))]
        times = {}
        for name, overrides in kinds(size).items():  # copy, kind, copy, kind, ..., copy
            times[name] = timed([*overrides, *extra], next(dirs))
            copies.append(timed([*COPY, *extra], next(dirs)))
    rows, targets = [], {}
    for i, (name, (wall, cpu)) in enumerate(times.items()):
        copy_wall, copy_cpu = ((a + b) / 2 for a, b in zip(copies[i], copies[i + 1]))
        ratio = wall / copy_wall
        rows.append({"kind": name, "mqar_s": round(wall, 2), "copy_mha_s": round(copy_wall, 2),
                     "vs_copy_mha": round(ratio, 2), "cpu_vs_copy_mha": round(cpu / copy_cpu, 2),
                     "met": ratio <= TARGET})
        targets[f"{name}_vs_copy_mha"] = verdict(ratio, TARGET)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return {"rows": rows, "copy_runs_s": [round(wall, 2) for wall, _ in copies], "targets": targets,
            "notes": [f"load average (1, 5, 15 min) at the end: {load}; the ratios are of wall time (the target's), "
                      f"cpu_vs_copy_mha of CPU time"]}
