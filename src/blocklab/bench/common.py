"""What every benchmark shares: the baby config, interleaved timing, a nanoGPT reference, FLOPs.

Timings on a shared machine are only comparable side by side (other processes' load drifts within
minutes; `python -m blocklab.bench overhead` shows by how much): every comparison here runs its
variants interleaved in one process, several rounds, and keeps each variant's best round."""
import functools
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from blocklab.paths import CONF_DIR
from blocklab.model import ModelConfig, build_model

# nanoGPT's CPU "baby GPT" is conf/experiment/nanogpt_baby.yaml (4 layers, 4 heads, d_model 128, block 64,
# batch 12, its optimizer and schedule); the benchmarks compose it as a run does and change one choice at a time.
EXPERIMENT = "nanogpt_baby"
# Its vocabulary: nanoGPT's 65 characters of tinyshakespeare (a run's char tokenizer sizes its own from the data).
VOCAB = 65


@functools.lru_cache(maxsize=None)
def baby_composed(*overrides: str):
    """The nanogpt_baby experiment with `overrides` (`pos=rope`, `model.n_layers=1`), composed with Hydra's
    compose API from the packaged config; the hydra node is kept for its group choices."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={EXPERIMENT}", "run_dir=unused", *overrides],
                      return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    del cfg.hydra
    return OmegaConf.to_container(cfg, resolve=True), choices


def baby_choice(group: str) -> str:
    """The experiment's own option in a group (pos: learned, attn: mha, act: gelu)."""
    return baby_composed()[1][group]


@functools.lru_cache(maxsize=None)
def baby() -> dict:
    """The baby's sizes, read from the experiment: vocab d_model n_layers n_heads d_ff block batch."""
    groups = baby_composed()[0]
    model, task = groups["model"], groups["task"]
    return dict(vocab=VOCAB, d_model=model["d_model"], n_layers=model["n_layers"], n_heads=model["n_heads"],
                d_ff=model["d_ff"], block=task["block_size"], batch=task["batch_size"])


def baby_optim() -> dict:
    """The experiment's optimizer group (lr betas weight_decay warmup_steps min_lr), a copy."""
    return dict(baby_composed()[0]["optim"])


def baby_total_steps() -> int:
    """The steps the experiment trains for, where its cosine schedule reaches min_lr (trainer.max_steps)."""
    return baby_composed()[0]["trainer"]["max_steps"]


def attn_presets() -> list[str]:
    """The attention presets: the files of the conf/attn group (mha gqa mqa local ...)."""
    return sorted(path.stem for path in (CONF_DIR / "attn").glob("*.yaml"))


MODEL_SIZES = ("d_model", "n_layers", "n_heads", "d_ff")


def baby_config(pos: str | None = None, attn: str | None = None, act: str | None = None,
                max_len: int | None = None, **sizes) -> ModelConfig:
    """The baby's model config with one group option changed (None: the experiment's own) and sizes
    (d_model n_layers n_heads d_ff; block sizes the positions unless max_len is given)."""
    picked = [f"{group}={option}" for group, option in (("pos", pos), ("attn", attn), ("act", act)) if option]
    resized = [f"model.{key}={sizes[key]}" for key in MODEL_SIZES if key in sizes]
    groups = baby_composed(*picked, *resized)[0]
    return ModelConfig.from_groups(groups, vocab_size=VOCAB, max_len=max_len or sizes.get("block", baby()["block"]))


def batches(n: int, batch: int, block: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        window = torch.randint(0, vocab, (batch, block + 1), generator=g)
        out.append({"input": window[:, :-1].contiguous(), "target": window[:, 1:].contiguous(),
                    "valid": torch.ones(batch, block, dtype=torch.bool)})
    return out


def interleaved(fns: dict, rounds: int, iters: int, warmup: int = 2) -> dict[str, dict]:
    """ms per call of each fn, its variants run in turn (a, b, c, a, b, c, ...) so that load from
    other processes hits all of them alike. Best round is the figure; the median shows the spread."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            times[name].append(1000 * (time.perf_counter() - start) / iters)
    return {name: {"ms": min(t), "ms_median": sorted(t)[len(t) // 2]} for name, t in times.items()}


def matmul_peak_gflops(n: int = 1024, rounds: int = 5, iters: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """This machine's matmul throughput right now (best of a few rounds of an n x n x n product)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    ms = interleaved({"mm": lambda: a @ b}, rounds, iters)["mm"]["ms"]
    return 2 * n ** 3 / (ms / 1000) / 1e9


def train_flops(cfg: ModelConfig, batch: int, block: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward): 2 per multiply-add of every
    matrix (the tied head included, the embedding lookup not) plus QK^T and AV over the full square
    (nanoGPT's estimate_mfu, with linear layers counted exactly)."""
    model = build_model(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    tokens = batch * block
    attention = 2 * 2 * cfg.n_layers * cfg.d_model * block * tokens
    return 3 * (2 * linear * tokens + attention)


def verdict(value: float, target: float, lower_is_better: bool = True) -> dict:
    """Whether a ratio meets its target and by how much (a fraction: +0.08 = 8% past the target)."""
    met = value <= target if lower_is_better else value >= target
    miss = value / target - 1 if lower_is_better else target / value - 1
    # A miss under 0.05% still reads as a miss (0.001), not as 0.0, which means met.
    off_by = 0.0 if met else max(round(miss, 3), 0.001)
    return {"value": round(value, 3), "target": target, "met": met, "off_by": off_by}


# ------------------------------------------------------------------------- nanoGPT reference

class NanoGPT(nn.Module):
    """nanoGPT's model.py at the baby config (bias=False, dropout 0), for a same-run reference:
    fused c_attn, SDPA is_causal, exact GELU, tied head, N(0, 0.02) and c_proj scaled by 1/sqrt(2L)."""

    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, block: int):
        super().__init__()
        self.n_heads = n_heads
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(block, d_model)
        self.h = nn.ModuleList(NanoBlock(d_model) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, bias=False)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
        for block in self.h:  # nanoGPT's c_proj weights (attention and MLP outputs)
            for proj in (block.attn_proj, block.c_proj):
                nn.init.normal_(proj.weight, 0.0, 0.02 / (2 * n_layers) ** 0.5)

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x, self.n_heads)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class NanoBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x, n_heads):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, n_heads, d // n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.attn_proj(y)
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


