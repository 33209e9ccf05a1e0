"""The static core's `KVCache` and its capacity; a nested compile region sees one layer's (`LayerKV`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.core.config import is_int
from specdecode.decoding.cache import KVCache, write_layer

# The capacity is rounded up to a power of two (at least this), so calls of other lengths share one
# compiled shape; the masked slots cost little next to the weights (256 slots of SmolLM2-135M: ~6 MB).
MIN_CAPACITY = 16


def rows_capacity(
    prompts: Sequence[Sequence[int]], budgets: Sequence[int], gamma: int | None, capacity: int | None = None
) -> int:
    """The cache capacity of a static decode of `prompts` with `budgets`: past a row's budget a round
    writes gamma drafts, its bonus token and the pending one; a target step 1."""
    slack = 1 if gamma is None else gamma + 2
    return static_capacity(max(len(p) + b for p, b in zip(prompts, budgets)) + slack, capacity)


def static_capacity(slots: int, capacity: int | None = None) -> int:
    """The static caches' slots per row for a decode that needs `slots`: `capacity` where the caller
    fixes it (ValueError unless an int >= `slots`), else `slots` rounded up to a power of two."""
    if capacity is None:
        return max(MIN_CAPACITY, 1 << (slots - 1).bit_length())
    if not is_int(capacity) or capacity < slots:
        raise ValueError(
            f"capacity must be an int of at least {slots} cache slots (the longest prompt + its max_new_tokens "
            f"+ the core's slack), got {capacity!r}"
        )
    return capacity


class LayerKV:
    """The cache a decoder layer sees inside a nested region: `update` writes the region's buffers
    whatever layer index it is given, so one layer's trace is right for every layer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        self.keys, self.values, self.slots = keys, values, slots

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return write_layer(self.keys, self.values, self.slots, key_states, value_states)


class StaticKVCache(KVCache):
    """The static core's cache: the buffers are read whole under a boolean mask `[B, 1, T, S_cap]`,
    so a pass's shapes depend only on its batch size and width; rows never leave."""

    def prepare(self, num_new: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The position ids and a boolean mask (True where a query may attend); `dtype` is unused."""
        return self._place(num_new, self.capacity)

    def set_lengths(self, lengths: torch.Tensor, max_length: int | None = None) -> None:
        self.lengths = lengths

    # in place, as a nested layer region writes (`LayerKV`)
    _write = staticmethod(write_layer)

    def layer_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer `layer_idx`'s keys, values and the pass's write slots `[B, T]` once they exist, else None."""
        keys, values, slots = self.keys[layer_idx], self.values[layer_idx], self._write_slots
        if keys is None or values is None or slots is None:
            return None
        return keys, values, slots

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return True
