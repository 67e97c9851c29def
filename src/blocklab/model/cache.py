"""What a model keeps between decoding steps.

`DecodingCache` holds what every layer shares (which keys are held, their positions and padding,
an encoder's output) and one `LayerState` per layer, made by that layer's attention kind:
softmax attention keeps keys and values (`KVState`); a kind with a running state keeps that, and
then the cache keeps the position and padding of the newest key alone (`keeps_keys`), so its size
does not grow with the generation. For inference only (no autograd)."""
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class LayerState(Protocol):
    """The contract between an attention kind and the cache: what one layer keeps between steps."""

    def bytes(self) -> int:
        """Bytes held for this layer (spare buffer capacity not counted)."""

    def drop_oldest(self, count: int) -> None:
        """Forget the `count` oldest keys (a local pattern never looks that far back again)."""


class KVState:
    """Softmax attention's keys and values, in buffers that grow by doubling, so a decoding step writes
    its token into a free slot instead of copying everything held. Shapes (B, H_kv, capacity, d_head)."""

    def __init__(self):
        self.k_buf: Tensor | None = None
        self.v_buf: Tensor | None = None
        self.length = 0

    @property
    def keys(self) -> Tensor:
        return self.k_buf[:, :, :self.length]

    @property
    def values(self) -> Tensor:
        return self.v_buf[:, :, :self.length]

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this pass's (already rotated) keys and values after the held ones; return all of them."""
        end = self.length + k.shape[2]
        if self.k_buf is None or end > self.k_buf.shape[2]:
            self.k_buf, self.v_buf = self._grown(self.k_buf, k, end), self._grown(self.v_buf, v, end)
        self.k_buf.narrow(2, self.length, k.shape[2]).copy_(k)
        self.v_buf.narrow(2, self.length, v.shape[2]).copy_(v)
        self.length = end
        return self.k_buf.narrow(2, 0, end), self.v_buf.narrow(2, 0, end)

    def _grown(self, buffer: Tensor | None, new: Tensor, needed: int) -> Tensor:
        batch, heads, _, dim = new.shape
        grown = new.new_empty(batch, heads, max(2 * needed, 16), dim)
        if buffer is not None:
            grown[:, :, :self.length] = buffer[:, :, :self.length]
        return grown

    def drop_oldest(self, count: int) -> None:
        kept = self.length - count
        self.k_buf[:, :, :kept] = self.k_buf[:, :, count:self.length].clone()
        self.v_buf[:, :, :kept] = self.v_buf[:, :, count:self.length].clone()
        self.length = kept

    def bytes(self) -> int:
        return 0 if self.k_buf is None else sum(t.numel() * t.element_size() for t in (self.keys, self.values))


@dataclass
class DecodingCache:
    """Per sequence: the held keys have absolute indices start .. start + length - 1 in every layer
    (`positions` and `valid` describe them). Where no layer keeps keys (`keeps_keys` False: fixed-size
    running states), only the newest key's position and padding flag are held (length 1): what the
    next step continues from. Encoder-decoder models also keep the encoder output and each layer's
    cross-attention K/V."""

    window: int | None = None  # keys a query can see back (the pattern's reach, itself included); None: all
    keeps_keys: bool = True  # False: every layer keeps a state of a fixed size, no keys (linear kinds)
    length: int = 0
    start: int = 0  # absolute index of the first held key (> 0 once a window has dropped keys)
    positions: Tensor | None = None  # (B, length) position ids, for position biases and the next positions
    valid: Tensor | None = None  # (B, length) False where the key is padding; None when none is
    memory: Tensor | None = None  # encoder output (B, S, D)
    memory_valid: Tensor | None = None
    cross: dict = field(default_factory=dict)  # layer -> (k, v) of the memory
    layers: dict[int, LayerState] = field(default_factory=dict)

    @property
    def next_index(self) -> int:
        return self.start + self.length

    def state(self, layer: int, make: Callable[[], LayerState]) -> LayerState:
        """This layer's state, made by its attention kind on first use."""
        if layer not in self.layers:
            self.layers[layer] = make()
        return self.layers[layer]

    @property
    def keys(self) -> list[Tensor]:
        return [s.keys for s in self.layers.values() if isinstance(s, KVState)]

    @property
    def values(self) -> list[Tensor]:
        return [s.values for s in self.layers.values() if isinstance(s, KVState)]

    def bytes(self) -> int:
        """Bytes of every layer's state and the cross-attention keys and values."""
        cross = sum(t.numel() * t.element_size() for kv in self.cross.values() for t in kv)
        return sum(s.bytes() for s in self.layers.values()) + cross

    def total_bytes(self) -> int:
        """Bytes of everything held: `bytes()`, the held keys' positions and padding flags, the encoder output."""
        held = (self.positions, self.valid, self.memory, self.memory_valid)
        return self.bytes() + sum(t.numel() * t.element_size() for t in held if t is not None)

    def with_new_keys(self, positions: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Positions and validity (None: no padding) of the held keys followed by new ones."""
        k_positions = positions if self.positions is None else torch.cat((self.positions, positions), dim=1)
        if valid is None and self.valid is None:
            return k_positions, None
        held = self.valid if self.valid is not None else positions.new_ones(positions.shape[0], self.length, dtype=torch.bool)
        new = valid if valid is not None else positions.new_ones(positions.shape, dtype=torch.bool)
        return k_positions, torch.cat((held, new), dim=1)

    def commit(self, k_positions: Tensor, k_valid: Tensor | None) -> None:
        """After a forward pass: count the new keys, drop what the pattern never sees again (all but the
        newest key's position where no layer keeps keys)."""
        self.positions, self.valid = k_positions, k_valid
        self.length = self.positions.shape[1]
        keep = self.window if self.keeps_keys else 1
        drop = 0 if keep is None else self.length - keep
        if drop <= 0:
            return
        if self.keeps_keys:
            for state in self.layers.values():
                state.drop_oldest(drop)
        self.start, self.length = self.start + drop, keep
        self.positions = self.positions[:, drop:]
        self.valid = None if self.valid is None else self.valid[:, drop:]
