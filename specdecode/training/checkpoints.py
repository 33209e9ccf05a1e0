"""Training checkpoints: atomic, exactly resumable, checked against the job's config, rotated by step.

A checkpoint is `accelerator.save_state` plus the loop state, the best weights and the job's
resolved config (`config.json`), written into a temp folder that is renamed once complete. A resume
must match the saved config except in `RESUMABLE_KEYS`, and a fresh run refuses a folder that
already holds checkpoints (`check_checkpoints`): either would otherwise continue, rotate or restore
another run's state. A checkpoint that cannot be read is named and skipped for the one before it.
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
import zipfile
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from specdecode.core.atomic import atomic_folder

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
BEST_FILE = "best_drafter.pt"
CONFIG_FILE = "config.json"
# Config fields a resumed run may change: its budgets, where and how it logs and checkpoints, and
# the test hook. Every other field decides what is trained or how the best step is picked (data,
# target, drafter, loss, schedule, seed, eval_every, ...): resuming with another value would finish
# one run under another's name.
RESUMABLE_KEYS = frozenset({
    "train.resume", "train.max_steps", "train.max_minutes", "train.log_every", "train.checkpoint_every",
    "train.keep_checkpoints", "train.debug_kill_after_step", "logger", "wandb_project", "wandb_mode",
    "output_dir", "cache_dir",
})
# What a checkpoint file that cannot be loaded raises (torch.load of a truncated zip: RuntimeError).
_UNREADABLE = (RuntimeError, EOFError, OSError, ValueError, TypeError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile)


@dataclass
class LoopState:
    """What a checkpoint holds besides the accelerate state; `history` is the eval curve."""

    step: int = 0
    train_tokens: int = 0
    train_seconds: float = 0.0
    acceptance_before: float | None = None
    best_acceptance: float = -1.0
    best_step: int = -1
    last_loss: float | None = None
    history: list[dict[str, float]] = field(default_factory=list)


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("_")[1])


def complete_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints holding the completion marker (a killed write never has it), oldest step first.
    By step number, not name: `step_1000000` sorts before `step_999999` as text."""
    done = [p for p in directory.glob("step_*") if p.name[5:].isdigit() and (p / COMPLETE).is_file()]
    return sorted(done, key=_step)


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint."""
    done = complete_checkpoints(directory)
    return done[-1] if done else None


def prune_checkpoints(directory: Path, keep: int, step: int) -> None:
    """Keep the `keep` newest complete checkpoints up to `step` (the one just written); drop the
    rest, and any newer than `step`: those are left from past an unreadable checkpoint that resume
    fell back from, a future this run no longer has."""
    done = complete_checkpoints(directory)
    kept = [p for p in done if _step(p) <= step][-keep:]
    for old in done:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: saved vs current` for every dotted key outside `RESUMABLE_KEYS` whose value differs."""
    old, new = _flatten(saved), _flatten(json.loads(json.dumps(current)))
    absent = "<absent>"
    return [
        f"{key}: {old.get(key, absent)!r} in the checkpoint, {new.get(key, absent)!r} now"
        for key in sorted(old.keys() | new.keys())
        if key not in RESUMABLE_KEYS and old.get(key, absent) != new.get(key, absent)
    ]


