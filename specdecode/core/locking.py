"""One writer per output folder: `<folder>/.lock` holds the writer's host and PID, created with
O_CREAT | O_EXCL; a lock whose PID is dead is stale and taken over under an flock on the folder."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

LOCK_FILE = ".lock"
# How long a lock file may exist without its owner line before it counts as abandoned.
_UNWRITTEN_GRACE_S = 10.0

F = TypeVar("F", bound=Callable[..., Any])


class OutputInUseError(RuntimeError):
    """Another live process holds the folder's lock."""


def check_writable(folder: Path, name: str = "output_dir") -> None:
    """Create `folder` if needed and prove a file can be written in it; else a PermissionError naming it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise PermissionError(
            f"{name}={str(folder)!r} is not writable ({error.strerror or error}); pick another {name}"
        ) from None


def launched_rank() -> int:
    """This process's rank under torchrun / `accelerate launch` (0 when run plainly), from the environment."""
    for variable in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if variable in os.environ:
            return int(os.environ[variable])
    return 0


def _owner(text: str) -> tuple[str, int] | None:
    """(host, pid) from a lock file's text, or None when it is not one (an interrupted write)."""
    host, _, pid = text.strip().rpartition(" ")
    return (host, int(pid)) if pid.isdigit() else None


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _create(lock: Path) -> bool:
    """Create the lock file holding "host pid"; False when it already exists."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{socket.gethostname()} {os.getpid()}\n")
    return True


def check_not_in_use(folder: Path, what: str) -> None:
    """Before deleting or replacing `folder`: OutputInUseError while a live process holds its lock."""
    lock = folder / LOCK_FILE
    text = _read(lock)
    if text is not None and (holder := _live_holder(lock, text)):
        raise _in_use(f"{what} {str(folder)!r}", holder, lock)


def _in_use(named: str, holder: str, lock: Path) -> OutputInUseError:
    return OutputInUseError(
        f"{named} is in use by {holder} (lock file {lock}), perhaps left running by a killed earlier run; wait "
        "for it, end it or pick another folder (if no such process runs, delete the lock file)"
    )


def _read(lock: Path) -> str | None:
    try:
        return lock.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _live_holder(lock: Path, text: str) -> str | None:
    """Who holds `lock` of `text` ("PID n on host"), or None where it is stale (its process is gone, or
    it died between creating the file and writing it). A lock from another host counts as live."""
    owner = _owner(text)
    if owner is None:
        return None if time.time() - _mtime(lock) >= _UNWRITTEN_GRACE_S else "a process locking it right now"
    return f"PID {owner[1]} on {owner[0]}" if owner[0] != socket.gethostname() or pid_alive(owner[1]) else None


def acquire(folder: Path) -> Path:
    """Take `folder`'s lock (creating the folder); return the lock file."""
    check_writable(folder)
    lock = folder / LOCK_FILE
    if _create(lock):
        return lock
    directory = os.open(folder, os.O_RDONLY)
    try:
        # Under the flock nobody else removes the file, so what is read is what gets removed.
        fcntl.flock(directory, fcntl.LOCK_EX)
        text = _read(lock)  # None: released meanwhile
        if text is not None:
            if holder := _live_holder(lock, text):
                raise _in_use(f"output_dir={str(folder)!r}", holder, lock)
            warnings.warn(
                f"taking over the stale lock {lock} ({text.strip() or 'empty'}): its process is gone", stacklevel=2
            )
            lock.unlink(missing_ok=True)
        if not _create(lock):
            raise OutputInUseError(
                f"output_dir={str(folder)!r} was locked by another process just now (lock file {lock})"
            )
        return lock
    finally:
        os.close(directory)  # drops the flock


def release(lock: Path) -> None:
    """Remove the lock file if it is still this process's."""
    if _owner(_read(lock) or "") == (socket.gethostname(), os.getpid()):
        lock.unlink(missing_ok=True)


@contextlib.contextmanager
def output_lock(folder: Path) -> Iterator[Path]:
    """Hold `folder`'s lock for the `with` block; released on exit, exceptions included."""
    lock = acquire(folder)
    try:
        yield lock
    finally:
        release(lock)


def locks_output_dir(run: F) -> F:
    """Decorate `run(cfg, ...)` so the launcher's main process holds `cfg.output_dir`'s lock while
    it runs (the other processes of a multi-process launch share the main one's)."""

    @functools.wraps(run)
    def locked(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        if launched_rank() != 0:
            return run(cfg, *args, **kwargs)
        with output_lock(Path(cfg.output_dir)):
            return run(cfg, *args, **kwargs)

    return locked  # type: ignore[return-value]  # same signature as run, which ParamSpec cannot say here
