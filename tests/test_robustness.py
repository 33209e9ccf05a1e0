"""Cross-cutting guarantees: published files are readable, output folders have one writer, and
a folder that cannot be written is reported before any work."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specdecode.atomic import write_atomic
from specdecode.teacher import TeacherCache, TrainSequence, load_cache, save_cache


@pytest.fixture
def umask() -> Iterator[None]:
    """Let a test set the umask; the previous one comes back afterwards."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o027, 0o640)])
def test_published_files_get_the_umask_mode(tmp_path: Path, umask: None, mask: int, expected: int) -> None:
    os.umask(mask)
    write_atomic(tmp_path / "results.json", "{}")
    write_atomic(tmp_path / "weights.bin", b"\0\1")
    cache = TeacherCache([TrainSequence([1, 2, 3], 1)], torch.tensor([0, 2]), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4))
    save_cache(cache, tmp_path / "cache.pt")
    assert {p.name: _mode(p) for p in tmp_path.iterdir()} == dict.fromkeys(["results.json", "weights.bin", "cache.pt"], expected)
    assert load_cache(tmp_path / "cache.pt").sequences == cache.sequences
