"""Training checkpoints: accelerate's naming and rotation (`checkpoint_<step>` under
`<output_dir>/checkpoints`), made safe and exactly resumable. A checkpoint counts only once its
`COMPLETE` marker is written, last; nothing is unpickled in full (the LR scheduler is JSON, and a
checkpoint holding accelerate's pickles is refused); a resume must match the saved config outside
`RESUMABLE_KEYS`, and a fresh run refuses a folder that holds checkpoints (`check_checkpoints`).
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from accelerate.utils.other import load as weights_only_load
from torch.optim.lr_scheduler import LRScheduler

from specdecode.core.config import config_differences

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
BEST_FILE = "best_drafter.pt"
CONFIG_FILE = "config.json"
SCHEDULER_FILE = "scheduler.json"
# accelerate's files of `register_for_checkpointing` objects, loaded with full pickle
UNSAFE_PICKLES = "custom_checkpoint_*.pkl"
PREFIX = "checkpoint_"  # accelerate's automatic naming: checkpoint_<iteration>
# Config fields a resumed run may change (budgets, logging, checkpointing, `train.teacher`); every
# other field decides what is trained or selected, so another value would finish another run.
RESUMABLE_KEYS = frozenset(
    {
        "train.resume",
        "train.max_steps",
        "train.max_minutes",
        "train.log_every",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.teacher",
        "logger",
        "wandb_project",
        "wandb_mode",
        "output_dir",
        "cache_dir",
    }
)
# What loading a damaged checkpoint file raises (torch.load of a truncated zip: RuntimeError)
_UNREADABLE = (
    RuntimeError,
    EOFError,
    OSError,
    ValueError,
    TypeError,
    KeyError,
    pickle.UnpicklingError,
    zipfile.BadZipFile,
)


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


def checkpoint_step(checkpoint: Path) -> int:
    """The step a `checkpoint_<step>` folder was written at."""
    return int(checkpoint.name[len(PREFIX) :])


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"{PREFIX}{step}"


def is_complete(folder: Path) -> bool:
    """Whether `folder` holds the completion marker (the last thing a save writes)."""
    return (folder / COMPLETE).is_file()


def complete_checkpoints(directory: Path) -> list[Path]:
    """The checkpoints holding the completion marker, oldest step first (by number, not as text)."""
    done = [p for p in directory.glob(f"{PREFIX}*") if p.name[len(PREFIX) :].isdigit() and is_complete(p)]
    return sorted(done, key=checkpoint_step)


def project_configuration(output_dir: Path, keep: int) -> ProjectConfiguration:
    """The Accelerator's project: checkpoints named and rotated by accelerate under
    `<output_dir>/checkpoints`, the `keep` newest kept."""
    return ProjectConfiguration(project_dir=str(output_dir), automatic_checkpoint_naming=True, total_limit=keep)


def checkpoint_folder(accelerator: Accelerator) -> Path:
    """Where `save_state()` writes, `<project_dir>/checkpoints`: the one folder this module reads.
    A ValueError for an Accelerator made without `project_configuration`."""
    project = accelerator.project_configuration
    if not project.automatic_checkpoint_naming or project.project_dir is None:
        raise ValueError(
            "the Accelerator needs project_config=project_configuration(output_dir, keep): "
            "checkpoints are named and rotated by accelerate's automatic naming"
        )
    return Path(project.project_dir) / "checkpoints"


def remove_debris(directory: Path) -> None:
    """Delete every entry of `directory` without the completion marker: accelerate's rotation counts
    every entry, so debris would take a real checkpoint's place, or the next one's name."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            if not is_complete(entry):
                shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _saved_config(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's recorded config (None: it records none); OSError or ValueError if truncated."""
    path = checkpoint / CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _check_same_config(checkpoint: Path, saved: dict[str, Any] | None, config: dict[str, Any]) -> None:
    if saved is None:
        warnings.warn(
            f"checkpoint {checkpoint} records no config (an older version wrote it): resuming unchecked", stacklevel=3
        )
        return
    # the current config as the checkpoint holds it (JSON: tuples are lists)
    current = json.loads(json.dumps(config))
    differences = config_differences(saved, current, RESUMABLE_KEYS, "in the checkpoint", "now")
    if differences:
        raise ValueError(
            f"train.resume=true, but the checkpoint {checkpoint} was written with another config; differing keys:\n  "
            + "\n  ".join(differences)
            + "\nResume with the checkpoint's values, or train into another output_dir. "
            + f"May differ: {', '.join(sorted(RESUMABLE_KEYS))}."
        )


def refuse_pickles(checkpoint: Path) -> None:
    """A ValueError naming the files of `checkpoint` that accelerate would load with full pickle."""
    unsafe = sorted(p.name for p in checkpoint.glob(UNSAFE_PICKLES))
    if unsafe:
        raise ValueError(
            f"checkpoint {checkpoint} holds {', '.join(unsafe)}: accelerate loads such files with full pickle "
            f"(weights_only=False), which runs any code in them; specdecode never writes them (the LR scheduler is "
            f"in {SCHEDULER_FILE}). Refusing to resume: delete {checkpoint}, or train into another output_dir"
        )


def check_checkpoints(directory: Path, config: dict[str, Any], resume: bool) -> None:
    """Before any work: a fresh run must not start where checkpoints are (the runs would mix), and a
    resume must match their config and hold nothing to unpickle; else a ValueError naming the
    folder and newest checkpoint, the differing keys, or the file."""
    done = complete_checkpoints(directory)
    if done and not resume:
        raise ValueError(
            f"{directory} already holds checkpoints of an earlier run (newest: {done[-1].name}); pass "
            f"train.resume=true to continue it, or pick another output_dir (or delete {directory})"
        )
    for checkpoint in reversed(done):
        try:
            saved = _saved_config(checkpoint)
        except (OSError, ValueError):
            continue  # unreadable: `resume` falls back past it, with a warning naming the file
        refuse_pickles(checkpoint)
        _check_same_config(checkpoint, saved, config)
        return


def _unreadable_file(checkpoint: Path) -> Path | None:
    """The first file of `checkpoint` that does not parse (JSON), whose zip archive is damaged, or
    that `weights_only=True` refuses."""
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix in (".bin", ".pt", ".pth", ".pkl"):
                with zipfile.ZipFile(path) as archive:
                    if archive.testzip() is not None:
                        return path
                weights_only_load(path, map_location="cpu", weights_only=True)
        except _UNREADABLE:
            return path
    return None


def save_checkpoint(
    accelerator: Accelerator,
    directory: Path,
    state: LoopState,
    best: dict,
    config: dict[str, Any] | None = None,
    scheduler: LRScheduler | None = None,
) -> Path:
    """Write `checkpoint_<step>` with accelerate's `save_state()` (which first rotates the oldest
    away), add the loop state, best weights, job config and `scheduler`'s state (JSON), and mark
    it complete; returns it. Every process calls this. A ValueError, before anything is deleted,
    where `directory` is not where accelerate writes or this step was saved already."""
    if checkpoint_folder(accelerator).resolve() != directory.resolve():
        raise ValueError(
            f"checkpoints are read from {directory} but accelerate writes them to {checkpoint_folder(accelerator)}"
        )
    folder = checkpoint_path(directory, state.step)
    if accelerator.is_main_process:
        remove_debris(directory)
    accelerator.wait_for_everyone()  # no process sees debris in accelerate's count or name check
    if folder.exists():
        raise ValueError(f"{folder} exists: step {state.step} was checkpointed already")
    try:
        accelerator.project_configuration.iteration = state.step  # accelerate names the folder by it
        accelerator.save_state(safe_serialization=False)
        # save_state ends with no barrier: every process's RNG state must be in before COMPLETE
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            torch.save(best, folder / BEST_FILE)
            (folder / STATE_FILE).write_text(json.dumps(asdict(state)))
            if scheduler is not None:
                (folder / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))
            if config is not None:
                (folder / CONFIG_FILE).write_text(json.dumps(config))
            (folder / COMPLETE).write_text("ok")
        accelerator.wait_for_everyone()  # no process looks for the checkpoint before it is complete
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)  # it did not exist before: only this save's part
        raise
    return folder


