"""The attention cost curves (exercises 1.1, 1.13, 1.14) as a report section: per attention kind and
pattern, time and peak memory of one layer's forward + backward against sequence length n (a table
with the fitted log-log slopes, and a log-log plot), the issue's targets, and decoding state. Reads
the JSON `python -m blocklab.bench attention` writes (outputs/bench/attention.json)."""
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from blocklab.report import render  # noqa: E402
from blocklab.report.render import Code, Figure, Items, Para, Table, cells, para  # noqa: E402

BENCH_JSON = Path("outputs") / "bench" / "attention.json"


def load(source: Path | str | dict = BENCH_JSON) -> tuple[dict, dict]:
    """A bench JSON (a path or its parsed content) -> (the attention benchmark's result, the machine)."""
    data = json.loads(Path(source).read_text()) if isinstance(source, (str, Path)) else source
    if "attention" not in data.get("benchmarks", {}):
        raise ValueError(f"{source if not isinstance(source, dict) else 'the bench JSON'} holds no attention "
                         f"benchmark; run python -m blocklab.bench attention")
    return data["benchmarks"]["attention"], data.get("machine", {})


def plot(result: dict, path: Path | None = None) -> bytes:
    """Time and peak memory against n, log-log, one line per variant (dashed: dense work, dotted: the
    explicit path), with grey n and n^2 guides; the PNG's bytes (also written to `path` if given)."""
    lengths = result["settings"]["lengths"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, unit in ((axes[0], "ms", "ms per forward + backward"), (axes[1], "peak_mb", "peak MB")):
        for row in result["summary"]:
            style = ":" if row["explicit"] else "--" if row["skips_masked_work"] is False else "-"
            ax.plot(lengths, row[key], style, marker="o", markersize=3, label=row["variant"])
        start = result["summary"][0][key][0]
        for power, name in ((1, "n"), (2, "n²")):  # guides through the first variant's first point
            guide = [start * (n / lengths[0]) ** power for n in lengths]
            ax.plot(lengths, guide, color="grey", linewidth=0.8, alpha=0.6)
            ax.annotate(name, (lengths[-1], guide[-1]), fontsize=7, color="grey")
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
    if path is not None:
        path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def _table(header: list[str], body: list[list]) -> Table:
    return Table(cells(header), [cells(row) for row in body])


def attention_costs_section(source: Path | str | dict = BENCH_JSON, out: Path | None = None) -> str:
    """The HTML <section> (id 'attention_costs'); its figure is inlined, and also written to
    out/attention_costs.png when `out` (the report folder) is given."""
    return render.section(attention_costs_data(source, out))


def attention_costs_data(source: Path | str | dict = BENCH_JSON, out: Path | None = None) -> render.Section:
    result, machine = load(source)
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
        png = plot(result, None if out is None else out / "attention_costs.png")
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
