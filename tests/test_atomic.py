"""atomic_folder: a folder is published whole or not at all, and a failure leaves the old one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specdecode.core import atomic
from specdecode.core.atomic import atomic_folder


def fill(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_new_folder_is_published_and_nothing_else_is_left(tmp_path: Path) -> None:
    final = tmp_path / "out" / "model"
    with atomic_folder(final) as staging:
        assert staging != final and staging.parent == final.parent and not any(staging.iterdir())
        assert not final.exists(), "nothing is visible before the folder is complete"
        fill(staging, **{"config.json": "{}", "weights.bin": "w"})
    assert contents(final) == {"config.json": "{}", "weights.bin": "w"}
    assert os.listdir(final.parent) == ["model"]


def test_existing_folder_is_replaced_whole(tmp_path: Path) -> None:
    final = tmp_path / "model"
    fill(final, **{"config.json": "old", "stale.bin": "only in the old one"})
    with atomic_folder(final) as staging:
        fill(staging, **{"config.json": "new"})
        assert contents(final) == {"config.json": "old", "stale.bin": "only in the old one"}
    assert contents(final) == {"config.json": "new"}
    assert os.listdir(tmp_path) == ["model"]


@pytest.mark.parametrize("existing", [True, False])
def test_failure_inside_leaves_nothing_half_written(tmp_path: Path, existing: bool) -> None:
    final = tmp_path / "model"
    if existing:
        fill(final, **{"config.json": "old"})
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_folder(final) as staging:
            fill(staging, **{"config.json": "half"})
            raise RuntimeError("killed mid-write")
    assert os.listdir(tmp_path) == (["model"] if existing else [])
    if existing:
        assert contents(final) == {"config.json": "old"}


def test_failed_rename_puts_the_old_folder_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "model"
    fill(final, **{"config.json": "old"})
    rename = os.rename

    def staging_cannot_move(src: Path, dst: Path) -> None:
        if Path(src).name.startswith(".tmp.") and not Path(src).name.endswith(".old"):
            raise OSError("device gone")
        rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", staging_cannot_move)
    with pytest.raises(OSError, match="device gone"):
        with atomic_folder(final) as staging:
            fill(staging, **{"config.json": "new"})
    assert contents(final) == {"config.json": "old"}
    assert os.listdir(tmp_path) == ["model"]


def test_leftovers_of_a_crashed_writer_are_cleared(tmp_path: Path) -> None:
    final = tmp_path / "model"
    fill(tmp_path / ".tmp.model", **{"half.bin": "x"})
    fill(tmp_path / ".tmp.model.old", **{"config.json": "older"})
    with atomic_folder(final) as staging:
        assert not any(staging.iterdir())
        fill(staging, **{"config.json": "new"})
    assert os.listdir(tmp_path) == ["model"] and contents(final) == {"config.json": "new"}


def test_keep_lets_an_existing_good_folder_win(tmp_path: Path) -> None:
    final = tmp_path / "entry"
    staging = tmp_path / ".tmp.writer-2.entry"
    with atomic_folder(final, staging=staging, keep=lambda f: (f / "COMPLETE").is_file()) as folder:
        assert folder == staging
        fill(folder, **{"data": "ours", "COMPLETE": ""})
        fill(final, **{"data": "theirs", "COMPLETE": ""})  # another writer publishes first
    assert contents(final) == {"COMPLETE": "", "data": "theirs"}
    assert os.listdir(tmp_path) == ["entry"]


def test_keep_false_replaces_an_unmarked_folder(tmp_path: Path) -> None:
    final = tmp_path / "entry"
    fill(final, **{"data": "half"})
    with atomic_folder(final, keep=lambda f: (f / "COMPLETE").is_file()) as folder:
        fill(folder, **{"data": "ours", "COMPLETE": ""})
    assert contents(final) == {"COMPLETE": "", "data": "ours"}


def test_staging_elsewhere_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"staging=.*must be beside final="):
        with atomic_folder(tmp_path / "a" / "model", staging=tmp_path / "b" / ".tmp.model"):
            pass