def resume(
    accelerator: Accelerator,
    directory: Path,
    config: dict[str, Any] | None = None,
    scheduler: LRScheduler | None = None,
) -> tuple[LoopState, dict] | None:
    """Load the newest complete, readable checkpoint: (loop state, best weights), or None if there
    is none; `scheduler` gets its stored state. An unreadable one is skipped with a warning naming
    the file. ValueError: another config (outside `RESUMABLE_KEYS`) or a file to unpickle;
    RuntimeError: checkpoints exist but none is readable, naming each bad file."""
    unreadable: list[str] = []

    def skip(checkpoint: Path, error: BaseException) -> None:
        bad = _unreadable_file(checkpoint) or checkpoint
        reason = f"{type(error).__name__}: {error}"
        if isinstance(error, pickle.UnpicklingError):  # torch's message is a page long; its cause is one line
            cause = next((line.strip() for line in str(error).splitlines() if "WeightsUnpickler error" in line), "")
            reason = f"it names code to run, which loading with weights_only=True refused; {cause}"
        warnings.warn(
            f"checkpoint file {bad} is unreadable ({reason}); falling back to the previous checkpoint", stacklevel=3
        )
        unreadable.append(str(bad))

    for checkpoint in reversed(complete_checkpoints(directory)):
        try:
            saved = _saved_config(checkpoint)
        except (OSError, ValueError) as error:
            skip(checkpoint, error)
            continue
        refuse_pickles(checkpoint)
        if config is not None:
            _check_same_config(checkpoint, saved, config)
        try:
            # accelerate swallows a failed RNG-state load (it would resume unseeded): load it first
            weights_only_load(checkpoint / f"random_states_{accelerator.process_index}.pkl", weights_only=True)
            accelerator.load_state(str(checkpoint))
            state = LoopState(**json.loads((checkpoint / STATE_FILE).read_text()))
            best = torch.load(checkpoint / BEST_FILE, weights_only=True)
            if scheduler is not None:
                scheduler.load_state_dict(json.loads((checkpoint / SCHEDULER_FILE).read_text()))
        except _UNREADABLE as error:
            skip(checkpoint, error)
            continue
        _drop_newer(accelerator, directory, checkpoint)
        return state, best
    if unreadable:
        raise RuntimeError(f"no readable checkpoint in {directory}: {', '.join(unreadable)}; delete them to start over")
    return None


def _drop_newer(accelerator: Accelerator, directory: Path, loaded: Path) -> None:
    """Delete the checkpoints newer than `loaded` (resume fell back past them): this run writes its
    own steps, which rotation would otherwise lose to them. Every process calls this."""
    if accelerator.is_main_process:
        for newer in complete_checkpoints(directory):
            if checkpoint_step(newer) > checkpoint_step(loaded):
                shutil.rmtree(newer, ignore_errors=True)
    accelerator.wait_for_everyone()
