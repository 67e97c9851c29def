"""Attention heatmaps as PNG files (matplotlib, no display needed)."""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def attention_heatmaps(weights: list, out_dir: Path, tag: str) -> list[Path]:
    """One PNG per layer with a panel per head, for the first probe example. Returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for layer, w in enumerate(weights):
        heads = w.shape[0]
        fig, axes = plt.subplots(1, heads, figsize=(2.6 * heads, 2.8), squeeze=False)
        for head, ax in enumerate(axes[0]):
            ax.imshow(w[head].numpy(), cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
            ax.set_title(f"head {head}", fontsize=9)
            ax.set_xlabel("key", fontsize=8)
            ax.set_ylabel("query", fontsize=8)
            ax.tick_params(labelsize=6)
        fig.suptitle(f"layer {layer} attention ({tag})", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"attention_{tag}_layer{layer}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths
