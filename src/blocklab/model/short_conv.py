"""`attn.short_conv=K`: a depthwise causal convolution of width K over the new queries, keys and values of every
self-attention layer, whatever its kind (MHA included), as Based (Arora et al. 2024, sec. 4: short convolutions
beside linear attention) and Canon layers (Allen-Zhu 2025, "Physics of Language Models: Part 4.1": a causal
convolution of width 4 mixing each token with the few before it, added to its input) place it. Each channel of the
stacked q/k/v projection is mixed with its own K-1 predecessors and added back (the Canon residual):

    y_t = x_t + sum_{j=0}^{K-1} w_j * x_{t-j},    x_{t-j} = 0 before the first token and at padding.

Decoding keeps the last K-1 inputs per layer (a `ConvState`, fixed in size), so a cached step equals recomputation.
Cross-attention layers are left as they are (their keys are the encoder's, not a causal stream)."""
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ConvState:
    """The last K-1 (masked) inputs of one layer's convolution, (B, K-1, channels)."""

    def __init__(self):
        self.inputs: Tensor | None = None

    def bytes(self) -> int:
        return 0 if self.inputs is None else self.inputs.numel() * self.inputs.element_size()

    def drop_oldest(self, count: int) -> None:
        pass  # it holds the last K-1 inputs, not keys: a pattern's window does not shorten it


class ShortConv(nn.Module):
    """Depthwise causal convolution of width `width` over `channels`, added to its input (module docstring)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        # nn.Conv1d's own init, U(-1/sqrt(K), 1/sqrt(K)): +-0.5 at K=4. So the layer does not start as the identity:
        # each channel starts as itself plus a random mix of its K-1 predecessors of about its own size.
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x: Tensor, valid: Tensor | None = None, state: ConvState | None = None) -> Tensor:
        """x (B, T, channels) of the new tokens; valid (B, T) False at padding; state: what decoding held."""
        mixed = x if valid is None else x.masked_fill(~valid[..., None], 0.0)
        held = state.inputs if state is not None and state.inputs is not None else \
            mixed.new_zeros(x.shape[0], self.width - 1, x.shape[2])
        seq = torch.cat((held.to(mixed.dtype), mixed), dim=1)
        if state is not None:
            state.inputs = seq[:, seq.shape[1] - (self.width - 1):]
        y = F.conv1d(seq.transpose(1, 2), self.weight.to(mixed.dtype), groups=x.shape[2]).transpose(1, 2)
        return x + y
