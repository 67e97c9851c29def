"""The benchmarks. Each takes a size ("full" or "tiny", the latter for the smoke test) and returns
{"rows": [...table rows...], "targets": {name: verdict}, ...}. Targets are the issue's ratios."""
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from blocklab.bench.attention import attention
from blocklab.bench.debug_mqar import debug_mqar
from blocklab.bench.kernels import kernels
from blocklab.bench.launch import launch
from blocklab.bench.malloc import malloc
from blocklab.bench.masked import masked
from blocklab.bench.common import (PlainLoop, attn_presets, baby, baby_choice, baby_config, baby_optim, batches,
                                   interleaved, matmul_peak_gflops, nanogpt_step, train_flops, verdict)
from blocklab.model import build_model
from blocklab.model.ffn import ACTIVATIONS, FFN
from blocklab.model.generate import generate
from blocklab.model.position import POSITION_SCHEMES

PEAK_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16}  # the matmuls each precision runs


def _sizes(size: str) -> dict:
    if size == "tiny":
        return dict(rounds=1, iters=1, n_layers=1, batch=2, block=16, d_model=32, d_ff=64)
    size = baby()
    return dict(rounds=10, iters=4, n_layers=size["n_layers"], batch=size["batch"], block=size["block"],
                d_model=size["d_model"], d_ff=size["d_ff"])


def _model_sizes(s: dict) -> dict:
    return dict(n_layers=s["n_layers"], d_model=s["d_model"], d_ff=s["d_ff"], block=s["block"])


# ---------------------------------------------------------------------------------------- step

def step(size: str = "full") -> dict:
    """ms per training step for each pos scheme, attention preset and activation (one changed at a
    time from nanoGPT's learned/mha/gelu: every registered scheme and activation, every conf/attn file),
    and for the baby model under bf16-mixed precision, next to nanoGPT's model and loop (float32, as
    nanoGPT runs on CPU), all interleaved."""
    s = _sizes(size)
    data = batches(8, s["batch"], s["block"], baby()["vocab"])
    variants = {("pos", p): baby_config(pos=p, **_model_sizes(s)) for p in POSITION_SCHEMES}
    variants.update({("attn", a): baby_config(attn=a, **_model_sizes(s))
                     for a in attn_presets() if a != baby_choice("attn")})
    variants.update({("act", a): baby_config(act=a, **_model_sizes(s)) for a in ACTIVATIONS if a != baby_choice("act")})
    bf16 = ("precision", "bf16-mixed")
    variants[bf16] = baby_config(**_model_sizes(s))
    precision = {key: key[1] if key == bf16 else "32-true" for key in variants}
    fns = {"nanogpt": nanogpt_step(data)} if size == "full" else {}
    for key, cfg in variants.items():
        torch.manual_seed(0)
        fns[key] = PlainLoop(build_model(cfg), data, precision[key])
    n = 512 if size == "tiny" else 1024
    peak = {p: matmul_peak_gflops(n, rounds=s["rounds"], dtype=dtype) for p, dtype in PEAK_DTYPES.items()}
    times = interleaved(fns, s["rounds"], s["iters"], warmup=1 if size == "tiny" else 3)
    for p, dtype in PEAK_DTYPES.items():
        peak[p] = max(peak[p], matmul_peak_gflops(n, rounds=s["rounds"], dtype=dtype))
    tokens = s["batch"] * s["block"]
    nope = times[("pos", "none")]["ms"]
    flops = {key: train_flops(cfg, s["batch"], s["block"]) for key, cfg in variants.items()}
    rows = []
    for key in variants:
        ms = times[key]["ms"]
        rows.append({"axis": key[0], "variant": key[1], "ms": round(ms, 2), "ms_median": round(times[key]["ms_median"], 2),
                     "tokens_per_s": round(tokens / ms * 1000), "gflop_per_step": round(flops[key] / 1e9, 3),
                     "peak_fraction": round(flops[key] / (ms / 1000) / 1e9 / peak[precision[key]], 3),
                     "vs_nope": round(ms / nope, 3)})
    targets = {f"{p}_vs_nope": verdict(times[("pos", p)]["ms"] / nope, 1.10) for p in ("rope", "alibi", "t5_bias")}
    out = {"rows": rows, "matmul_peak_gflops": round(peak["32-true"], 1),
           "matmul_peak_gflops_bf16": round(peak["bf16-mixed"], 1), "tokens_per_step": tokens, "targets": targets}
    if "nanogpt" in times:
        ref = times["nanogpt"]["ms"]
        out["nanogpt_ms"] = round(ref, 2)
        for row in rows:
            row["vs_nanogpt"] = round(row["ms"] / ref, 3)
        base = ("pos", baby_choice("pos"))  # the baby itself
        targets["baby_vs_nanogpt"] = verdict(times[base]["ms"] / ref, 0.90)
        targets["baby_bf16_vs_nanogpt"] = verdict(times[bf16]["ms"] / ref, 0.90)
        # nanoGPT does the same matmuls (fused QKV, tied head), so the same FLOPs per step.
        out["nanogpt_peak_fraction"] = round(flops[base] / (ref / 1000) / 1e9 / peak["32-true"], 3)
        targets["baby_peak_fraction"] = verdict(flops[base] / (times[base]["ms"] / 1000) / 1e9 / peak["32-true"], 0.55,
                                                lower_is_better=False)
    return out


# ------------------------------------------------------------------------------------ overhead

def overhead(size: str = "full") -> dict:
    """The same model, data and optimizer: BlockLab's LightningModule under a Lightning Trainer (with
    the callbacks a run uses) vs the plain loop. Between two Lightning steps a callback runs one plain
    step, so every Lightning step is paired with one taken moments apart: a shared machine's load
    drifts within minutes by more than the few percent measured here, which would swamp it between
    separate runs. Figures are medians over the pairs; the ratio, the median of the per-step ratios.
    nanoGPT is compared through the plain loop (interleaved in blocks): a bfloat16 step right after a
    float32 one runs slower than in a run of its own."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from blocklab.train.callbacks import DivergenceGuard, StepProgressBar
    from blocklab.train.module import LitTransformer
    from blocklab.train.run import step_callbacks

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # keep the console for the tables
    s = _sizes(size)
    steps, skip = (4, 1) if size == "tiny" else (110, 10)
    cfg = baby_config(**_model_sizes(s))
    data = batches(8, s["batch"], s["block"], baby()["vocab"])

    class Paired(Callback):
        """Before each Lightning step, one plain step: ms of each (a Lightning step runs from this
        hook to the next, its hooks, data and bookkeeping included)."""

        def __init__(self, plain: PlainLoop):
            self.plain, self.mark = plain, 0.0
            self.ms = {"lightning": [], "plain": []}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx > skip:
                self.ms["lightning"].append(1000 * (time.perf_counter() - self.mark))
            start = time.perf_counter()
            self.plain()
            if skip <= batch_idx < steps - 1:  # the last Lightning step has no next hook to end it
                self.ms["plain"].append(1000 * (time.perf_counter() - start))
            self.mark = time.perf_counter()

    def paired_run(precision: str) -> dict[str, list[float]]:
        torch.manual_seed(0)
        paired = Paired(PlainLoop(build_model(cfg), data, precision))
        torch.manual_seed(0)
        lit = LitTransformer(cfg, baby_optim(), [])
        devnull = open(os.devnull, "w")
        with tempfile.TemporaryDirectory() as run_dir:
            bar = StepProgressBar(console_kwargs={"file": devnull})
            callbacks = [paired, *step_callbacks(Path(run_dir), DivergenceGuard(), 500, bar)]
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                                enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                                log_every_n_steps=25, gradient_clip_val=1.0, precision=precision, callbacks=callbacks)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.fit(lit, torch.utils.data.DataLoader(_Cycle(data), batch_size=None))
        devnull.close()
        return paired.ms

    def ratio(ms: dict) -> float:
        return statistics.median([lit / plain for lit, plain in zip(ms["lightning"], ms["plain"], strict=True)])

    precisions = {"32-true": "", "bf16-mixed": "_bf16"}  # -> suffix of its target names
    runs = {p: paired_run(p) for p in precisions}
    out = {"rows": [{"loop": loop, "precision": p, "ms": round(statistics.median(runs[p][loop]), 2)}
                    for p in precisions for loop in ("lightning", "plain")],
           "overhead": round(ratio(runs["32-true"]) - 1, 3), "pairs": len(runs["32-true"]["plain"]),
           "targets": {}}
    for p, suffix in precisions.items():
        out["targets"][f"lightning_vs_plain{suffix}"] = verdict(ratio(runs[p]), 1.05)
    if size == "full":  # nanoGPT runs in float32, the only precision it runs on a CPU
        ref = interleaved({"nanogpt": nanogpt_step(data),
                           **{p: PlainLoop(build_model(cfg), data, p) for p in precisions}}, 4, 10, 3)
        out["nanogpt_ms"] = round(ref["nanogpt"]["ms"], 2)
        out["rows"].append({"loop": "nanogpt", "precision": "32-true", "ms": out["nanogpt_ms"]})
        for p, suffix in precisions.items():
            vs_nanogpt = ratio(runs[p]) * ref[p]["ms"] / ref["nanogpt"]["ms"]
            out["targets"][f"lightning{suffix}_vs_nanogpt"] = verdict(vs_nanogpt, 0.90)
    return out


class _Cycle(torch.utils.data.IterableDataset):
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        while True:
            yield from self.items


# ------------------------------------------------------------------------------------- startup

# Run `python -m blocklab.train` unchanged (the installed package: no checkout needed), with a global
# optimizer hook that prints a timestamp at each job's first (and last) optimizer step. Nothing in
# BlockLab is patched.
_PROBE = """
import functools, os, runpy, sys, time
from blocklab.startup import uncollected_imports
with uncollected_imports("torch"):  # as the run imports torch (in its checks), which finds it imported
    from torch.optim.optimizer import register_optimizer_step_post_hook
