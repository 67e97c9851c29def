"""What a finished training run reports in results.json (the contract is blocklab/results.py)."""
import statistics
import time

import torch

from blocklab.hardware import finish_queued_work, machine_label, source_commit
from blocklab.model import ModelConfig
from blocklab.model.generate import generate
from blocklab.results import in_distribution_exact_match, learned_in_distribution
from blocklab.tasks import Task
from blocklab.tasks.base import device_of
from blocklab.schema import PRECISIONS
from blocklab.train.costs import costs, decode_at
from blocklab.train.job import beside_other_jobs


def choices(model_cfg: ModelConfig, seed: int, precision: str | int = "32-true", optimizer: str = "adamw") -> dict:
    """What was run, named by what the model computes (field overrides included)."""
    return {
        "norm": model_cfg.norm.name, "pos": model_cfg.pos.name, "act": model_cfg.act.name,
        "attn": model_cfg.attn_label, "init": model_cfg.init.name, "ffn": model_cfg.ffn_label,
        "param": model_cfg.param.name,
        "n_heads": model_cfg.n_heads, "n_layers": model_cfg.n_layers, "d_model": model_cfg.d_model, "seed": seed,
        "n_kv_heads": model_cfg.attn.n_kv_heads or model_cfg.n_heads, "d_ff": model_cfg.d_ff,
        "norm_type": model_cfg.norm.type, "norm_placement": model_cfg.norm.placement,
        "precision": PRECISIONS[precision], "placement": placement_label(model_cfg.pos),
        # the scheme as applied: "none" where pos=none, or RoPE on a kind that skips it (GLA, DeltaNet by default)
        "positions": model_cfg.pos.name if model_cfg.positions_applied else "none",
        "optim": optimizer,
    }


def placement_label(pos) -> str:
    """The length-generalization methods on positions a run used (pos.randomize, coupled, abacus), or "plain"."""
    methods = [name for name, used in (("randomized", pos.randomize), ("coupled", pos.coupled),
                                       ("abacus", pos.abacus)) if used]
    return "+".join(methods) or "plain"


def decode_stats(model, task: Task, new_tokens: int = 64, batch: int = 8, rounds: int = 3) -> dict:
    """How much the decoding state grows per token (each attention kind says) and cached greedy decoding speed:
    the median of `rounds` timed decodes after an untimed one. One decode takes tens of milliseconds, so a single
    timing is at the mercy of the first call's one-time costs and of any pause of the machine."""
    if not model.generates:  # an encoder-only model: nothing to decode
        return {"kv_cache_bytes_per_token": None, "tokens_per_s": None}
    cfg = model.cfg
    bytes_per_token = model.cache_bytes_per_token()
    probe = task.probe_batch(batch)
    prompts = [row[:8] for row in probe.get("source", probe["input"])]
    new_tokens = min(new_tokens, cfg.max_len - 8)  # a learned position table ends at max_len

    def seconds_to_decode() -> float:
        start = time.perf_counter()
        streams = [model.placeholder_streams(torch.zeros(len(p) + new_tokens, dtype=torch.long)) for p in prompts]
        generate(model, prompts, new_tokens, bos_id=task.bos_id, streams=streams)
        finish_queued_work(device_of(model))
        return time.perf_counter() - start

    seconds_to_decode()
    elapsed = statistics.median([seconds_to_decode() for _ in range(rounds)])
    return {"kv_cache_bytes_per_token": bytes_per_token, "tokens_per_s": batch * new_tokens / elapsed,
            "state_bytes": state_bytes_at_training_length(model, task)}


def state_bytes_at_training_length(model, task: Task) -> int | None:
    """The decoding state one sequence holds after as many tokens as a training sequence has: a KV cache that grows
    with them, or a recurrent kind's fixed state (plus any short convolution's buffer). What Zoology and Based plot
    recall against, at the length the model recalls over (costs.decode_state_bytes is at the longest context).
    None where nothing decodes token by token from a causal stream alone (an encoder-decoder, a bidirectional model)."""
    if model.is_encoder_decoder or not model.cfg.attn.causal:
        return None
    length = next(iter(task.train_batches()))["input"].shape[1]
    was_training = model.training
    model.eval()  # one sequence: BatchNorm in training mode has no batch statistics for it (and dropout draws)
    try:
        with torch.no_grad():
            return decode_at(model, length, 1, 1)["decode_state_bytes"]
    finally:
        model.train(was_training)


def outcome(task: Task, lit, diverged_at_step: int | None, steps: int, picked: dict) -> dict:
    """Evaluate the trained model (`lit`, a LitTransformer) and gather what the run measured. Times and
    throughput are the whole run's, the part before a resume included (`lit` carries them across)."""
    rows = task.evaluate(lit.model)
    in_dist = [r["loss"] for r in rows if r["in_distribution"] and r["loss"] is not None]
    results = {
        "status": "diverged" if diverged_at_step is not None else "completed",
        "task": task.name,
        "choices": picked,
        "params": lit.model.num_params(),
        "steps": steps,
        "train_time_s": round(lit.train_time_s, 3),
        # Null where nothing trained (trainer.max_steps=0): a rate of no steps is not a measurement.
        "tokens_per_s": lit.tokens_seen / lit.step_time_s if lit.step_time_s else (None if steps == 0 else 0.0),
        "ms_per_step": 1000 * lit.step_time_s / steps if steps else None,
        "threads": torch.get_num_threads(),  # the times above depend on it (trainer.threads, the launcher)
        "beside_other_jobs": beside_other_jobs(),  # then they depend on the jobs that ran beside it too
        "machine": machine_label(device_of(lit.model)),
        "commit": source_commit(),  # the code's git commit ("+modified": with changes not committed); null: none
        "final_train_loss": lit.last_train_loss,
        "final_val_loss": sum(in_dist) / len(in_dist) if in_dist else None,
        "diverged_at_step": diverged_at_step,
        "steps_to_target_loss": lit.steps_to_target,
        "train_loss_curve": lit.train_loss_curve,
        "val_loss_curve": lit.val_loss_curve,  # [step, validation loss] at each validation (results.val_loss_curve)
        "train_lengths": list(task.train_lengths),
        "eval": rows,
        "decode": decode_stats(lit.model, task),
        "costs": costs(lit.model, task),
        # MoE: each expert's share of the training assignments and the fraction dropped, per layer (null: no MoE).
        "moe": lit.routing,
        # The task's chance levels and the bar at which it is learned (tasks/references.py), for the report.
        "references": task.references().as_dict(),
    }
    # Whether the task was learned on the training lengths at all (null for a task without exact match):
    # below results.LEARNED_THRESHOLD the summary warns that the lengths beyond training say little.
    results["in_distribution_exact_match"] = in_distribution_exact_match(results)
    results["learned_in_distribution"] = learned_in_distribution(results)
    return results
