"""Short training runs of one config at several widths, for the checks µP is judged by (param=mup, model/param.py):
the coordinate check (Yang et al. 2022, "Tensor Programs V", sec. D.1 and Fig. 5; mup's `get_coord_data`: the mean
|activation| of each layer after a few Adam steps, against width) and learning-rate transfer (the best lr of a grid at
each width). A plain loop over the task's training batches with BlockLab's own model, loss, AdamW groups
(build_optimizer), schedule (lr_factor) and gradient clipping: the training step `python train.py` takes, without
Lightning's evaluation and logging, so a grid of a hundred short runs fits a shared CPU."""
import math
from contextlib import contextmanager

import torch
from hydra import compose, initialize_config_dir

from blocklab.experiment import Setup
from blocklab.optim import build_optimizer
from blocklab.paths import CONF_DIR
from blocklab.train.module import LitTransformer, lr_factor


def width_setup(width: int, d_head: int = 16, overrides: list[str] | tuple[str, ...] = ()) -> Setup:
    """The validated setup of `python train.py OVERRIDES` at d_model=`width`, with `width / d_head` heads (µP widens at
    a fixed d_head) and d_ff the default 4 d_model."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="width_check"):
        cfg = compose(config_name="config", overrides=[*overrides, f"model.d_model={width}",
                                                       f"model.n_heads={width // d_head}", "run_dir=unused"])
    return Setup.from_config(cfg)


@contextmanager
def recorded_outputs(model: torch.nn.Module):
    """Forward hooks on every layer whose output the coordinate check reads: the token embedding, each block's
    attention and FFN sublayers and the block itself (the residual stream), and the output head (the logits). Yields
    a dict name -> the mean |output| of the last forward call."""
    sizes: dict[str, float] = {}
    layers = {"embedding": model.tok_emb, "logits": model.head}
    for i, block in enumerate(model.blocks):
        layers.update({f"block{i}.attn": block.attn, f"block{i}": block})
        if block.ffn is not None:
            layers[f"block{i}.ffn"] = block.ffn

    def hook(name):
        def record(module, inputs, output):
            sizes[name] = output.detach().abs().mean().item()
        return record

    handles = [layer.register_forward_hook(hook(name)) for name, layer in layers.items()]
    try:
        yield sizes
    finally:
        for handle in handles:
            handle.remove()


def train_briefly(setup: Setup, steps: int, clip: float | None = 1.0, record_at_end: bool = False) -> dict:
    """`steps` training steps of the setup's model from the config's seed (weights and batches), at its optim group
    (lr, warmup, cosine to min_lr at `steps`). Returns {"losses": the loss of each step, "sizes": each layer's mean
    |output| on the first batch after the last step (with record_at_end), "diverged": whether a loss was not finite}."""
    torch.manual_seed(setup.config["seed"])
    optim = setup.config["optim"]
    lit = LitTransformer(setup.model_cfg, optim)
    model = lit.model.train()
    optimizer = build_optimizer(model, optim)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    batches = iter(setup.task.train_batches())
    first = next(batches)
    losses = []
    for step in range(steps):
        factor = lr_factor(step, optim["warmup_steps"], steps, optim["min_lr"] / optim["lr"])
        for group, lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = lr * factor
        loss = lit.batch_loss(first if step == 0 else next(batches))
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            return {"losses": losses, "sizes": {}, "diverged": True}
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    sizes = {}
    if record_at_end:
        with torch.no_grad(), recorded_outputs(model) as sizes:
            lit.batch_loss(first)
    return {"losses": losses, "sizes": dict(sizes), "diverged": False}


def slope(widths: list[int], values: list[float]) -> float:
    """The least-squares slope of log(value) against log(width)."""
    xs, ys = [math.log(w) for w in widths], [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