seen = {}
def hook(opt, args, kwargs):
    now = time.time()
    if id(opt) not in seen:
        print(f"BENCH first_step {now}", flush=True)
    seen[id(opt)] = now
    print(f"BENCH step {now}", flush=True)
register_optimizer_step_post_hook(hook)
if "BENCH_WANDB" in os.environ:  # time W&B's own init and finish (the bench's harness, not BlockLab)
    import wandb
    from wandb.sdk.wandb_run import Run
    def timed(name, fn):
        @functools.wraps(fn)  # BlockLab checks logger options against wandb.init's signature
        def wrapper(*args, **kwargs):
            start = time.time()
            out = fn(*args, **kwargs)
            print(f"BENCH {name} {start} {time.time()}", flush=True)
            return out
        return wrapper
    wandb.init, Run.finish = timed("wandb_init", wandb.init), timed("wandb_finish", Run.finish)
runpy.run_module("blocklab.train", run_name="__main__", alter_sys=True)
"""

# Each library's import on its own, in a fresh process, in the order a run imports them; with Python's cyclic
# garbage collector on (argument "on") or off, as a run imports them (blocklab.startup).
_IMPORTS = """
import gc, sys, time
if sys.argv[1] == "off":
    gc.disable()
marks = [time.time()]
import torch
marks.append(time.time())
import lightning
marks.append(time.time())
import wandb
marks.append(time.time())
print(*[b - a for a, b in zip(marks, marks[1:])])
"""


def startup(size: str = "full") -> dict:
    """Wall time from launching `python -m blocklab.train trainer=debug logger=none` (what `python
    train.py` runs) to its first optimizer step; and in a 3-job multirun run one job after another,
    between one job and the next: from its last training step (the gap, which includes the job's own
    evaluation) and from its results.json being written (the overhead: checkpoint, teardown and the
    next job's setup) to the next job's first step."""
    steps = 2 if size == "tiny" else 20
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"trainer.max_steps={steps}", "trainer=debug", "logger=none", "task.eval_examples=16"]
        single = _probe_run([f"hydra.run.dir={tmp}/single", *common], tmp)
        jobs = 2 if size == "tiny" else 3
        seeds = ",".join(str(i) for i in range(jobs))
        # One job after another in this process: the probe's hook sees no side-by-side worker's steps.
        multi = _probe_run(["-m", f"hydra.sweep.dir={tmp}/multi", "hydra.launcher.n_jobs=1", f"seed={seeds}", *common],
                           tmp)
        written = sorted(p.stat().st_mtime - multi["start"] for p in Path(tmp, "multi").glob("*/results.json"))
        debug = _probe_run([f"hydra.run.dir={tmp}/debug", "trainer=debug",
                            *([f"trainer.max_steps={steps}", "task.eval_examples=16"] if size == "tiny" else [])],
                           tmp, wandb=True)
        written_at = Path(tmp, "debug", "results.json").stat().st_mtime - debug["start"]
    first = single["first"][0]
    following = range(1, len(multi["first"]))
    gap = _mean([multi["first"][i] - multi["last_before"][i] for i in following])
    per_job = _mean([multi["first"][i] - written[i - 1] for i in following])
    rows = [{"measure": "start to first step", "s": round(first, 2)},
            {"measure": "process total", "s": round(single["total"], 2)},
            {"measure": "multirun: last step to next job's first (incl. evaluation)", "s": round(gap, 2)},
            {"measure": "multirun per-job overhead: results written to next job's first step", "s": round(per_job, 2)}]
    rows += _debug_breakdown(debug, written_at)
    return {"rows": rows, "first_step_s": round(first, 3), "multirun_gap_s": round(gap, 3),
            "multirun_per_job_s": round(per_job, 3), "debug_run_s": round(debug["total"], 3),
            "targets": {"start_to_first_step_s": verdict(first, 5.0), "multirun_per_job_s": verdict(per_job, 1.0),
                        "debug_run_s": verdict(debug["total"], 7.0)}}


def _debug_breakdown(debug: dict, written_at: float) -> list[dict]:
    """Where `python train.py trainer=debug` (default logger: W&B offline; default diagnostics) spends its wall
    time, phase by phase, and what the imports inside its first phase cost in a process of their own."""
    def imports(collector: str) -> list[float]:
        out = subprocess.run([sys.executable, "-c", _IMPORTS, collector], capture_output=True, text=True, check=True)
        return [float(s) for s in out.stdout.split()]

    torch_s, lightning_s, wandb_s = imports("off")
    collected_s = sum(imports("on"))
    init_s, finish_s = (sum(end - begin for begin, end in debug[name]) for name in ("wandb_init", "wandb_finish"))
    first, last = debug["first"][0], debug["last_step"]
    phases = [("debug run, default logger (W&B offline): start to exit", debug["total"]),
              ("  1. start to first step", first),
              ("     in it: importing torch (alone, in a fresh process, the cyclic collector off as in a run)",
               torch_s),
              ("     in it: importing lightning beyond torch (alone)", lightning_s),
              ("     in it: importing wandb (alone)", wandb_s),
              ("     (the three imports with the collector on, as runs imported them before)", collected_s),
              ("     in it: wandb.init", init_s),
              ("  2. first to last training step", last - first),
              ("  3. last step to results.json (diagnostics at the end, evaluation, decoding and memory costs)",
               written_at - last),
              ("  4. results.json to exit (W&B table, summary and finish; the printed summary; teardown)",
               debug["total"] - written_at),
              ("     in it: W&B run finish", finish_s)]
    return [{"measure": name, "s": round(value, 3)} for name, value in phases]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _probe_run(args: list[str], cwd: str, wandb: bool = False) -> dict:
    start = time.time()
    env = {**os.environ, "WANDB_SILENT": "true", **({"BENCH_WANDB": "1"} if wandb else {})}
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=cwd, capture_output=True, text=True, env=env)
    total = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"python -m blocklab.train failed:\n{proc.stderr[-2000:]}")
    first, last_before, previous = [], [], start
    spans = {"wandb_init": [], "wandb_finish": []}
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH "):
            kind, *stamps = line.split()[1:]
            if kind in spans:
                spans[kind].append(tuple(float(s) - start for s in stamps))
            elif kind == "first_step":
                first.append(float(stamps[0]) - start)
                last_before.append(previous - start)
            else:
                previous = float(stamps[0])
    return {"first": first, "last_before": last_before, "last_step": previous - start, "total": total,
            "start": start, **spans}


# -------------------------------------------------------------------------------------- decode

def decode(size: str = "full") -> dict:
    """Greedy generation of 256 new tokens after 16-token prompts at the baby config with learned
    positions: KV cache vs recomputing the whole sequence each token, for MHA, GQA and MQA, one
    sequence at a time (the target) and a batch of 8 (as evaluation decodes)."""
    new, prompt_len = (8, 4) if size == "tiny" else (256, 16)
    s = _sizes(size)
    rows, targets = [], {}
    g = torch.Generator().manual_seed(0)
    for batch in (1, 2) if size == "tiny" else (1, 8):
        prompts = [torch.randint(0, baby()["vocab"], (prompt_len,), generator=g) for _ in range(batch)]
        for attn in ("mha", "gqa", "mqa"):
            torch.manual_seed(0)
            cfg = baby_config(attn=attn, max_len=prompt_len + new, **{**_model_sizes(s), "block": s["block"]})
            model = build_model(cfg).eval()
            caches = []
            model.new_cache = lambda make=model.new_cache: caches.append(make()) or caches[-1]  # keep it to weigh it
            fns = {mode: (lambda use=mode == "cached": generate(model, prompts, new, use_cache=use))
                   for mode in ("cached", "recompute")}
            # One sequence is a short round (the `ms` column of `python -m blocklab.bench decode`), so more
            # rounds: best-of-5 steadies the ratio on a noisy machine.
            rounds = 1 if size == "tiny" else (5 if batch == 1 else 3)
            times = interleaved(fns, rounds, 1, warmup=1)
            for mode in fns:
                rows.append({"batch": batch, "attn": attn, "mode": mode, "ms": round(times[mode]["ms"], 1),
                             "tokens_per_s": round(batch * new / times[mode]["ms"] * 1000, 1),
                             "kv_cache_bytes": caches[-1].bytes() if mode == "cached" else 0})
            speedup = times["recompute"]["ms"] / times["cached"]["ms"]
            rows[-2]["speedup"] = round(speedup, 2)
            suffix = "" if batch == 1 else f"_batch{batch}"
            targets[f"{attn}_cached_speedup{suffix}"] = verdict(speedup, 5.0, lower_is_better=False)
    return {"rows": rows, "new_tokens": new, "targets": targets}


# --------------------------------------------------------------------------------- activations

def activations(size: str = "full") -> dict:
    """Forward + backward of one FFN of each activation at the baby config (gated: 2/3 hidden, same
    parameters), interleaved; relative to the fastest."""
    s = _sizes(size)
    x = torch.randn(s["batch"], s["block"], s["d_model"], requires_grad=True)
    fns = {}
    for name in ACTIVATIONS:
        torch.manual_seed(0)
        ffn = FFN(s["d_model"], s["d_ff"], name, bias=False)
        fns[name] = lambda ffn=ffn: ffn(x).sum().backward()
    times = interleaved(fns, s["rounds"], 4 * s["iters"], warmup=2)
    fastest = min(t["ms"] for t in times.values())
    rows = [{"act": name, "ms": round(t["ms"], 3), "vs_fastest": round(t["ms"] / fastest, 2)} for name, t in times.items()]
    targets = {"slowest_vs_fastest": verdict(max(t["ms"] for t in times.values()) / fastest, 2.0)}
    return {"rows": rows, "targets": targets}


BENCHMARKS = {"step": step, "overhead": overhead, "startup": startup, "attention": attention, "decode": decode,
              "activations": activations, "launch": launch, "malloc": malloc, "kernels": kernels, "masked": masked,
              "debug_mqar": debug_mqar}

