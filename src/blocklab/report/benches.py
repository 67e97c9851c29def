"""Benchmark sections of the report (`study.bench: NAME` or a list of names), one registry entry each: which
benchmark's JSON it reads (`python -m blocklab.bench BENCHMARK` writes outputs/bench/BENCHMARK.json; `--out FILE`
writes one file the report takes with `--bench FILE`) and how it renders. A section whose JSON is missing says
which command produces it.

- attention: time and memory of one attention layer against n, fitted slopes (exercises 1.1, 1.13, 1.14);
- positions: a training step's time per position scheme, RoPE / ALiBi / T5 / FIRE against none (exercise 1.8);
- activations: one FFN's forward + backward per activation (exercise 1.9).

The one exemption from blocklab.folder's reads: a benchmark's JSON is not a file of the sweep folder but the
benchmark's own output, read by design from outputs/bench (under the working directory or under the `outputs`
folder the sweep lies in) or from the file --bench names. Its figures are written, as every report file is, through
blocklab.folder (report.output.Out)."""
import io
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from blocklab import folder  # noqa: E402
from blocklab.errors import ConfigError  # noqa: E402
from blocklab.registry import Registry  # noqa: E402
from blocklab.report import render  # noqa: E402
from blocklab.report.output import Out  # noqa: E402
from blocklab.report.render import Code, Figure, Items, Para, Table, cells, para  # noqa: E402

BENCH_DIR = Path("outputs") / "bench"


@dataclass(frozen=True)
class BenchSection:
    benchmark: str  # python -m blocklab.bench BENCHMARK
    title: str
    anchor: str  # the section's id
    render: Callable[[dict, Out], render.Section]  # (the bench JSON, the report folder) -> the section


BENCH_SECTIONS: Registry = Registry("study.bench")


def names(value) -> list[str]:
    """study.bench as a list of section names (a name, a list of names, or none)."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def read(path: Path) -> dict:
    """A bench JSON; one line naming the file and the fix where it is not one (truncated, not JSON, not ours).
    Read by design from outside any sweep folder (outputs/bench, --bench FILE): the module docstring's exemption."""
    try:
        info = os.stat(path)  # a link is followed (outputs/ may link another disk), but only to a regular file
        if not stat.S_ISREG(info.st_mode) or info.st_size > folder.CAPS[".json"]:
            raise ConfigError(f"{path}: not a benchmark results file (a special file, or over "
                              f"{folder.CAPS['.json']:,} bytes); rerun python -m blocklab.bench, or pass another "
                              "file with --bench")
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ConfigError(f"{path}: unreadable benchmark results ({type(err).__name__}: {err}); delete it and rerun "
                          "python -m blocklab.bench, or pass another file with --bench") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks", {}), dict):
        raise ConfigError(f"{path}: not a file python -m blocklab.bench wrote (no `benchmarks` mapping); rerun "
                          "python -m blocklab.bench --out FILE")
    return data


