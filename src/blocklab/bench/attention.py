"""`python -m blocklab.bench attention`: what attention costs against sequence length n, for every
registered attention kind and every softmax pattern (exercise 1.1's O(n^2), and the cost side of
1.13/1.14's comparison).

Training: forward + backward of ONE attention layer (its q/k/v and output projections included, no
position scheme, batch 1), built from a ModelConfig as a model builds it, at n = 256 ... 8192 with
d_model 64 and 4 heads, and at n = 2048 with d_model 32 ... 256. The default kind's full pattern also
runs on its explicit path (the (n, n) weights materialised), the O(n^2) reference. A kind the config
refuses causal (linformer) runs non-causal, and a note says so. Sparse patterns get window = stride =
256. Every variant of one n is timed in turn (a, b, c, a, b, c, ...) so a shared machine's drift hits
all alike; the figure is the median of the rounds. Memory, two figures per step, both from torch's
own accounting (torch.profiler sees every allocation of its CPU allocator):
  peak_mb   the most bytes torch held at once during forward + backward, beyond what it held before
  saved_mb  what autograd keeps from the forward for the backward (unique storages, the input and
            weights included) plus the output: the layer's activation memory in a training step
Log-log slopes of time and memory against n are fitted over n >= 1024.

Position schemes that act inside attention (rotate or bias) are timed beside NoPE at n = 4096 on the
fused path. Decoding: a 1-layer model of each causal variant generates 2048 tokens with its cache,
all stepped in turn; the cache's bytes (all it holds per sequence, the keys' positions included) and
keys held are read at several lengths, and tokens/s over the last quarter (the longest contexts)."""
import functools
import os
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from blocklab.bench.common import interleaved, verdict
from blocklab.model import build_model
from blocklab.model.attention import ATTENTION_KINDS, build_attention
from blocklab.model.config import AttnConfig, ModelConfig, PosConfig
from blocklab.model.generate import decoding
from blocklab.model.mask import self_attention_context
from blocklab.model.patterns import ATTENTION_PATTERNS, build_pattern
from blocklab.model.position import POSITION_SCHEMES, PositionScheme, build_position

NOPE = "none"  # no position scheme: the cost of attention alone
HEADS, VOCAB = 4, 65
REACH_OPTIONS = ("window", "stride")  # pattern options set to the bench's reach (w = s = 256)

SIZES = {
    "full": dict(lengths=(256, 512, 1024, 2048, 4096, 8192), fit_from=1024, d_model=64, widths=(32, 64, 128, 256),
                 width_length=2048, pos_length=4096, reach=256, rounds=5, decode=2048,
                 checkpoints=(256, 512, 1024, 2048), threads=None),
    # --quick: a smoke test (tests), its figures meaningless. One thread: on a loaded machine, OpenMP's
    # threads waiting on each other make such tiny ops ~100x slower (2 threads: a minute, not seconds).
    "tiny": dict(lengths=(32, 64, 128), fit_from=64, d_model=32, widths=(16, 32), width_length=64, pos_length=64,
                 reach=8, rounds=1, decode=64, checkpoints=(16, 32, 64), threads=1),
}

# The targets (exercise 1.1), by variant label; a variant that is not registered has none.
# Slopes <= 1.2 over 1k-8k: these patterns, and every kind whose decoding state has a fixed size (no bytes per
# token: linear, performer, gla, deltanet, based, and any registered later), whose state must not grow either.
LINEAR_PATTERNS = ("softmax/window", "softmax/strided")
WINDOW = "softmax/window"  # trains >= 5x faster than full at n = 8192; its decoding cache stays at w keys


