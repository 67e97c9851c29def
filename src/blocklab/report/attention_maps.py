"""The `attention_maps` plot kind (exercise 1.2): the attention weights of the first probe example (layers x heads;
diagnostics.attention_maps=end), one row per setting and one column per `when` (init, end), from the run with the
lowest seed. Drawn from the weights the run recorded (results.json diagnostics.<when>.attention_weights, which a
findings page keeps in its jsonl), else, in the HTML report of older runs, from the heatmap PNGs they saved. Its
note gives, per setting, the mean over heads and seeds of attention entropy and mean |query - key| distance per
layer, over the answer's queries where the diagnostics recorded them (else over every query), at the first and the
last `when`.

Study spec: {kind: attention_maps, metric: attention_maps, by: task, when: [init, end]}.

The PNGs are named by the run's results.json, which may come from anyone: a recorded path is taken only where it
resolves inside that run's folder through no link (blocklab.folder.inside), is read through blocklab.folder, and is
drawn only if it is a PNG of a sane size; any other is left out, and the note says so."""
import io
import os
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from matplotlib.colors import PowerNorm
from matplotlib.image import imread

from blocklab import folder
from blocklab.errors import ConfigError
from blocklab.report.common import WHEN, takes
from blocklab.report.figures_data import attention_weights
from blocklab.results import RESULTS_FILE
from blocklab.schema import Spec

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_PIXELS = 25_000_000  # a 12-layer grid of 32 heads is about 15 million pixels; more is not a saved map
SAVED_DPI = 100  # analysis/plots.save: the saved figures' pixels per inch
MAX_WIDTH = 24.0  # inches for a whole row of figures (32 heads side by side would be 62)


@dataclass(frozen=True)
class _Whens(Spec):
    expect: str = "init, end or a list of them, e.g. [init, end]"

    def accepts(self, value):
        values = value if isinstance(value, list) else [value]
        return bool(values) and all(WHEN.accepts(v) for v in values)


def _maps(run: str, when: str, skipped: list[str]):
    """The heatmap a run's diagnostics saved at `when`, decoded (None if none). A recorded path that leaves the run
    folder, passes a link, or names no PNG is left out and named in `skipped`."""
    try:
        results = folder.read_json(run, RESULTS_FILE) if folder.exists(run, RESULTS_FILE) else {}
    except (ConfigError, OSError, ValueError, RecursionError):  # collect refused it already, or it changed since
        return None
    diagnostics = results.get("diagnostics") if isinstance(results, dict) else None
    measurement = (diagnostics.get(when) if isinstance(diagnostics, dict) else None) or {}
    recorded = measurement.get("attention_maps") if isinstance(measurement, dict) else None
    for path in recorded if isinstance(recorded, list) else []:
        name = f"{Path(run).name}: {str(path)[:80]!r}"
        inside = folder.inside(run, path) if isinstance(path, str) and path else None
        if inside is None:  # outside the run's folder, through a link, or a special file
            skipped.append(f"{name} (not a file inside the run's folder)")
            continue
        if not os.path.lexists(inside):  # deleted since: nothing to show
            continue
        try:
            return _decoded(folder.read_bytes(run, path))
        except (ConfigError, OSError, ValueError) as err:
            skipped.append(f"{name} ({' '.join(str(err).split())[:120]})")
    return None


def _decoded(data: bytes):
    """A PNG's pixels; ValueError (one line) where the bytes are not a PNG of a sane size."""
    if not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR" or len(data) < 24:
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    if width * height > MAX_PIXELS:
        raise ValueError(f"a PNG of {width} x {height} pixels, more than a saved map has")
    try:
        return imread(io.BytesIO(data), format="png")
    except Exception as err:  # noqa: BLE001 - a damaged PNG: Pillow raises many kinds
        raise ValueError(f"a damaged PNG ({type(err).__name__})") from None


def _per_layer(members: list[dict], when: str, metric: str) -> list[float] | None:
    """Mean over seeds of a per-layer series (layers_<when>), None if no run has it whole."""
    series = [m.get(f"layers_{when}", {}).get(metric) for m in members]
    series = [s for s in series if s and None not in s]
    return [sum(v) / len(v) for v in zip(*series)] if series else None


def _numbers(members: list[dict], whens: list[str]) -> str:
    """'entropy 1.51 -> 0.20, 1.50 -> 0.05 nats; distance ...' per layer, first `when` -> last, answer rows first."""
    parts = []
    for name, unit in (("attention_entropy", " nats"), ("attention_distance", "")):
        for key, where in ((f"{name}_answer", "answer queries"), (name, "all queries")):
            first, last = _per_layer(members, whens[0], key), _per_layer(members, whens[-1], key)
            if last is None:
                continue
            steps = [f"{a:.2f} → {b:.2f}" for a, b in zip(first, last)] if first and len(whens) > 1 \
                else [f"{b:.2f}" for b in last]
            parts.append(f"{name.split('_')[1]} ({where}) per layer {', '.join(steps)}{unit}")
            break
    return "; ".join(parts)


