"""The static core's buffers, kept per model and shape between compiled calls.

A compiled step on CUDA is a CUDA graph that reads and writes its static inputs (KV buffers, token
rows, counters, a feature drafter's features) at the addresses it was recorded with. Where a later
call brings buffers at other addresses, CUDA graph trees record the graph again, and after
`torch._inductor.config.triton.cudagraph_unexpected_rerecord_limit` such records (128) run that
graph without CUDA graphs at all. gpt-fast keeps its caches as model buffers for this reason.

Here a compiled decode takes its static buffers from a pool (`static_buffers`), one set per model,
name, shape, dtype and device, zeroed in place at each call: later calls of one shape replay the
graphs the first recorded. A buffer serves one call at a time (a second call of the same shape
while one runs, or a model that is both target and drafter, gets a set of its own), and goes with
its model (the pool holds models weakly) or with `release_static_buffers`. An uncompiled decode
allocates its buffers per call, as before: nothing of it outlives the call.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

# zeros(name, shape, dtype): a zeroed buffer on an owner's device, by a name unique within the owner.
Zeros = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]

_Key = tuple[str, tuple[int, ...], torch.dtype, torch.device]
_POOL: weakref.WeakKeyDictionary[torch.nn.Module, dict[_Key, list[torch.Tensor]]] = weakref.WeakKeyDictionary()
_IN_USE: set[int] = set()
_LOCK = threading.Lock()


def fresh_zeros(device: torch.device) -> Zeros:
    """`Zeros` that allocates new buffers on `device` (what a call outside the pool gets)."""
    return lambda name, shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


class Lease:
    """The buffers one decode call holds: pooled ones when `pooled`, else fresh ones."""

    def __init__(self, pooled: bool) -> None:
        self.pooled = pooled
        self._taken: list[torch.Tensor] = []

    def zeros_for(self, owner: torch.nn.Module, device: torch.device) -> Zeros:
        """`Zeros` of `owner`'s buffers on `device`."""
        return lambda name, shape, dtype: self.zeros(owner, name, shape, dtype, device)

    def zeros(
        self, owner: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zeroed `shape` / `dtype` buffer on `device`: `owner`'s pooled `name`, where pooled and
        not held by another call, else a new one (pooled for later calls where pooled)."""
        if not self.pooled:
            return fresh_zeros(device)(name, shape, dtype)
        key = (name, tuple(shape), dtype, torch.device(device))
        with _LOCK:
            kept = _POOL.setdefault(owner, {}).setdefault(key, [])
            free = next((tensor for tensor in kept if id(tensor) not in _IN_USE), None)
            tensor = free if free is not None else torch.zeros(shape, dtype=dtype, device=device)
            if free is None:
                kept.append(tensor)
            _IN_USE.add(id(tensor))
            self._taken.append(tensor)
        return tensor.zero_() if free is not None else tensor

    def close(self) -> None:
        """Give the call's pooled buffers back (to the next call of their shape)."""
        with _LOCK:
            for tensor in self._taken:
                _IN_USE.discard(id(tensor))
            self._taken.clear()


@contextlib.contextmanager
def static_buffers(pooled: bool) -> Iterator[Lease]:
    """A decode call's `Lease`, given back on leaving the block (however it is left). Whatever the
    call returns must be copied out of its buffers first: the next call of the shape zeroes them."""
    lease = Lease(pooled)
    try:
        yield lease
    finally:
        lease.close()


def release_static_buffers(*models: torch.nn.Module) -> None:
    """Free the pooled buffers of `models` (all models where none is named), for their memory: a
    later compiled call allocates new ones, and on CUDA records its graphs again."""
    with _LOCK:
        for model in models or list(_POOL.keys()):
            _POOL.pop(model, None)


def pooled_bytes() -> int:
    """Bytes held in the pool (all models)."""
    with _LOCK:
        return sum(t.numel() * t.element_size() for kept in _POOL.values() for ts in kept.values() for t in ts)
