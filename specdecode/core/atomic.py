"""Writing files (`write_atomic`) and folders (`atomic_folder`) beside the target and renaming them
into place (atomic on POSIX), so that a reader sees the old version or the new one, never a mix."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def _umask() -> int:
    """The process umask (reading it means setting it; it is put straight back)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def publish_files(folder: Path) -> None:
    """Give every file under `folder` the mode a plain `open` would (0666 minus the umask): some
    writers, safetensors among them, create 0600 files that no other user can read."""
    mode = 0o666 & ~_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


def write_atomic(path: Path, data: str | bytes | Callable[[BinaryIO], None]) -> None:
    """Write `data` (text, bytes, or a function that writes into the open binary file) to `path` via a
    temp file and a rename; the file gets a plain `open`'s mode, not mkstemp's private 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w" if isinstance(data, str) else "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            if callable(data):
                data(f)  # type: ignore[arg-type]  # fdopen's file is typed IO[Any]; opened "wb" here, a binary file
            else:
                f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@contextmanager
def atomic_folder(
    final: Path, *, staging: Path | None = None, keep: Callable[[Path], bool] | None = None
) -> Iterator[Path]:
    """Yield an empty staging folder to fill; on a clean exit it replaces `final` (moved aside first, so
    no reader sees it half-deleted), on an exception it is removed. `staging` (default `.tmp.<name>`)
    must be beside `final`; with `keep`, an existing `final` for which `keep(final)` holds wins."""
    staging = staging if staging is not None else final.with_name(f".tmp.{final.name}")
    if staging.parent != final.parent:
        raise ValueError(
            f"staging={staging} must be beside final={final}: a rename across folders may cross filesystems"
        )
    aside = staging.with_name(f"{staging.name}.old")
    final.parent.mkdir(parents=True, exist_ok=True)
    for leftover in (staging, aside):
        _remove(leftover)
    staging.mkdir()
    try:
        yield staging
        publish_files(staging)
        _swap_in(staging, final, aside, keep)
    finally:
        _remove(staging)
        _remove(aside)


def _swap_in(staging: Path, final: Path, aside: Path, keep: Callable[[Path], bool] | None) -> None:
    """Rename `staging` to `final`, moving an existing `final` to `aside` first (unless `keep`s it)."""
    for _ in range(3):
        try:
            os.rename(staging, final)
            return
        except OSError:
            # Renaming onto a non-empty folder fails on POSIX: there is a `final` already.
            if not final.exists():
                if aside.exists():
                    os.rename(aside, final)
                raise
            if keep is not None and keep(final):
                return
            _remove(aside)  # moved aside by an earlier try, then replaced by another writer's
            try:
                os.rename(final, aside)
            except FileNotFoundError:
                continue  # another writer moved it meanwhile: try again
    raise OSError(f"could not publish {final}: it kept reappearing while {staging} was renamed into place")


def _remove(path: Path) -> None:
    """Delete `path`, a folder or a file, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
