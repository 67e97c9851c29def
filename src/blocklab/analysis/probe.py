"""Measure a model on a fixed probe batch: per layer and head, what the theory talks about."""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from blocklab.analysis import activations, metrics
from blocklab.model.norm import bounds_token_length
from blocklab.tasks.base import IGNORE, device_of, model_inputs, on_device


def prenorm_score_bounds(model, block) -> list[float] | None:
    """M per head: the largest |score| a pre-norm attention layer can produce.

    The normalized input has ||x|| <= R = Gamma sqrt(d_model) + ||beta||, so |q_h . k_h| * scale
    <= scale (sigma(W_Q,h) R + ||b_Q,h||)(sigma(W_K,h) R + ||b_K,h||). With one head, no biases and
    scale 1/sqrt(d) this is the seed's M = Gamma^2 sigma_Q sigma_K sqrt(d). None where the bound
    does not apply: post-norm inputs are not normalized, BatchNorm bounds no single token, position biases
    and qk_norm change scores."""
    cfg = model.cfg
    attn, norm = block.attn, block.attn_residual.norm_in
    if norm is None or not bounds_token_length(norm) or cfg.attn.qk_norm or model.pos.adds_bias() \
            or not getattr(attn, "per_head_qk", True) \
            or getattr(attn, "adds_score_bias", False):  # MLA: keys from a latent; forgetting: a decay on the scores
        return None
    gamma = float(norm.weight.abs().max()) if norm.weight is not None else 1.0
    beta = float(norm.bias.norm()) if getattr(norm, "bias", None) is not None else 0.0
    radius = gamma * math.sqrt(cfg.d_model) + beta
    group = attn.n_heads // attn.n_kv_heads
    bounds = []
    for head in range(attn.n_heads):
        rows_q = slice(head * attn.d_head, (head + 1) * attn.d_head)
        kv = head // group
        rows_k = slice(kv * attn.d_head, (kv + 1) * attn.d_head)
        q_max = _row_block_bound(*attn.projection("q"), rows_q, radius)
        k_max = _row_block_bound(*attn.projection("k"), rows_k, radius)
        bounds.append(attn.scale * q_max * k_max)
    return bounds


def _row_block_bound(weight: Tensor, bias: Tensor | None, rows: slice, radius: float) -> float:
    sigma = float(torch.linalg.matrix_norm(weight[rows].double(), ord=2))
    bias = float(bias[rows].norm()) if bias is not None else 0.0
    return sigma * radius + bias


