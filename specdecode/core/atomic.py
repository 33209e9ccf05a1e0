"""Writing files so that a crash never leaves one half-written."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
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
                data(f)
            else:
                f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
