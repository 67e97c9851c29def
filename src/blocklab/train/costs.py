"""What a model costs, measured once after training (results.json `costs`, from outcome.py): peak memory of a
training step at a training batch and at the longest context the model was built for, forward FLOPs per token of a
training batch, and greedy decoding speed and the decoding state held at that context. Training speed is
results.json `tokens_per_s`."""
import time
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
from torch.utils._pytree import tree_leaves

from blocklab.model.generate import decoding
from blocklab.tasks import Task
from blocklab.hardware import finish_queued_work
from blocklab.tasks.base import IGNORE, device_of, model_inputs, on_device


class PeakMemory(TorchDispatchMode):
    """The most bytes of tensor storage made under it and alive at once (storage that existed before, such as the
    weights, is not counted). Counted per operator, so the figure is the same on any device or allocator and in
    any process; a kernel's internal scratch space is not seen."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in given and key not in self.live:  # new storage, not a view or an in-place result
                self.live[key] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)


def step_peak_bytes(model, batch: dict) -> int:
    """Peak memory of one forward + backward of `batch` beyond the weights (activations, gradients, temporaries;
    the optimizer's state is not counted). Float32, whatever precision training used."""
    was_training = model.training
    # A training-mode forward moves running statistics (BatchNorm's): a measurement must leave the model as it was.
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.train()
    batch = on_device(batch, device_of(model))
    with PeakMemory() as memory:
        logits = model(batch["input"], **model_inputs(batch))
        F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=IGNORE).backward()
        del logits
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    return memory.peak


# Torch's counter knows the CUDA attention kernels; the CPU one (causal or masked work counted dense) it does not.
_CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
             lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)}


def forward_flops_per_token(model, batch: dict) -> float:
    """FLOPs of one forward pass of a training batch per input position (torch's FlopCounterMode: matmuls and
    attention, 2 per multiply-add; masked attention counted as the kernel computes it)."""
    was_training = model.training
    model.eval()
    batch = on_device(batch, device_of(model))
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_CPU_SDPA) as counter:
        model(batch["input"], **model_inputs(batch))
    model.train(was_training)
    return counter.get_total_flops() / batch["input"].numel()


@decoding()
def decode_at(model, context: int, new_tokens: int, batch: int) -> dict:
    """Greedy cached decoding of the last `new_tokens` of `context` (random prompt tokens: speed and state do
    not depend on them): tokens/s of those steps, and the state held per sequence at `context` tokens."""
    shape, generator = (batch, context - new_tokens), torch.Generator().manual_seed(0)
    prompt = torch.randint(model.cfg.vocab_size, shape, generator=generator).to(device_of(model))
    cache = model.new_cache()
    token = model(prompt, cache=cache, **model.placeholder_streams(prompt))[:, -1:].argmax(-1)
    start = time.perf_counter()
    for _ in range(new_tokens):
        token = model(token, cache=cache, **model.placeholder_streams(token))[:, -1:].argmax(-1)
    finish_queued_work(token.device)
    elapsed = time.perf_counter() - start
    return {"decode_tokens_per_s": batch * new_tokens / elapsed, "decode_state_bytes": cache.bytes() // batch}


def costs(model, task: Task, new_tokens: int = 32, batch: int = 4) -> dict:
    """The measurements at a training batch and at the model's longest context (model.cfg.max_len: the longest
    sequence trained or evaluated). An encoder-decoder or bidirectional model records null where the
    measurement needs a causal decoder."""
    context, train_batch = model.cfg.max_len, next(iter(task.train_batches()))
    out = {"context": context, "step_peak_bytes": step_peak_bytes(model, train_batch),
           "forward_flops_per_token": forward_flops_per_token(model, train_batch), "context_step_peak_bytes": None,
           "decode_tokens_per_s": None, "decode_state_bytes": None}
    if model.is_encoder_decoder or not model.cfg.attn.causal:
        return out
    ids = torch.randint(model.cfg.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    out["context_step_peak_bytes"] = step_peak_bytes(
        model, {"input": ids[:, :-1], "target": ids[:, 1:], **model.placeholder_streams(ids[:, :-1])})
    return {**out, **decode_at(model, context, min(new_tokens, context - 1), batch)}