def nanogpt_step(batch_list: list[dict]):
    """nanoGPT's train.py inner loop on CPU: forward, backward, clip 1.0, AdamW (foreach; nanoGPT fuses
    only on CUDA), zero_grad(set_to_none) -- the loss is read only at log intervals."""
    torch.manual_seed(0)
    size, optim = baby(), baby_optim()
    model = NanoGPT(size["vocab"], size["d_model"], size["n_layers"], size["n_heads"], size["block"])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": optim["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=optim["lr"], betas=tuple(optim["betas"]))
    state = {"i": 0}

    def step():
        batch = batch_list[state["i"] % len(batch_list)]
        state["i"] += 1
        loss = model(batch["input"], batch["target"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def autocast(precision: str):
    """The forward's precision context as Lightning sets it for `trainer.precision` on CPU."""
    if precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    return nullcontext()


@dataclass
class PlainLoop:
    """BlockLab's model trained the way the LightningModule trains it, without Lightning:
    cross-entropy, backward, clip 1.0, fused AdamW with the same param groups and LR schedule,
    the forward under `precision` (32-true or bf16-mixed)."""

    model: nn.Module
    batches: list
    precision: str = "32-true"
    i: int = 0

    def __post_init__(self):
        from blocklab.optim import build_optimizer
        from blocklab.train.module import lr_factor

        optim = baby_optim()
        self.opt = build_optimizer(self.model, optim)
        min_ratio = optim["min_lr"] / optim["lr"]
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, optim["warmup_steps"], baby_total_steps(), min_ratio))

    def __call__(self):
        from blocklab.tasks.base import IGNORE

        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        with autocast(self.precision):
            logits = self.model(batch["input"], valid=batch["valid"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step()


def default_copy_step(size: str):
    """A function that trains the default copy model (`python train.py`'s) one step a call, as its run does but
    without Lightning, loggers, diagnostics or checkpoints: the task's next training batch, loss, backward, clipping
    at trainer.gradient_clip_val, AdamW at the schedule's rate. tiny: a smaller model for a smoke test."""
    tiny = ["model.d_model=32", "model.n_layers=1", "task.batch_size=8", "task.max_len=8"] if size == "tiny" else []
    return default_step(tiny)


def full_logits_loss(lit, batch):
    """The token loss as the training step computed it before it selected the scored positions: the output layer
    and log-softmax at every position, the unscored ones ignored by cross-entropy (the same value)."""
    from blocklab.tasks.base import IGNORE, model_inputs

    logits = lit.model(batch["input"], **model_inputs(batch))
    return F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=IGNORE)


def default_step(overrides: list[str] = (), full_logits: bool = False, seed: int = 0):
    """A function that trains the model `python train.py OVERRIDES` builds one step a call, as its run does but
    without Lightning, loggers, diagnostics or checkpoints: the task's next training batch, loss, backward, clipping
    at trainer.gradient_clip_val, AdamW at the schedule's rate. full_logits: the loss as computed before the step
    selected the scored positions (`full_logits_loss`). The function's `lit` is the LightningModule it trains, its `task` the task."""
    from hydra import compose, initialize_config_dir

    from blocklab.experiment import Setup
    from blocklab.optim import build_optimizer
    from blocklab.train.module import LitTransformer, lr_factor

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        setup = Setup.from_config(compose(config_name="config", overrides=[
            "logger=none", "diagnostics=none", "run_dir=unused", *overrides]))
    optim, trainer = setup.config["optim"], setup.config["trainer"]
    torch.manual_seed(seed)
    lit = LitTransformer(setup.model_cfg, optim)
    opt = build_optimizer(lit.model, optim)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(
        s, optim["warmup_steps"], trainer["max_steps"], optim["min_lr"] / optim["lr"]))
    stream, clip = iter(setup.task.train_batches(0)), trainer.get("gradient_clip_val")
    loss_of = (lambda batch: full_logits_loss(lit, batch)) if full_logits else lit.batch_loss

    def step():
        loss_of(next(stream)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(lit.model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()

    step.lit, step.task = lit, setup.task
    return step