def find(benchmark: str, root: Path, extra: list[Path] = ()) -> dict | None:
    """The newest JSON holding `benchmark`: a file given with --bench, else outputs/bench/BENCHMARK.json under the
    working directory or under the `outputs` folder the sweep lies in."""
    for path in extra:
        data = read(path)
        if benchmark in data.get("benchmarks", {}):
            return data
    candidates = [BENCH_DIR / f"{benchmark}.json"]
    candidates += [p / "bench" / f"{benchmark}.json" for p in Path(root).resolve().parents if p.name == "outputs"]
    found = [p for p in candidates if p.exists()]
    return read(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def load(name: str, root: Path, extra: list[Path] = ()) -> dict | None:
    """The JSON section `name` reads (None: none found); an unreadable one raises ConfigError before any file is
    written."""
    return find(BENCH_SECTIONS[name].benchmark, root, extra)


def section_data(name: str, data: dict | None, out: "Out | Path") -> render.Section:
    entry, out = BENCH_SECTIONS[name], Out.of(out)
    if data is None:
        return render.Section(entry.anchor, entry.title, [para(
            "", "No benchmark results yet: run ", Code(f"python -m blocklab.bench {entry.benchmark}"),
            f" (it writes {BENCH_DIR / (entry.benchmark + '.json')}), or give a file it wrote with --out to ",
            Code("python -m blocklab.report SWEEP_DIR --bench FILE"), ".")])
    try:
        return entry.render(data, out)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:  # a JSON of another shape
        return render.Section(entry.anchor, entry.title, [para(
            "Unreadable.", f"The {entry.benchmark} benchmark results do not have the fields this section reads "
            f"({type(err).__name__}: {err}); rerun ", Code(f"python -m blocklab.bench {entry.benchmark}"), ".")])


def section(name: str, root: Path, out: "Out | Path", extra: list[Path] = ()) -> str:
    """A benchmark's section as HTML (see section_data)."""
    return render.section(section_data(name, load(name, root, extra), out))


def _table(header: list[str], body: list[list]) -> Table:
    return Table(cells(header), [cells(row) for row in body])


def _figure(fig, alt: str, caption: str, out: Out | None, name: str | None = None) -> Figure:
    """The figure inlined in the page, and written as `name` in the report folder `out` (if given)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    if out is not None and name is not None:
        out.write_bytes(name, buffer.getvalue())
    return Figure(render.png_uri(buffer.getvalue()), alt, caption)


def _machine(data: dict, result: dict) -> tuple:
    """Where and how the figures were measured; a --quick run's figures are a smoke test's."""
    m = data.get("machine", {})
    command = str(m.get("command", ""))
    quick = " These come from a --quick run (tiny sizes): the figures are a smoke test's, not measurements." \
        if "--quick" in command or "tiny" in command else ""
    return ("Measured by ", Code(command), f" on {m.get('cpu', 'an unnamed CPU')} (threads: {m.get('cpu_threads')}, "
            f"torch {m.get('torch')}; the benchmark took {result.get('wall_s')} s).{quick}")


def _targets(result: dict, keep=lambda key: True) -> list:
    items = [(k, v) for k, v in result.get("targets", {}).items() if keep(k)]
    return [para("Targets."), Items([f"{'PASS' if v['met'] else 'MISS'} {k}: {v['value']} (target {v['target']})"
                                     for k, v in items])] if items else []


def _bars(labels: list[str], ms: list[float], ratios: list[float], ratio_name: str, title: str):
    with matplotlib.rc_context({"text.parse_math": False}):  # labels from the JSON: text, never mathtext
        fig, ax = plt.subplots(figsize=(6.4, 3.4))
        bars = ax.bar(range(len(ms)), ms)
        for bar, ratio in zip(bars, ratios):
            ax.annotate(f"{ratio:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(ms)), [str(label) for label in labels], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms (best round)")
        ax.set_title(f"{title} (labels: {ratio_name})", fontsize=10)
    return fig


def _attention_plot(result: dict, out: Out | None = None, name: str = "attention_costs.png") -> bytes:
    """Time and peak memory against n, log-log, one line per variant (dashed: dense work, dotted: the
    explicit path), with grey n and n^2 guides; the PNG's bytes (also written as `name` in `out` if given)."""
    lengths = result["settings"]["lengths"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, unit in ((axes[0], "ms", "ms per forward + backward"), (axes[1], "peak_mb", "peak MB")):
        for row in result["summary"]:
            style = ":" if row["explicit"] else "--" if row["skips_masked_work"] is False else "-"
            ax.plot(lengths, row[key], style, marker="o", markersize=3, label=row["variant"])
        start = result["summary"][0][key][0]
        for power, label in ((1, "n"), (2, "n²")):  # guides through the first variant's first point
            guide = [start * (n / lengths[0]) ** power for n in lengths]
            ax.plot(lengths, guide, color="grey", linewidth=0.8, alpha=0.6)
            ax.annotate(label, (lengths[-1], guide[-1]), fontsize=7, color="grey")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(unit)
    axes[0].legend(fontsize=6, ncol=2)
    s = result["settings"]
    fig.suptitle(f"one attention layer, d_model {s['d_model']}, {s['n_heads']} heads, batch 1", fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    if out is not None:
        out.write_bytes(name, buffer.getvalue())
    return buffer.getvalue()


def _attention(data: dict, out: Out) -> render.Section:
    result, machine = data["benchmarks"]["attention"], data.get("machine", {})
    settings, lengths = result["settings"], result["settings"]["lengths"]
    n, yes = lengths[-1], {True: "yes", False: "no", None: "–"}
    blocks = [Para("Question.", ("How do time and memory of attention grow with sequence length n, for each "
                                 "attention kind and sparse pattern (exercise 1.1: O(n²) for full softmax attention; "
                                 "1.13/1.14: what sparse and linear attention save)?",), "question"),
              para("Setup.", "One attention layer (projections included, no position scheme), batch 1, "
                   f"d_model {settings['d_model']}, {settings['n_heads']} heads; forward + backward, median of "
                   f"{settings['rounds']} rounds with every variant timed in turn; sparse patterns with "
                   f"{', '.join(f'{k} {v}' for k, v in settings['reach'].items())}. Slopes: log-log fit over "
                   f"n ≥ {settings['fit_from']}. Measured by ", Code(str(machine.get("command", ""))),
                   f" (torch {machine.get('torch')}, {machine.get('cpu_threads')} threads).")]
    header = ["variant", "causal", "skips masked work", *(f"ms n={k}" for k in lengths), "time slope",
              f"peak MB n={n}", "memory slope", "saved-for-backward slope", f"time vs full n={n}"]
    body = [[r["variant"], yes.get(r["causal"], r["causal"]), yes.get(r["skips_masked_work"], r["skips_masked_work"]),
             *r["ms"], r["ms_slope"], r["peak_mb"][-1], r["peak_mb_slope"], r["saved_mb_slope"], r["vs_full"]]
            for r in result["summary"]]
    blocks.append(_table(header, body))
    with matplotlib.rc_context({"text.parse_math": False}):  # variant names from the JSON: text, never mathtext
        png = _attention_plot(result, out, "attention_costs.png")
    blocks.append(Figure(render.png_uri(png), "attention cost curves", "time and peak memory against n (log-log); "
                         "dashed: a dense mask over full attention, dotted: the explicit path; grey: n and n² through "
                         "the first variant's first point"))
    blocks.append(para("Width.", f"ms at n = {settings['width_length']}, d_model varied ({settings['n_heads']} "
                       "heads), and the log-log slope against d_model."))
    blocks.append(_table(["variant", *(f"d={d}" for d in settings["widths"]), "slope"],
                         [[r["variant"], *r["width_ms"], r["width_slope"]] for r in result["summary"]]))
    blocks += [para("Targets."), Items([
        f"{'PASS' if v['met'] else 'MISS'} {key}: {v['value']} (target {v['target']}"
        f"{' ± ' + str(v['tolerance']) if 'tolerance' in v else ''})" for key, v in result["targets"].items()])]
    if result.get("decode"):
        marks = result["decode"][0]["lengths"]
        blocks.append(para("Decoding", f"({settings['decode_tokens']} tokens, a 1-layer model, one sequence): bytes "
                           "the layer's cache holds, and tokens/s over the last quarter."))
        blocks.append(_table(["variant", *(f"bytes at {k}" for k in marks), f"keys held at {marks[-1]}", "tokens/s"],
                             [[r["variant"], *r["state_bytes"], r["keys_held"][-1], r["tokens_per_s"]]
                              for r in result["decode"]]))
    blocks.append(Items([str(note) for note in result.get("notes", [])]))
    return render.Section("attention_costs", "attention costs", blocks)


def _positions(data: dict, out: Out) -> render.Section:
    result = data["benchmarks"]["step"]
    rows = [r for r in result["rows"] if r["axis"] == "pos"]
    blocks = [Para("Question.", ("What does each position scheme cost in a training step, beside no position "
                                 "information at all (exercise 1.8: RoPE, ALiBi, T5 bias and FIRE against none)?",),
                   "question"),
              para("Setup.", "One training step (forward, backward, AdamW) of the nanogpt_baby model with one position "
                   "scheme changed, every variant timed in turn over several rounds (best round; the median shows the "
                   f"spread), {result.get('tokens_per_step')} tokens per step. ", *_machine(data, result))]
    header = ["scheme", "ms", "ms (median)", "tokens/s", "GFLOP/step", "vs none"]
    blocks.append(_table(header, [[r["variant"], r["ms"], r["ms_median"], r["tokens_per_s"], r["gflop_per_step"],
                                   r["vs_nope"]] for r in rows]))
    fig = _bars([r["variant"] for r in rows], [r["ms"] for r in rows], [r["vs_nope"] for r in rows], "× none",
                "training step per position scheme")
    blocks.append(_figure(fig, "position scheme costs", "ms per training step; labels: time relative to pos=none",
                          out, "position_costs.png"))
    blocks += _targets(result, keep=lambda key: key.endswith("_vs_nope"))
    return render.Section("position_costs", "position scheme costs", blocks)


def _activations(data: dict, out: Out) -> render.Section:
    result = data["benchmarks"]["activations"]
    rows = result["rows"]
    blocks = [Para("Question.", ("How fast is each FFN activation (exercise 1.9), plain and gated at the same "
                                 "parameter count?",), "question"),
              para("Setup.", "Forward + backward of one FFN at the nanogpt_baby sizes (gated: 2/3 of d_ff, the same "
                   "parameters), every activation timed in turn, best round. ", *_machine(data, result))]
    blocks.append(_table(["act", "ms", "vs fastest"], [[r["act"], r["ms"], r["vs_fastest"]] for r in rows]))
    fig = _bars([r["act"] for r in rows], [r["ms"] for r in rows], [r["vs_fastest"] for r in rows], "× fastest",
                "one FFN, forward + backward")
    blocks.append(_figure(fig, "activation speed", "ms per FFN forward + backward; labels: time relative to the "
                          "fastest", out, "activation_costs.png"))
    blocks += _targets(result)
    return render.Section("activation_costs", "activation speed", blocks)


BENCH_SECTIONS.register("attention")(BenchSection("attention", "attention costs", "attention_costs", _attention))
BENCH_SECTIONS.register("positions")(BenchSection("step", "position scheme costs", "position_costs", _positions))
BENCH_SECTIONS.register("activations")(BenchSection("activations", "activation speed", "activation_costs",
                                                    _activations))
