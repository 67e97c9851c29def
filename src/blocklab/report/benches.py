"""Benchmark sections of the report (`study.bench: NAME` or a list of names), one registry entry each: which
benchmark's JSON it reads (`python -m blocklab.bench BENCHMARK` writes outputs/bench/BENCHMARK.json; `--out FILE`
writes one file the report takes with `--bench FILE`) and how it renders. A section whose JSON is missing says
which command produces it.

- attention: time and memory of one attention layer against n, fitted slopes (exercises 1.1, 1.13, 1.14);
- positions: a training step's time per position scheme, RoPE / ALiBi / T5 / FIRE against none (exercise 1.8);
- activations: one FFN's forward + backward per activation (exercise 1.9)."""
import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from blocklab.registry import Registry  # noqa: E402
from blocklab.report.attention_costs import attention_costs_section  # noqa: E402

BENCH_DIR = Path("outputs") / "bench"


@dataclass(frozen=True)
class BenchSection:
    benchmark: str  # python -m blocklab.bench BENCHMARK
    title: str
    anchor: str  # the section's id
    render: Callable[[dict, Path], str]  # (the bench JSON, the report folder) -> the <section>


BENCH_SECTIONS: Registry = Registry("study.bench")


def names(value) -> list[str]:
    """study.bench as a list of section names (a name, a list of names, or none)."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def find(benchmark: str, root: Path, extra: list[Path] = ()) -> dict | None:
    """The newest JSON holding `benchmark`: a file given with --bench, else outputs/bench/BENCHMARK.json under the
    working directory or under the `outputs` folder the sweep lies in."""
    for path in extra:
        data = json.loads(Path(path).read_text())
        if benchmark in data.get("benchmarks", {}):
            return data
    candidates = [BENCH_DIR / f"{benchmark}.json"]
    candidates += [p / "bench" / f"{benchmark}.json" for p in Path(root).resolve().parents if p.name == "outputs"]
    found = [p for p in candidates if p.exists()]
    return json.loads(max(found, key=lambda p: p.stat().st_mtime).read_text()) if found else None


def section(name: str, root: Path, out: Path, extra: list[Path] = ()) -> str:
    entry = BENCH_SECTIONS[name]
    data = find(entry.benchmark, root, extra)
    if data is None:
        return (f"<section id='{entry.anchor}'><h2>{html.escape(entry.title)}</h2><p>No benchmark results yet: run "
                f"<code>python -m blocklab.bench {entry.benchmark}</code> (it writes "
                f"{BENCH_DIR / (entry.benchmark + '.json')}), or give a file it wrote with --out to "
                f"<code>python -m blocklab.report SWEEP_DIR --bench FILE</code>.</p></section>")
    return entry.render(data, out)


def _table(header: list[str], body: list[list]) -> str:
    cells = lambda row, tag: "".join(f"<{tag}>{html.escape('–' if c is None else str(c))}</{tag}>" for c in row)  # noqa: E731
    return ("<div class='wide'><table><thead><tr>" + cells(header, "th") + "</tr></thead><tbody>"
            + "".join(f"<tr>{cells(row, 'td')}</tr>" for row in body) + "</tbody></table></div>")


def _figure(fig, alt: str, caption: str, path: Path | None) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    if path is not None:
        path.write_bytes(buffer.getvalue())
    data = base64.b64encode(buffer.getvalue()).decode()
    return (f"<figure><img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _machine(data: dict, result: dict) -> str:
    """Where and how the figures were measured; a --quick run's figures are a smoke test's."""
    m = data.get("machine", {})
    command = m.get("command", "")
    quick = " These come from a --quick run (tiny sizes): the figures are a smoke test's, not measurements." \
        if "--quick" in command or "tiny" in command else ""
    return (f"Measured by <code>{html.escape(command)}</code> on {html.escape(str(m.get('cpu', 'an unnamed CPU')))} "
            f"(threads: {m.get('cpu_threads')}, torch {html.escape(str(m.get('torch')))}; the benchmark took "
            f"{result.get('wall_s')} s)."
            f"{quick}")


def _targets(result: dict, keep=lambda key: True) -> str:
    items = [(k, v) for k, v in result.get("targets", {}).items() if keep(k)]
    return "<p><b>Targets.</b></p><ul>" + "".join(
        f"<li>{'PASS' if v['met'] else 'MISS'} {html.escape(k)}: {v['value']} (target {v['target']})</li>"
        for k, v in items) + "</ul>" if items else ""


def _bars(labels: list[str], ms: list[float], ratios: list[float], ratio_name: str, title: str):
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    bars = ax.bar(range(len(ms)), ms)
    for bar, ratio in zip(bars, ratios):
        ax.annotate(f"{ratio:.2f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks(range(len(ms)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms (best round)")
    ax.set_title(f"{title} (labels: {ratio_name})", fontsize=10)
    return fig


def _attention(data: dict, out: Path) -> str:
    return attention_costs_section(data, out)


def _positions(data: dict, out: Path) -> str:
    result = data["benchmarks"]["step"]
    rows = [r for r in result["rows"] if r["axis"] == "pos"]
    parts = ["<section id='position_costs'><h2>position scheme costs</h2>",
             "<p class='question'><b>Question.</b> What does each position scheme cost in a training step, beside no "
             "position information at all (exercise 1.8: RoPE, ALiBi, T5 bias and FIRE against none)?</p>",
             f"<p><b>Setup.</b> One training step (forward, backward, AdamW) of the nanogpt_baby model with one "
             f"position scheme changed, every variant timed in turn over several rounds (best round; the median "
             f"shows the spread), {result.get('tokens_per_step')} tokens per step. {_machine(data, result)}</p>"]
    header = ["scheme", "ms", "ms (median)", "tokens/s", "GFLOP/step", "vs none"]
    parts.append(_table(header, [[r["variant"], r["ms"], r["ms_median"], r["tokens_per_s"], r["gflop_per_step"],
                                  r["vs_nope"]] for r in rows]))
    fig = _bars([r["variant"] for r in rows], [r["ms"] for r in rows], [r["vs_nope"] for r in rows], "× none",
                "training step per position scheme")
    parts.append(_figure(fig, "position scheme costs", "ms per training step; labels: time relative to pos=none",
                         out / "position_costs.png"))
    parts.append(_targets(result, keep=lambda key: key.endswith("_vs_nope")))
    parts.append("</section>")
    return "\n".join(parts)


def _activations(data: dict, out: Path) -> str:
    result = data["benchmarks"]["activations"]
    rows = result["rows"]
    parts = ["<section id='activation_costs'><h2>activation speed</h2>",
             "<p class='question'><b>Question.</b> How fast is each FFN activation (exercise 1.9), plain and gated at "
             "the same parameter count?</p>",
             "<p><b>Setup.</b> Forward + backward of one FFN at the nanogpt_baby sizes (gated: 2/3 of d_ff, the "
             f"same parameters), every activation timed in turn, best round. {_machine(data, result)}</p>"]
    parts.append(_table(["act", "ms", "vs fastest"], [[r["act"], r["ms"], r["vs_fastest"]] for r in rows]))
    fig = _bars([r["act"] for r in rows], [r["ms"] for r in rows], [r["vs_fastest"] for r in rows], "× fastest",
                "one FFN, forward + backward")
    parts.append(_figure(fig, "activation speed", "ms per FFN forward + backward; labels: time relative to the "
                         "fastest", out / "activation_costs.png"))
    parts.append(_targets(result))
    parts.append("</section>")
    return "\n".join(parts)


BENCH_SECTIONS.register("attention")(BenchSection("attention", "attention costs", "attention_costs", _attention))
BENCH_SECTIONS.register("positions")(BenchSection("step", "position scheme costs", "position_costs", _positions))
BENCH_SECTIONS.register("activations")(BenchSection("activations", "activation speed", "activation_costs",
                                                    _activations))