@torch.no_grad()
def forward_stats(model, batch: dict, sparsity_eps: float = 1e-3, keep_weights: bool = False) -> dict:
    """One forward pass with attention weights and hooks; per-layer statistics (lists over layers). The model runs
    where its weights are; what it produced is measured on the CPU (in float64 where it matters)."""
    was_training = model.training
    model.eval()
    blocks = list(model.blocks)
    outputs, hidden = {}, {}
    hooks = [b.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out.cpu()))
             for i, b in enumerate(blocks)]
    hooks += [b.ffn.out_proj.register_forward_pre_hook(lambda m, a, i=i: hidden.__setitem__(i, a[0].cpu()))
              for i, b in enumerate(blocks) if hasattr(b.ffn, "out_proj")]  # MoE: one hidden per expert, no sparsity
    pre = {}  # pre-activations of the dense FFNs (gated: the gate's half, which FFN.forward chunks first)
    hooks += [b.ffn.in_proj.register_forward_hook(
        lambda m, a, out, i=i, gated=b.ffn.gated: pre.__setitem__(i, (out.chunk(2, dim=-1)[0] if gated else out).cpu()))
        for i, b in enumerate(blocks) if hasattr(b.ffn, "in_proj") and hasattr(b.ffn, "act")]
    on_model = on_device(batch, device_of(model))
    for block in blocks:
        block.attn.last_scores = None  # a kind without scores leaves None, never an earlier forward's
    try:
        logits, weights = model(on_model["input"], need_weights=True, **model_inputs(on_model))
        positions = torch.arange(batch["input"].shape[1], device=device_of(model))[None]
        embedded = model.pos.embed(model.embed_tokens(on_model["input"]), positions).cpu()
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    weights = [w.cpu() for w in weights]
    scores = [None if b.attn.last_scores is None else b.attn.last_scores.cpu() for b in blocks]
    batch = on_device(batch, torch.device("cpu"))
    valid = batch["valid"]
    # The queries the loss reads (the answer's): where a task's attention pattern shows, undiluted by the prompt's rows.
    answer = batch["target"] != IGNORE if "target" in batch else None
    layers = []
    for i, (block, w) in enumerate(zip(blocks, weights)):
        w = w.double()
        norms = metrics.spectral_norms(w)  # (B, H)
        n_keys = w.shape[-1]
        score_bounds = prenorm_score_bounds(model, block)
        similarity = metrics.head_similarity(w)
        x = outputs[i]
        layers.append({
            "layer": i,
            "spectral_norm": norms.mean(0).tolist(),
            "spectral_norm_max": norms.amax(0).tolist(),
            "spectral_generic_bound": list(metrics.generic_bounds(n_keys)),
            # under the mask the model applied (causal, pattern, padding): the keys each query attends to
            "spectral_prenorm_bound": None if score_bounds is None else
            metrics.prenorm_bound_masked(w > 0, torch.tensor(score_bounds)).tolist(),
            "attention_entropy": metrics.attention_entropy(w).tolist(),
            "attention_distance": metrics.attention_distance(w).tolist(),
            # the attention sink: the share of each head's attention on the first token (an explicit softmax, above)
            "first_token_share": metrics.first_token_share(w, valid).tolist(),
            # attention-logit growth: the largest pre-softmax score (None: the kind has no softmax scores)
            "max_attention_logit": None if scores[i] is None else _finite(metrics.max_score(scores[i], w, valid)),
            **_answer_rows(w, answer),
            "head_similarity": similarity.tolist(),
            "head_similarity_mean": metrics.mean_off_diagonal(similarity),
            "relative_residual": metrics.relative_residual(x, valid),
            "activation_rms": metrics.rms(x[valid]),
            "ffn_sparsity": metrics.sparsity(hidden[i][valid], sparsity_eps) if i in hidden else None,
            **_ffn_off(pre.get(i), valid, block),
        })
    stats = {"n_keys": weights[0].shape[-1], "embedding_relative_residual": metrics.relative_residual(embedded, valid),
             "embedding_rms": metrics.rms(embedded[valid]), "layers": layers,
             **{k: _finite(v) for k, v in output_measures(logits.cpu(), batch).items()}}
    if keep_weights:
        stats["weights"] = [w[0].float() for w in weights]  # first example, for the heatmaps
    return stats


def output_measures(logits: Tensor, batch: dict) -> dict:
    """The output logits' maximum and mean log Z (metrics.output_logit_stats) and the probe batch's loss, over the
    positions the loss reads (the loss at init is a learning-rate sensitivity's l_0: report/lr_sensitivity.py)."""
    target = batch.get("target")
    if target is None or target.shape != logits.shape[:2]:  # a model scored elsewhere than every position
        return metrics.output_logit_stats(logits, batch["valid"])
    scored = target != IGNORE
    loss = F.cross_entropy(logits.double()[scored], target[scored]) if scored.any() else None
    return {**metrics.output_logit_stats(logits, scored), "probe_loss": None if loss is None else float(loss)}


@torch.no_grad()
def logit_growth(model, batch: dict) -> dict:
    """The two instabilities Wortsman et al. 2023 name, measured on the probe batch with an explicit softmax (one
    forward in eval mode, no gradient): each layer's maximum attention logit, the maximum output logit, mean log Z
    and the probe loss. Recorded at every validation (train/diagnostics.py), so a page plots them against step."""
    was_training = model.training
    model.eval()
    blocks = list(model.blocks)
    for block in blocks:
        block.attn.last_scores = None
    on_model = on_device(batch, device_of(model))
    try:
        logits, weights = model(on_model["input"], need_weights=True, **model_inputs(on_model))
    finally:
        model.train(was_training)
    batch = on_device(batch, torch.device("cpu"))
    valid = batch["valid"]
    point = {"max_attention_logit": [None if b.attn.last_scores is None else
                                     _finite(metrics.max_score(b.attn.last_scores.cpu(), w.cpu(), valid))
                                     for b, w in zip(blocks, weights)]}
    return {**point, **{k: _finite(v) for k, v in output_measures(logits.cpu(), batch).items()}}


