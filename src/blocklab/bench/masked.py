"""`python -m blocklab.bench masked`: one training step of each task whose loss is masked, at the task's defaults
(`python train.py task=mqar`: vocabulary 8192, batch 64 x 64 tokens, 256 of them scored), with the output layer at
every position (the step before: logits and log-softmax over the vocabulary at all 4096 positions, cross-entropy
ignoring the unscored) and at the scored positions only (the step now: `LitTransformer.losses`). Both are trained
from the same weights on the same batches, alternated step by step in one process (old, new, old, new, ...), so a
shared machine's load hits both alike; the ratio is the median of the per-round ratios. Then a profile of the new
MQAR step: the operators it spends its time in. One torch thread, as the issue's profile: on a machine shared with
other work, two threads' waits on each other swamp a step of small operators (the two paths then measure the load)."""
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from blocklab.bench.common import default_step, verdict
from blocklab.tasks.base import IGNORE

TASKS = {"mqar": ["task=mqar"], "copy": ["task=copy"], "addition": ["task=addition"]}
# tiny: a smoke test of the code path, figures meaningless
TINY = {"mqar": ["task.vocab_size=256", "task.batch_size=8", "task.eval_buckets=[[64,4]]"], "copy": ["task.batch_size=8", "task.max_len=8"],
        "addition": ["task.batch_size=8"]}
TINY_MODEL = ["model.d_model=32", "model.n_layers=1"]
TARGETS = {"mqar": 0.25}  # new/old at most: the default MQAR step in a quarter of its time before (issue 54)


def masked(size: str = "full") -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _masked(size)
    finally:
        torch.set_num_threads(threads)


def _masked(size: str) -> dict:
    tiny = size == "tiny"
    rounds, iters, warmup = (2, 1, 1) if tiny else (12, 2, 2)
    rows, targets = [], {}
    for task, overrides in TASKS.items():
        overrides = [*overrides, *(TINY[task] + TINY_MODEL if tiny else [])]
        steps = {"all positions": default_step(overrides, full_logits=True),
                 "scored positions": default_step(overrides)}
        ms = paired_ms(steps, rounds, iters, warmup)
        per_round = [new / old for old, new in zip(ms["all positions"], ms["scored positions"], strict=True)]
        ratio = statistics.median(per_round)
        new = steps["scored positions"]
        batch = next(iter(new.task.train_batches(0)))
        scored = int((batch["target"] != IGNORE).sum())
        for path, times in ms.items():
            rows.append({"task": task, "logits at": path, "vocab": new.lit.model.cfg.vocab_size,
                         "positions": f"{scored if path == 'scored positions' else batch['target'].numel()}"
                                      f"/{batch['target'].numel()}",
                         "ms_median": round(statistics.median(times), 1), "ms_best": round(min(times), 1)})
        rows[-1]["new/old"] = round(ratio, 3)
        rows[-1]["old/new"] = round(1 / ratio, 2)
        if task in TARGETS:
            targets[f"{task}_step_new_vs_old"] = verdict(ratio, TARGETS[task])
    profile_rows = top_ops(default_step([*TASKS["mqar"], *(TINY["mqar"] + TINY_MODEL if tiny else [])]),
                           steps=1 if tiny else 4)
    return {"rows": rows, "tables": {"step, logits at every position vs at the scored ones": rows,
                                     "where the new default MQAR step goes (torch.profiler, self CPU time)": profile_rows},
            "threads": torch.get_num_threads(), "targets": targets,
            "notes": ["ms are per training step (forward, backward, clipping, AdamW) on one torch thread, the two paths "
                      "alternated in one process; new/old is the median of the per-round ratios, robust to the "
                      "machine's load drifting"]}


def paired_ms(steps: dict, rounds: int, iters: int, warmup: int) -> dict[str, list[float]]:
    """ms per call of each step function, per round, the functions alternated within every round."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    ms = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            ms[name].append(1000 * (time.perf_counter() - start) / iters)
    return ms


def top_ops(step, steps: int, count: int = 12) -> list[dict]:
    """The operators a training step spends its self CPU time in, most first, grouped by input shapes."""
    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    return [{"op": e.key, "shapes": str(e.input_shapes)[:60], "ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 2),
             "share": round(e.self_cpu_time_total / total, 3)} for e in top]