def _saved_config(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's recorded config; None for one written before configs were recorded.
    Raises what reading a truncated file raises (OSError, ValueError)."""
    path = checkpoint / CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _check_same_config(checkpoint: Path, saved: dict[str, Any] | None, config: dict[str, Any]) -> None:
    if saved is None:
        warnings.warn(f"checkpoint {checkpoint} records no config (an older version wrote it): resuming unchecked", stacklevel=3)
        return
    differences = config_differences(saved, config)
    if differences:
        raise ValueError(
            f"train.resume=true, but the checkpoint {checkpoint} was written with another config; differing keys:\n  "
            + "\n  ".join(differences)
            + f"\nResume with the checkpoint's values, or train into another output_dir. May differ: {', '.join(sorted(RESUMABLE_KEYS))}."
        )


def check_checkpoints(directory: Path, config: dict[str, Any], resume: bool) -> None:
    """Before any work: a fresh run (`resume` false) must not start where checkpoints are (their
    rotation and a later resume would mix the runs), and a resume must match their config.

    Raises:
        ValueError: naming the folder and newest checkpoint, or listing the differing keys.
    """
    done = complete_checkpoints(directory)
    if not done:
        return
    if not resume:
        raise ValueError(
            f"{directory} already holds checkpoints of an earlier run (newest: {done[-1].name}); pass "
            f"train.resume=true to continue it, or pick another output_dir (or delete {directory})"
        )
    for checkpoint in reversed(done):
        try:
            saved = _saved_config(checkpoint)
        except (OSError, ValueError):
            continue  # unreadable: `resume` falls back past it, with a warning naming the file
        _check_same_config(checkpoint, saved, config)
        return


def _unreadable_file(checkpoint: Path) -> Path | None:
    """The first file of `checkpoint` that does not parse (JSON) or whose archive is damaged
    (torch.save writes zip archives, so a truncated one has lost its central directory)."""
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix in (".bin", ".pt", ".pth", ".pkl"):
                with zipfile.ZipFile(path) as archive:
                    if archive.testzip() is not None:
                        return path
        except (OSError, ValueError, zipfile.BadZipFile):
            return path
    return None


def save_checkpoint(
    accelerator: Accelerator, directory: Path, state: LoopState, best: dict, keep: int, config: dict[str, Any] | None = None
) -> None:
    """`save_state` into a staging folder, add the loop state, best weights and job config, mark
    complete, publish it (`atomic_folder`), and rotate.

    Every process calls this (accelerate writes per-process RNG states); the staging name is
    deterministic so all of them write into the same folder, which the main process owns.
    """
    final = directory / f"step_{state.step:06d}"
    staging = directory / f".tmp.{final.name}"
    with atomic_folder(final, staging=staging) if accelerator.is_main_process else nullcontext(staging):
        accelerator.wait_for_everyone()  # the staging folder exists
        accelerator.save_state(str(staging), safe_serialization=False)
        if accelerator.is_main_process:
            torch.save(best, staging / BEST_FILE)
            (staging / STATE_FILE).write_text(json.dumps(asdict(state)))
            if config is not None:
                (staging / CONFIG_FILE).write_text(json.dumps(config))
            (staging / COMPLETE).write_text("ok")
        # save_state ends with no barrier: every process's RNG state must be in before the rename
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        prune_checkpoints(directory, keep, state.step)
    accelerator.wait_for_everyone()


def resume(accelerator: Accelerator, directory: Path, config: dict[str, Any] | None = None) -> tuple[LoopState, dict] | None:
    """Load the newest complete, readable checkpoint: (loop state, best weights), or None if there is none.

    A checkpoint with a file that cannot be read (truncated by a full disk, say) is skipped with a
    warning naming the file, for the one before it. With `config`, a checkpoint recording another
    config (outside `RESUMABLE_KEYS`) raises ValueError listing the differing keys.

    Raises:
        RuntimeError: checkpoints exist but none is readable, naming each bad file.
    """
    unreadable: list[str] = []

    def skip(checkpoint: Path, error: BaseException) -> None:
        bad = _unreadable_file(checkpoint) or checkpoint
        warnings.warn(f"checkpoint file {bad} is unreadable ({type(error).__name__}: {error}); "
                      "falling back to the previous checkpoint", stacklevel=3)
        unreadable.append(str(bad))

    for checkpoint in reversed(complete_checkpoints(directory)):
        try:
            saved = _saved_config(checkpoint)
        except (OSError, ValueError) as error:
            skip(checkpoint, error)
            continue
        if config is not None:
            _check_same_config(checkpoint, saved, config)
        try:
            accelerator.load_state(str(checkpoint))
            state = LoopState(**json.loads((checkpoint / STATE_FILE).read_text()))
            best = torch.load(checkpoint / BEST_FILE, weights_only=True)
        except _UNREADABLE as error:
            skip(checkpoint, error)
            continue
        return state, best
    if unreadable:
        raise RuntimeError(f"no readable checkpoint in {directory}: {', '.join(unreadable)}; delete them to start over")
    return None