def _finite(x: float | None) -> float | None:
    """A number results.json can hold (JSON has no inf or NaN): None where the model overflowed."""
    return x if x is not None and math.isfinite(x) else None


def _ffn_off(pre, valid, block) -> dict:
    """Units in their activation's flat tail (analysis/activations.py): the fraction of (token, unit) pairs, and the
    units off on every real probe token (dead over the probe batch)."""
    if pre is None:
        return {}
    off, dead = activations.off_fraction_and_dead(pre[valid].double(), block.ffn.act)
    return {"ffn_off": off, "ffn_dead": dead, "ffn_units": pre.shape[-1],
            "ffn_off_level": activations.off_level(block.ffn.act)}


def _answer_rows(w, answer) -> dict:
    """Entropy and distance over the answer's query rows, where they are this layer's rows (self-attention)."""
    if answer is None or answer.shape != (w.shape[0], w.shape[2]) or not answer.any():
        return {}
    return {"attention_entropy_answer": metrics.attention_entropy(w, answer).tolist(),
            "attention_distance_answer": metrics.attention_distance(w, answer).tolist()}


def sublayer_gradient_norms(model) -> list[dict]:
    """||grad|| of each layer's attention and FFN weight matrices, from the gradients already there."""
    def norm(modules):
        grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None and p.dim() >= 2]
        return float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads))) if grads else None

    return [{"layer": i, "attn": norm([b.attn]), "ffn": norm([b.ffn]) if b.ffn is not None else None}
            for i, b in enumerate(list(model.blocks))]


def probe_gradients(model, batch: dict) -> list[dict]:
    """Gradient norms per sublayer for the loss on the probe batch (dropout off); leaves no gradients behind."""
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    batch = on_device(batch, device_of(model))
    with torch.enable_grad():
        logits = model(batch["input"], **model_inputs(batch))
        loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=IGNORE)
        loss.backward()
    grads = sublayer_gradient_norms(model)
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return grads


def measure(model, batch: dict, sparsity_eps: float = 1e-3, keep_weights: bool = False) -> dict:
    stats = forward_stats(model, batch, sparsity_eps, keep_weights)
    stats["gradients"] = probe_gradients(model, batch)
    return stats


def summarize(stats: dict) -> dict:
    """Scalars for a logger: one value per layer and measure."""
    flat = {}
    for layer in stats["layers"]:
        i = layer["layer"]
        flat[f"diag/spectral_norm_max/layer{i}"] = max(layer["spectral_norm_max"])
        flat[f"diag/relative_residual/layer{i}"] = layer["relative_residual"]["fro"]
        flat[f"diag/activation_rms/layer{i}"] = layer["activation_rms"]
        if layer["head_similarity_mean"] is not None:
            flat[f"diag/head_similarity/layer{i}"] = layer["head_similarity_mean"]
        flat[f"diag/attention_entropy/layer{i}"] = sum(layer["attention_entropy"]) / len(layer["attention_entropy"])
        if layer.get("max_attention_logit") is not None:
            flat[f"diag/max_attention_logit/layer{i}"] = layer["max_attention_logit"]
        if "first_token_share" in layer:
            flat[f"diag/first_token_share/layer{i}"] = sum(layer["first_token_share"]) / len(layer["first_token_share"])
        if layer["ffn_sparsity"] is not None:
            flat[f"diag/ffn_sparsity/layer{i}"] = layer["ffn_sparsity"]
    for key in ("max_output_logit", "mean_log_z"):
        if stats.get(key) is not None:
            flat[f"diag/{key}"] = stats[key]
    for grad in stats.get("gradients", []):
        for part in ("attn", "ffn"):
            if grad[part] is not None:
                flat[f"diag/grad_norm_{part}/layer{grad['layer']}"] = grad[part]
    return flat