@takes(when=_Whens())
def plot_attention_maps(ax, rows: list[dict], spec: dict, metric: str, by: list[str]) -> str | None:
    """Hides the one axes the report hands over and fills its figure with the saved heatmaps (settings x `when`)."""
    whens = [spec["when"]] if isinstance(spec.get("when"), str) else list(spec.get("when") or ["end"])
    groups = defaultdict(list)
    for row in rows:
        groups[tuple(str(row.get(k)) for k in by)].append(row)
    shown, skipped, firsts = [], [], []  # (label, seed, [image or None per when], members); maps left out
    for key, members in sorted(groups.items()):
        first = min(members, key=lambda m: (m.get("seed") is None, m.get("seed") or 0))
        firsts.append(first)
        recorded = any(attention_weights(first, w) for w in whens) or "run" not in first
        shown.append((", ".join(f"{k}={v}" for k, v in zip(by, key)), first.get("seed"),
                      [None if recorded else _maps(first["run"], w, skipped) for w in whens], members))
    fig = ax.figure
    ax.set_visible(False)  # kept, hidden: the report still titles and labels it
    numbers = [[attention_weights(first, w) for w in whens] for first in firsts]
    if any(m for row in numbers for m in row):
        _draw_weights(fig, [label for label, *_ in shown], [seed for _, seed, *_ in shown], whens, numbers)
        return " ".join(f"{label}: {_numbers(members, whens)} (mean over heads and {len(members)} runs)."
                        for label, _, _, members in shown)
    left_out = (f" Left out, as results.json names them: {'; '.join(skipped)}." if skipped else "")
    if not any(p is not None for *_, images, _ in shown for p in images):
        fig.text(0.5, 0.5, "no attention maps saved: run with diagnostics.attention_maps=end", ha="center")
        return left_out.strip() or None
    images = [images for *_, images, _ in shown]
    # Each saved figure at its own size (more heads: wider), within MAX_WIDTH: a 32-head grid stays readable
    # beside a 1-head one instead of being shrunk to the first figure's shape.
    sizes = [[im.shape[:2] if im is not None else (0, 0) for im in row] for row in images]
    widths = [max(max(row[c][1] for row in sizes), 1) for c in range(len(whens))]
    heights = [max(max(h for h, _ in row), 1) for row in sizes]
    scale = min(1 / SAVED_DPI, MAX_WIDTH / sum(widths))  # inches per pixel: as saved, unless too wide
    title = 0.35  # inches per row for its title
    fig.set_size_inches(scale * sum(widths), scale * sum(heights) + title * len(shown) + 0.4)
    axes = fig.subplots(len(shown), len(whens), squeeze=False, gridspec_kw={
        "width_ratios": widths, "height_ratios": [h + title / scale for h in heights]})
    for (label, seed, _, _), row_images, row_axes in zip(shown, images, axes):
        for when, image, cell in zip(whens, row_images, row_axes):
            cell.axis("off")
            cell.set_title(f"{label} (seed {seed}), at {when}", fontsize=11)
            if image is None:
                cell.text(0.5, 0.5, f"no map saved at {when}", ha="center", transform=cell.transAxes)
            else:
                cell.imshow(image)
    return " ".join(f"{label}: {_numbers(members, whens)} (mean over heads and {len(members)} runs)."
                    for label, _, _, members in shown) + left_out


def _draw_weights(fig, labels: list[str], seeds: list, whens: list[str], numbers: list[list]) -> None:
    """One block per setting and `when`: its layers (rows) x heads (columns), one sqrt colour scale for the figure
    (causal rows spread weight ~1/t, which a linear scale shows as one dark triangle)."""
    shapes = [(len(m), len(m[0])) for row in numbers for m in row if m]
    layers, heads = max(s[0] for s in shapes), max(s[1] for s in shapes)
    fig.set_size_inches(min(MAX_WIDTH, 1.3 * heads * len(whens) + 0.8), 1.3 * layers * len(labels) + 0.5 * len(labels))
    norm = PowerNorm(0.5, vmin=0, vmax=max(max(max(max(r) for r in h) for h in layer) for row in numbers
                                            for m in row if m for layer in m))
    blocks = fig.subfigures(len(labels), len(whens), squeeze=False)
    for label, seed, row, block_row in zip(labels, seeds, numbers, blocks):
        for when, maps, block in zip(whens, row, block_row):
            block.suptitle(f"{label} (seed {seed}), at {when}", fontsize=9)
            cells = block.subplots(layers, heads, squeeze=False)
            for layer, cell_row in enumerate(cells):
                for head, cell in enumerate(cell_row):
                    cell.set_xticks([])
                    cell.set_yticks([])
                    if maps and layer < len(maps) and head < len(maps[layer]):
                        cell.imshow(maps[layer][head], cmap="viridis", norm=norm, interpolation="nearest")
                        cell.set_title(f"L{layer} H{head}", fontsize=7, pad=2)
                    else:
                        cell.axis("off")
            if not maps:
                block.text(0.5, 0.5, f"no weights recorded at {when}", ha="center", fontsize=8)
