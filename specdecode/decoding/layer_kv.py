"""One decoder layer's static KV buffers: the in-place write every static pass makes
(`write_layer`), and a cache of that one layer (`LayerKV`) which a nested compile region builds
from the buffers it takes as inputs (`compiled.nested_layers`)."""

from __future__ import annotations

import torch


def write_layer(
    keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a pass's `[B, H_kv, T, D]` keys and values into one layer's `[B, H_kv, S_cap, D]`
    buffers at each row's `slots` `[B, T]`, in place; return the buffers."""
    # an indexed assignment rather than `scatter_`: inductor writes it into the buffers in place,
    # where a scatter into a graph input costs a copy of every layer's whole buffers per pass
    rows = torch.arange(key_states.shape[0], device=key_states.device).unsqueeze(1)
    keys[rows, :, slots] = key_states.transpose(1, 2)
    values[rows, :, slots] = value_states.transpose(1, 2)
    return keys, values


class LayerKV:
    """The cache a decoder layer's attention sees inside a nested region: `update` writes that
    layer's buffers whatever layer index it is given, so a trace of one layer is right for every
    layer (the region's tensors, not the layer's index, say which buffers it writes)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        self.keys, self.values, self.slots = keys, values, slots

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return write_layer(self.keys, self.values, self.slots, key_states, value_states)
