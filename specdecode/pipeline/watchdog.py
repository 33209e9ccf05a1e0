"""Run a command that dies with the process that started it: `python watchdog.py <parent pid> <command...>`.

As a process group's leader, it ends the group once its parent is gone or on SIGTERM, SIGINT or
SIGHUP: SIGTERM first (torchrun ends its workers then), SIGKILL after `GRACE_SECONDS`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from types import FrameType
from typing import NoReturn

# How long the command has to exit after SIGTERM before its group is killed.
GRACE_SECONDS = 15.0
# How often the parent PID is checked where the kernel cannot signal the parent's death.
POLL_SECONDS = 0.5
_PR_SET_PDEATHSIG = 1
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _Ended(Exception):
    """Raised in the main thread by an ending signal."""


def _raise_ended(signum: int, frame: FrameType | None) -> None:
    raise _Ended


def end_group(child: subprocess.Popen | None) -> NoReturn:
    """SIGTERM this process group, wait for `child` up to `GRACE_SECONDS`, then SIGKILL the group."""
    for signum in _ENDING_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    os.killpg(os.getpgrp(), signal.SIGTERM)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=GRACE_SECONDS)
    os.killpg(os.getpgrp(), signal.SIGKILL)
    raise SystemExit(137)  # not reached: SIGKILL ends this process too


def _signal_on_parent_death() -> bool:
    """Ask the kernel for SIGTERM when the parent dies; whether it agreed (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[1].isdigit():
        sys.exit("usage: python watchdog.py <parent pid> <command...>")
    parent, command = int(argv[1]), argv[2:]
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # run by hand: lead a group of our own, never the caller's
    child = None
    for signum in _ENDING_SIGNALS:
        signal.signal(signum, _raise_ended)
    try:
        told = _signal_on_parent_death()
        if os.getppid() != parent:  # the parent died before the kernel was asked to tell us
            return 1
        child = subprocess.Popen(command)
        while True:
            try:
                code = child.wait(timeout=None if told else POLL_SECONDS)
                return code if code >= 0 else 128 - code
            except subprocess.TimeoutExpired:
                if os.getppid() != parent:
                    end_group(child)
    except _Ended:
        end_group(child)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
