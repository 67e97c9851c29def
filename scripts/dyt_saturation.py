"""Why bare DyT did not learn the LM (docs/decisions/dyt-embedding-gain.md): the frontier page's recipe (LLaMA-style
decoder, d_model 64, AdamW 3e-3, 100 warmup steps, weight decay 0.1, clip 1.0) trained by hand, printing the loss and
how much the logits vary across positions. 0 means the final DyT is saturated: it gives one vector everywhere, so
the model can only predict the unigram.

    OMP_NUM_THREADS=1 python scripts/dyt_saturation.py [steps]     # about 1 min per variant on one core"""
import sys

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

VARIANTS = {"rmsnorm": ["norm=pre_rms"], "dyt, bare": ["norm=dyt", "norm.embedding_gain=false"],
            "dyt, authors' embeddings": ["norm=dyt"]}


def train(overrides: list[str], steps: int) -> list[tuple[int, float, float]]:
    from importlib.resources import files

    from blocklab.experiment import Setup
    from blocklab.model import build_model
    from blocklab.optim import adamw_groups

    with initialize_config_dir(config_dir=str(files("blocklab") / "conf"), version_base="1.3", job_name="dyt"):
        cfg = compose(config_name="config", overrides=["task=lm", "model.bias=false", "act=swiglu", *overrides,
                                                       "run_dir=unused"])
    setup = Setup.from_config(cfg)
    torch.manual_seed(0)
    model = build_model(setup.model_cfg)
    opt = torch.optim.AdamW(adamw_groups(model, {"lr": 3e-3, "weight_decay": 0.1}), betas=(0.9, 0.99))
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    batches, trace = iter(setup.task.train_batches()), []
    for step in range(1, steps + 1):
        batch = next(batches)
        logits = model(batch["input"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        warmup.step()
        if step % 50 == 0:
            trace.append((step, loss.item(), logits.std(dim=1).mean().item()))
    return trace


def main(steps: int):
    for name, overrides in VARIANTS.items():
        for step, loss, spread in train(overrides, steps):
            print(f"{name:26s} step {step:4d}  train loss {loss:.3f}  logit sd across positions {spread:.4f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