@dataclass(frozen=True)
class Variant:
    """One attention kind with one pattern, as the config names them."""

    kind: str
    pattern: str
    causal: bool = True
    explicit: bool = False  # softmax weights materialised (need_weights): the O(n^2) reference path

    @property
    def label(self) -> str:
        name = f"{self.kind}/{self.pattern}" if ATTENTION_KINDS[self.kind].honours_patterns else self.kind
        return f"{name} explicit" if self.explicit else name

    @property
    def skips_masked_work(self) -> bool | None:
        """Whether only (about) the allowed pairs are computed; None: a kind that forms no (n, n) scores to mask."""
        if not ATTENTION_KINDS[self.kind].honours_patterns:
            return None
        return ATTENTION_PATTERNS[self.pattern].skips_masked_work and not self.explicit

    def config(self, d_model: int, max_len: int, reach: int, pos: str = NOPE, n_layers: int = 1) -> ModelConfig:
        options = {key: reach for key in REACH_OPTIONS if key in ATTENTION_PATTERNS.options(self.pattern)}
        window = options.pop("window", None)  # AttnConfig's own field, which every windowed pattern reads
        attn = AttnConfig(kind=self.kind, pattern=self.pattern, window=window, causal=self.causal,
                          pattern_options=options)
        return ModelConfig(vocab_size=VOCAB, d_model=d_model, n_layers=n_layers, n_heads=HEADS, max_len=max_len,
                           pos=PosConfig(name=pos), attn=attn)


def reference() -> Variant:
    """Full attention of the default kind (softmax), which every ratio is taken against."""
    return Variant(AttnConfig.kind, AttnConfig().pattern_name)


def variants(d_model: int, max_len: int, reach: int) -> tuple[list[Variant], dict[str, str], dict[str, str]]:
    """Every registered kind with every pattern it honours (a kind that honours none: full only), causal
    where the config allows, else non-causal; after the reference, its explicit path.
    -> (variants, notes by label, the config's reason by label for any that cannot run at all)."""
    found, notes, skipped = [], {}, {}
    for kind in ATTENTION_KINDS:
        for pattern in ATTENTION_PATTERNS:
            if ATTENTION_PATTERNS[pattern].sparse and not ATTENTION_KINDS[kind].honours_patterns:
                continue  # refused by the config for every such kind: nothing to measure
            causal, open_ = Variant(kind, pattern), Variant(kind, pattern, causal=False)
            errors = causal.config(d_model, max_len, reach).errors()
            if not errors:
                found.append(causal)
                if causal == reference():
                    found.append(replace(causal, explicit=True))  # the O(n^2) reference path
            elif not open_.config(d_model, max_len, reach).errors():
                found.append(open_)
                notes[open_.label] = (f"{open_.label} runs non-causal (its ratios compare it with causal ones): "
                                      f"{errors[0]}")
            else:
                skipped[causal.label] = errors[0]
    return found, notes, skipped


class Layer:
    """One attention layer of a variant, with its pattern and position scheme, as a model builds them."""

    def __init__(self, variant: Variant, d_model: int, max_len: int, reach: int, pos: str = NOPE):
        cfg = variant.config(d_model, max_len, reach, pos)
        torch.manual_seed(0)
        self.variant, self.pos = variant, pos
        self.attn = build_attention(cfg)
        self.pattern = build_pattern(cfg.attn)
        self.scheme = build_position(pos, d_model, HEADS, cfg.d_head, variant.causal, **cfg.position_options())

    def forward(self, x):
        idx = torch.empty(x.shape[:2], dtype=torch.long, device=x.device)  # its shape and device are read
        ctx = self_attention_context(idx, None, None, None, self.scheme, self.variant.causal, self.pattern,
                                     need_weights=self.variant.explicit)
        return self.attn(x, ctx)

    def step(self, x, pack=None):
        """A training step's forward + backward (gradients set to None first, as zero_grad does);
        `pack` sees every tensor autograd saves for the backward."""
        for t in (x, *self.attn.parameters(), *self.scheme.parameters()):
            t.grad = None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if pack else nullcontext():
            out = self.forward(x)
        if pack:
            pack(out)
        out.sum().backward()
        self.attn.last_weights = None  # the explicit path keeps its (n, n) weights for analysis; not here

    def memory(self, x) -> dict:
        """peak_mb and saved_mb of one step (module docstring)."""
        saved = {}

        def pack(t):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return t

        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self.step(x, pack)
        return {"peak_mb": _mb(_peak_bytes(prof)), "saved_mb": _mb(sum(saved.values()))}


@contextmanager
def _quiet_stderr():
    """Kineto logs every profiler start and stop on file descriptor 2: keep the console for the tables."""
    sys.stderr.flush()
    kept, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(kept, 2)
        os.close(kept)
        os.close(devnull)


def _peak_bytes(prof) -> int | None:
    """The most bytes torch's allocator held at once during the profile, beyond what it held at the start."""
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except AttributeError:  # the profiler's internals moved: no figure rather than a wrong one
        return None
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()  # negative when freed
        peak = max(peak, held)
    return peak


def _mb(n: int | None) -> float | None:
    return None if n is None else round(n / 2 ** 20, 3)


def fit_slope(xs, ys) -> float | None:
    """The exponent p of y ~ c x^p: a least-squares line through (log x, log y)."""
    if len(xs) < 2 or any(y is None or y <= 0 for y in ys):
        return None
    return round(float(np.polyfit(np.log(xs), np.log(ys), 1)[0]), 3)


def measure(layers: dict, n: int, d_model: int, rounds: int, sweep: str) -> list[dict]:
    """Time every layer in turn at length n (median of the rounds), then weigh one step of each."""
    x = torch.randn(1, n, d_model, requires_grad=True)
    fns = {key: functools.partial(layer.step, x) for key, layer in layers.items()}
    times = interleaved(fns, rounds, max(1, 2048 // n), warmup=1)  # several calls a round when a call is short
    return [{"sweep": sweep, "variant": layer.variant.label, "pos": layer.pos,
             "path": "explicit" if layer.variant.explicit else "fast", "causal": layer.variant.causal,
             "length": n, "d_model": d_model, "ms": round(times[key]["ms_median"], 3),
             "ms_best": round(times[key]["ms"], 3), **layer.memory(x)} for key, layer in layers.items()]


def decode(found: list[Variant], s: dict) -> tuple[list[dict], dict[str, str]]:
    """A 1-layer model of each causal variant generates s['decode'] tokens greedily from one token with
    its cache, all stepped in turn: cache bytes and keys held at the checkpoints, tokens/s over the last
    quarter of the generation."""
    runs, notes = {}, {}
    for v in found:
        if not v.causal or v.explicit:
            continue  # a non-causal model has no step-by-step decoding
        torch.manual_seed(0)
        model = build_model(v.config(s["d_model"], s["decode"] + 1, s["reach"])).eval()
        runs[v.label] = {"model": model, "cache": model.new_cache(), "token": torch.zeros(1, 1, dtype=torch.long),
                         "state_bytes": [], "keys_held": [], "ms": []}
    with decoding():
        for step in range(s["decode"]):
            for label, run in list(runs.items()):
                start = time.perf_counter()
                try:
                    logits = run["model"](run["token"], cache=run["cache"])
                except NotImplementedError as err:  # a kind with no decoding state
                    notes[label] = f"{label} does not decode: {err}"
                    del runs[label]
                    continue
                if step >= s["decode"] * 3 // 4:
                    run["ms"].append(1000 * (time.perf_counter() - start))
                run["token"] = logits[:, -1:].argmax(-1)
                cache = run["cache"]
                if cache.next_index in s["checkpoints"]:
                    run["state_bytes"].append(cache.total_bytes())  # with the held keys' positions
                    run["keys_held"].append(max((k.shape[2] for k in cache.keys), default=0))
    return [{"variant": label, "lengths": list(s["checkpoints"]), "state_bytes": run["state_bytes"],
             "keys_held": run["keys_held"], "tokens_per_s": round(1000 / statistics.median(run["ms"]), 1)}
            for label, run in runs.items()], notes


def inside_attention(name: str) -> bool:
    """A position scheme that acts inside attention (a rotation or a bias), whose cost is attention's."""
    scheme = POSITION_SCHEMES[name]
    return scheme.rotate is not PositionScheme.rotate or scheme.adds_bias()


def attention(size: str = "full") -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(SIZES[size]["threads"] or threads)
    try:
        return _attention(SIZES[size])
    finally:
        torch.set_num_threads(threads)


def _attention(s: dict) -> dict:
    lengths, longest, d = s["lengths"], max(s["lengths"]), s["d_model"]
    found, notes, skipped = variants(d, longest, s["reach"])
    layers = {v.label: Layer(v, d, longest, s["reach"]) for v in found}
    rows = [row for n in lengths for row in measure(layers, n, d, s["rounds"], "n")]
    for width in s["widths"]:
        wide = {v.label: Layer(v, width, s["width_length"], s["reach"]) for v in found}
        rows += measure(wide, s["width_length"], width, s["rounds"], "d")
    schemes = [NOPE, *(p for p in POSITION_SCHEMES if inside_attention(p))]
    by_pos = {p: Layer(reference(), d, s["pos_length"], s["reach"], pos=p) for p in schemes}
    rows += measure(by_pos, s["pos_length"], d, s["rounds"], "pos")
    decoded, decode_notes = decode(found, s)
    notes.update(decode_notes)

    summary = []
    for v in found:
        mine = [r for r in rows if r["sweep"] == "n" and r["variant"] == v.label]
        fit = [r for r in mine if r["length"] >= s["fit_from"]]
        wide = [r for r in rows if r["sweep"] == "d" and r["variant"] == v.label]
        summary.append({"variant": v.label, "kind": v.kind, "pattern": v.pattern, "causal": v.causal,
                        "explicit": v.explicit, "skips_masked_work": v.skips_masked_work,
                        "fixed_state": layers[v.label].attn.state_bytes_per_token(4) == 0,
                        "ms": [r["ms"] for r in mine], "peak_mb": [r["peak_mb"] for r in mine],
                        "saved_mb": [r["saved_mb"] for r in mine],
                        **{f"{key}_slope": fit_slope([r["length"] for r in fit], [r[key] for r in fit])
                           for key in ("ms", "peak_mb", "saved_mb")},
                        "width_ms": [r["ms"] for r in wide],
                        "width_slope": fit_slope([r["d_model"] for r in wide], [r["ms"] for r in wide])})
    full = next(row for row in summary if row["variant"] == reference().label)
    for row in summary:
        row["vs_full"] = round(row["ms"][-1] / full["ms"][-1], 3)
    pos_rows = [r for r in rows if r["sweep"] == "pos"]
    for row in pos_rows:
        row["vs_nope"] = round(row["ms"] / pos_rows[0]["ms"], 3)

    out = {"rows": rows, "summary": summary, "decode": decoded, "skipped": skipped,
           "settings": {"lengths": list(lengths), "fit_from": s["fit_from"], "d_model": d, "n_heads": HEADS,
                        "batch": 1, "widths": list(s["widths"]), "width_length": s["width_length"],
                        "pos_length": s["pos_length"], "reach": {k: s["reach"] for k in REACH_OPTIONS},
                        "rounds": s["rounds"], "decode_tokens": s["decode"]},
           "targets": targets(summary, decoded, pos_rows, s)}
    out["notes"] = [*notes.values(), *(f"{label} not measured: {why}" for label, why in skipped.items()),
                    "ms: one attention layer's forward + backward (projections included, batch 1), median of "
                    f"{s['rounds']} interleaved rounds; slopes: log-log fit over n >= {s['fit_from']}",
                    "peak MB: the most torch's CPU allocator held at once in the step; saved MB: what autograd "
                    "keeps for the backward plus the output (the layer's activation memory)",
                    "state bytes: one layer's decoding cache for one sequence, all it holds (K/V or running state, "
                    "and the held keys' positions); keys held: K/V entries kept"]
    out["tables"] = tables(out, s)
    return out


def near(value: float, target: float, tolerance: float) -> dict:
    """verdict() for a value that should sit within `tolerance` of `target`."""
    miss = abs(value - target) - tolerance
    return {"value": round(value, 3), "target": target, "tolerance": tolerance, "met": miss <= 0,
            "off_by": 0.0 if miss <= 0 else round(miss / target, 3)}


def targets(summary: list[dict], decoded: list[dict], pos_rows: list[dict], s: dict) -> dict:
    by = {row["variant"]: row for row in summary}
    dec = {row["variant"]: row for row in decoded}
    n = max(s["lengths"])
    full, explicit = by[reference().label], by[replace(reference(), explicit=True).label]
    out = {"explicit_time_slope": near(explicit["ms_slope"], 2.0, 0.2),
           "explicit_memory_slope": near(explicit["peak_mb_slope"], 2.0, 0.2)}
    fixed = [row["variant"] for row in summary if row["fixed_state"]]
    for label in (*LINEAR_PATTERNS, *fixed):
        if label in by:
            key = label.replace("/", "_")
            out[f"{key}_time_slope"] = verdict(by[label]["ms_slope"], 1.2)
            out[f"{key}_memory_slope"] = verdict(by[label]["peak_mb_slope"], 1.2)
    if WINDOW in by:
        out[f"window_speedup_vs_full_at_{n}"] = verdict(full["ms"][-1] / by[WINDOW]["ms"][-1], 5.0,
                                                        lower_is_better=False)
    if WINDOW in dec:
        out["window_cache_keys"] = verdict(dec[WINDOW]["keys_held"][-1], s["reach"])
    for label in fixed:
        if label in dec:
            grown = dec[label]["state_bytes"]
            out[f"{label}_decoding_state_growth"] = verdict(grown[-1] / grown[0], 1.0)
    out[f"sdpa_vs_explicit_time_at_{n}"] = verdict(full["ms"][-1] / explicit["ms"][-1], 1.0)
    out[f"sdpa_vs_explicit_memory_at_{n}"] = verdict(full["peak_mb"][-1] / explicit["peak_mb"][-1], 0.5)
    for row in pos_rows[1:]:
        out[f"{row['pos']}_vs_nope_at_{row['length']}"] = verdict(row["vs_nope"], 1.10)
    return out


def tables(out: dict, s: dict) -> dict[str, list[dict]]:
    """What the console shows: per variant time and memory by n (slopes, ratio to full), time by width;
    the position schemes; decoding."""
    n = max(s["lengths"])
    yes = {True: "yes", False: "no", None: "–"}

    def by(keys, values, prefix=""):
        return {f"{prefix}{k}": _short(v) for k, v in zip(keys, values, strict=True)}

    cost = [{"variant": r["variant"], "causal": yes[r["causal"]], "skips work": yes[r["skips_masked_work"]],
             **by(s["lengths"], r["ms"]), "slope": r["ms_slope"], f"vs full@{n}": r["vs_full"]}
            for r in out["summary"]]
    memory = [{"variant": r["variant"], **by(s["lengths"], r["peak_mb"]), "slope": r["peak_mb_slope"],
               f"saved MB@{n}": _short(r["saved_mb"][-1]), "saved slope": r["saved_mb_slope"]} for r in out["summary"]]
    width = [{"variant": r["variant"], **by(s["widths"], r["width_ms"], "d="), "d slope": r["width_slope"]}
             for r in out["summary"]]
    pos = [{"pos": r["pos"], "ms": _short(r["ms"]), "vs nope": r["vs_nope"], "peak MB": _short(r["peak_mb"])}
           for r in out["rows"] if r["sweep"] == "pos"]
    dec = [{"variant": r["variant"], **{f"bytes@{k}": b for k, b in zip(r["lengths"], r["state_bytes"], strict=True)},
            f"keys held@{r['lengths'][-1]}": r["keys_held"][-1], "tokens/s (last quarter)": r["tokens_per_s"]}
           for r in out["decode"]]
    return {f"ms per forward + backward by n (d_model {s['d_model']}, {HEADS} heads, batch 1)": cost,
            "peak MB held by torch's allocator in forward + backward, by n": memory,
            f"ms by d_model at n = {s['width_length']} ({HEADS} heads)": width,
            f"position schemes inside attention, {reference().label}, n = {s['pos_length']}": pos,
            f"decoding {s['decode']} tokens, 1-layer model, one sequence": dec}


def _short(x: float | None) -> float | int | None:
    """A figure for the console: 3 significant digits, no decimals past them."""
    if not x:
        return x
    digits = 2 - int(np.floor(np.log10(abs(x))))
    return round(x, digits) if digits > 0 else round(x)
