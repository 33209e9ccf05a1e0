"""Writing files and folders so that a crash never leaves one half-written.

`write_atomic` writes one file, `atomic_folder` a whole folder (a model, a checkpoint, a cache
entry): both write beside the target and rename into place, which POSIX makes atomic within a
filesystem, so a reader sees the old version or the new one, never a mix.
"""

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
    """Write `data` to `path` via a temp file in the same folder and a rename (atomic on POSIX).

    `data` is text, bytes, or a function that writes into the open binary file (e.g. `torch.save`),
    so large payloads need not be built in memory first. The file gets the mode a plain `open`
    would give it (0666 minus the umask), not mkstemp's private 0600: results are for others to read.
    """
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
    """Yield an empty staging folder to fill; on a clean exit it becomes `final`, on an exception
    it is removed and `final` is left as it was.

    `staging` defaults to `.tmp.<name>` beside `final` (one left by a crashed writer is cleared
    first); pass a unique one where several processes may publish the same `final` at once. An
    existing `final` is replaced: moved aside before the rename and deleted after it, so no reader
    sees it half-deleted. With `keep`, an existing `final` for which `keep(final)` is true wins
    instead and the new folder is discarded (another writer published a good copy first). The
    published files get the mode a plain `open` would give them (see `publish_files`).

    Raises ValueError: `staging` is not beside `final` (a rename across folders may cross filesystems);
    OSError: `final` could not be published (e.g. other writers kept replacing it).
    """
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
        # Gone already when the rename succeeded; otherwise a failed (or losing) attempt.
        _remove(staging)
        _remove(aside)


def _swap_in(staging: Path, final: Path, aside: Path, keep: Callable[[Path], bool] | None) -> None:
    """Rename `staging` to `final`, moving an existing `final` to `aside` first (unless `keep`s it);
    if the rename fails for another reason, the `final` moved aside is put back."""
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
