"""The teacher store: training sequences and the target's outputs on them, as safetensors shards
(`teacher.save_cache`) of contiguous prompt ranges plus the manifest `store.json`, written once
every shard is there. A shard is written whole or not at all (a rerun skips those it finds);
process r writes the shards j with j % num_processes == r. Training reads one shard at a time.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, overload

from safetensors import safe_open

from specdecode.core.atomic import write_atomic
from specdecode.training.sequences import TrainSequence
from specdecode.training.teacher import TeacherCache, concat_caches, sequences_only, single_cache

MANIFEST = "store.json"
# Prompts per shard, in generation batches: what a writer holds in memory, and what a kill loses.
SHARD_BATCHES = 4


def shard_ranges(prompts: int, size: int) -> list[tuple[int, int]]:
    """Consecutive `[start, stop)` ranges of `size` prompts (the last shorter) covering `prompts`."""
    return [(start, min(start + size, prompts)) for start in range(0, prompts, size)]


def shard_path(folder: Path, start: int, stop: int) -> Path:
    """The shard of prompts `[start, stop)`, named by its range (never mistaken for another partition's)."""
    return folder / f"prompts-{start:09d}-{stop:09d}.safetensors"


def write_shards(
    folder: Path,
    ranges: Sequence[tuple[int, int]],
    write: Callable[[int, int, Path], None],
    rank: int = 0,
    world: int = 1,
) -> list[Path]:
    """Write, by `write(start, stop, path)`, process `rank`'s shards (j % world == rank) not on disk
    yet; return the paths it wrote."""
    written = []
    for j, (start, stop) in enumerate(ranges):
        path = shard_path(folder, start, stop)
        if j % world != rank or path.is_file():
            continue
        write(start, stop, path)
        written.append(path)
    return written


def finish_store(folder: Path, ranges: Sequence[tuple[int, int]]) -> bool:
    """Write `folder`'s manifest once every shard is there (one process): each shard's file,
    sequences and loss positions; killed writers' temp files go. False while a shard is missing."""
    if (folder / MANIFEST).is_file():
        return True
    paths = [shard_path(folder, start, stop) for start, stop in ranges]
    if not all(p.is_file() for p in paths):
        return False
    for debris in folder.glob(".*.tmp"):  # `write_atomic`'s, left by a kill (no writer runs now)
        debris.unlink(missing_ok=True)
    shards = []
    for path in paths:
        with safe_open(path, framework="pt") as handle:
            count = handle.get_slice("response_start").get_shape()[0]
            positions = handle.get_slice("topk_ids").get_shape()[0]
        shards.append({"file": path.name, "sequences": count, "positions": positions})
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / MANIFEST, json.dumps({"shards": shards}, indent=1))
    return True


def is_complete(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


class TeacherStore:
    """A store's (or several stores') sequences and target outputs, read shard by shard, with a
    `TeacherCache`'s reading interface: `sequences` (lazy) and `select(indices)`."""

    def __init__(self, shards: Sequence[Path], counts: Sequence[int], positions: Sequence[int]) -> None:
        self.shards = list(shards)
        # [S + 1] global index of each shard's first sequence; the loss positions they hold in all
        self.starts = list(itertools.accumulate(counts, initial=0))
        self.num_positions = int(sum(positions))
        self.sequences = StoredSequences(self)
        self._open: tuple[int, Any, dict[str, list[int]]] | None = None

    @classmethod
    def open(cls, folder: Path) -> TeacherStore:
        """The complete store in `folder`; FileNotFoundError where it has no manifest."""
        path = folder / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not a complete teacher store: it has no {MANIFEST}")
        shards = json.loads(path.read_text())["shards"]
        return cls(
            [folder / s["file"] for s in shards], [s["sequences"] for s in shards], [s["positions"] for s in shards]
        )

    @classmethod
    def concat(cls, stores: Sequence[TeacherStore]) -> TeacherStore:
        """One store holding `stores`' sequences one store after another (a mix of domain stores)."""
        counts = [b - a for s in stores for a, b in zip(s.starts, s.starts[1:])]
        return cls([p for s in stores for p in s.shards], counts, [s.num_positions for s in stores])

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def resident_shards(self) -> int:
        """How many shards this reader holds open (mapped): 0 or 1, whatever the store's size."""
        return 0 if self._open is None else 1

    def select(self, indices: Sequence[int]) -> TeacherCache:
        """A `TeacherCache` of sequences `indices`, in that order, read one shard at a time."""
        read = {i: self._read(i) for i in sorted(set(indices))}  # sorted: each shard opened once
        return concat_caches([read[i] for i in indices]) if indices else sequences_only([])

    def sequence(self, index: int) -> TrainSequence:
        """Sequence `index`'s tokens only (no target outputs read)."""
        local, handle, index_of = self._locate(index)
        a, b = index_of["token_offsets"][local], index_of["token_offsets"][local + 1]
        tokens = handle.get_slice("tokens")[a:b].tolist()
        return TrainSequence(tokens, index_of["response_start"][local])

    def _locate(self, index: int) -> tuple[int, Any, dict[str, list[int]]]:
        """Sequence `index`'s position in its shard, and that shard open (replacing the one held)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} of a store of {len(self)}")
        shard = bisect.bisect_right(self.starts, index) - 1
        if self._open is None or self._open[0] != shard:
            self._open = None  # unmapped before the next one is mapped
            handle = safe_open(self.shards[shard], framework="pt")
            index_of = {k: handle.get_tensor(k).tolist() for k in ("token_offsets", "response_start", "offsets")}
            self._open = (shard, handle, index_of)
        return index - self.starts[shard], self._open[1], self._open[2]

    def _read(self, index: int) -> TeacherCache:
        """A one-sequence `TeacherCache` of sequence `index`."""
        local, handle, index_of = self._locate(index)
        a, b = index_of["offsets"][local], index_of["offsets"][local + 1]
        features = None
        if "features" in handle.keys():
            t0, t1 = index_of["token_offsets"][local], index_of["token_offsets"][local + 1]
            features = handle.get_slice("features")[t0:t1]
        ids, logits = handle.get_slice("topk_ids")[a:b], handle.get_slice("topk_logits")[a:b]
        return single_cache(self.sequence(index), ids, logits, features)


class StoredSequences(Sequence[TrainSequence]):
    """A store's sequences as a read-only list whose items are read from disk when asked for."""

    def __init__(self, store: TeacherStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    @overload
    def __getitem__(self, index: int) -> TrainSequence: ...

    @overload
    def __getitem__(self, index: slice) -> list[TrainSequence]: ...

    def __getitem__(self, index: int | slice) -> TrainSequence | list[TrainSequence]:
        if isinstance(index, slice):
            return [self.store.sequence(i) for i in range(*index.indices(len(self)))]
        return self.store.sequence(index if index >= 0 else index + len(self))


def read_store(folder: Path) -> TeacherCache:
    """A whole complete store in memory (its shards concatenated): for inspection and tests, not training."""
    store = TeacherStore.open(folder)
    return store.select(range(len(store)))
