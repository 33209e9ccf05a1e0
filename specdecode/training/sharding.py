"""The target sharded over a job's processes (`train.shard_target`), for a target that does not fit
one device: FSDP2's `fully_shard` on each decoder layer, so each process holds 1/N of every layer and
gathers one layer's weights at a time in a forward. The embeddings, final norm and head (small beside
the layers; a tied head shares the embedding's weight) stay whole on every process. Every process
must run the same target forwards in the same order, as the online teacher's training steps do.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder layers of a causal LM (`model.get_decoder().layers`); a ValueError naming the model otherwise."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(
            f"train.shard_target: {type(model).__name__} has no decoder layers at get_decoder().layers to shard"
        )
    return layers


def shard_target(model: PreTrainedModel, device: torch.device, num_processes: int) -> None:
    """Shard `model`'s decoder layers over the `num_processes` processes of the initialised process
    group onto `device` (in place), and move the rest of `model` there whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (num_processes,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    for tensor in [*model.parameters(), *model.buffers()]:
        if not _is_sharded(tensor):
            tensor.data = tensor.data.to(device)


def held_fraction(model: nn.Module) -> float:
    """The share of `model`'s parameters this process holds (1.0 unsharded)."""
    total = held = 0
    for p in model.parameters():
        total += p.numel()
        held += p.to_local().numel() if _is_sharded(p) else p.numel()  # type: ignore[attr-defined]  # a DTensor
    return held / max(total, 1)


def _is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
