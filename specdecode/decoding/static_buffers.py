"""The static core's buffers, kept per model and shape between compiled calls: a CUDA graph reads
and writes its inputs at the addresses it was recorded with, and buffers at new addresses make it
record again. A model (held weakly) keeps its `POOLED_SHAPES` most recent call shapes' buffers,
zeroed at each call and serving one call at a time; an uncompiled decode allocates per call.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

# zeros(name, shape, dtype, device): a zeroed buffer, by a name unique within its owner.
Zeros = Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
# A call's shape: (batch size, cache capacity).
CallShape = tuple[int, int]

# Call shapes whose buffers a model keeps; a call of another shape evicts the least recently used.
POOLED_SHAPES = 4

_Key = tuple[str, tuple[int, ...], torch.dtype, torch.device]
_Shapes = OrderedDict[CallShape, dict[_Key, list[torch.Tensor]]]
_POOL: weakref.WeakKeyDictionary[torch.nn.Module, _Shapes] = weakref.WeakKeyDictionary()
_IN_USE: set[int] = set()
_LOCK = threading.Lock()


def mark_static(*tensors: torch.Tensor) -> None:
    """Give tensors compiled graphs write in place fixed addresses (torch has no public API for it)."""
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


def fresh_zeros(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`Zeros` that allocates a new buffer (what a call outside the pool gets)."""
    return torch.zeros(shape, dtype=dtype, device=device)


def static_zeros(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`Zeros` that allocates a new buffer marked static (`mark_static`), outside the pool."""
    tensor = fresh_zeros(name, shape, dtype, device)
    mark_static(tensor)
    return tensor


class Lease:
    """The buffers one decode call of `shape` holds: pooled ones when `pooled`, else fresh ones."""

    def __init__(self, pooled: bool, shape: CallShape) -> None:
        self.pooled = pooled
        self.shape = shape
        self._taken: list[torch.Tensor] = []

    def zeros_for(self, owner: torch.nn.Module) -> Zeros:
        """`Zeros` of `owner`'s buffers."""
        return lambda name, shape, dtype, device: self.zeros(owner, name, shape, dtype, device)

    def zeros(
        self, owner: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zeroed buffer: `owner`'s pooled `name` for this call shape where one is free, else a new one."""
        if not self.pooled:
            return fresh_zeros(name, shape, dtype, device)
        key = (name, tuple(shape), dtype, torch.device(device))
        with _LOCK:
            shapes = _POOL.setdefault(owner, OrderedDict())
            kept = shapes.setdefault(self.shape, {}).setdefault(key, [])
            shapes.move_to_end(self.shape)
            _evict(shapes)
            free = next((tensor for tensor in kept if id(tensor) not in _IN_USE), None)
            tensor = free if free is not None else torch.zeros(shape, dtype=dtype, device=device)
            if free is None:
                kept.append(tensor)
            _IN_USE.add(id(tensor))
            self._taken.append(tensor)
        mark_static(tensor)
        return tensor.zero_() if free is not None else tensor

    def close(self) -> None:
        """Give the call's pooled buffers back (to the next call of their shape)."""
        with _LOCK:
            for tensor in self._taken:
                _IN_USE.discard(id(tensor))
            self._taken.clear()


def _evict(shapes: _Shapes) -> None:
    """Drop the least recently used call shapes past `POOLED_SHAPES` whose buffers no call holds."""
    for shape in list(shapes)[: max(len(shapes) - POOLED_SHAPES, 0)]:
        if not any(id(tensor) in _IN_USE for kept in shapes[shape].values() for tensor in kept):
            del shapes[shape]


@contextlib.contextmanager
def static_buffers(pooled: bool, shape: CallShape) -> Iterator[Lease]:
    """A `Lease` for a decode call of `shape`, given back on leaving the block (copy results out first)."""
    lease = Lease(pooled, shape)
    try:
        yield lease
    finally:
        lease.close()


def release_static_buffers(*models: torch.nn.Module) -> None:
    """Free the pooled buffers of `models` (all where none is named); later calls record graphs again."""
    with _LOCK:
        for model in models or list(_POOL.keys()):
            _POOL.pop(model, None)


def pooled_bytes(model: torch.nn.Module | None = None) -> int:
    """Bytes held in the pool for `model` (all models where None)."""
    with _LOCK:
        pools = [_POOL.get(model, OrderedDict())] if model is not None else list(_POOL.values())
        return sum(
            tensor.numel() * tensor.element_size()
            for shapes in pools
            for buffers in shapes.values()
            for kept in buffers.values()
            for tensor in kept
        )
