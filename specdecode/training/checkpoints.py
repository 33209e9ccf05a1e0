"""Training checkpoints: accelerate's naming and rotation, made safe, exactly resumable and
checked against the job's config.

Naming and rotation are accelerate's (`ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=train.keep_checkpoints)`, see `project_configuration`): a plain `save_state()` writes
`<output_dir>/checkpoints/checkpoint_<iteration>`, and first deletes the oldest folders beyond the
limit. We set the iteration to the step, so folders are `checkpoint_<step>`. On top of that:

- a checkpoint counts only once it holds the `COMPLETE` marker, written last, after the loop
  state, best weights and the job's resolved config (`config.json`), and after every process has
  written its RNG state: a kill mid-write leaves a folder without it, which is never loaded;
- such debris is removed before each save, so accelerate's rotation never counts it in place of
  a real checkpoint (it deletes by number, whatever the folder holds) nor finds its name taken;
  an exception during a save removes the partial folder before it propagates;
- rotation deletes before it writes, so `keep_checkpoints` is at least 2 (a kill mid-save keeps one);
- a resume that fell back past an unreadable checkpoint deletes the newer ones: they are a future
  this run no longer has, and the next save would collide with them or rotate real ones away;
- nothing is unpickled in full: checkpoints are handed between users, and a full unpickle runs any
  code the file names. The LR scheduler is kept in `scheduler.json`, not registered with accelerate
  (which loads its `custom_checkpoint_<i>.pkl` with `weights_only=False`; a checkpoint holding one
  is refused); the other files load with `weights_only=True`.

A resume must match the saved config except in `RESUMABLE_KEYS`, and a fresh run refuses a folder
that already holds checkpoints (`check_checkpoints`): either would otherwise continue, rotate or
restore another run's state. A checkpoint that cannot be read is named and skipped for the one before it.
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
# accelerate's files for objects passed to `register_for_checkpointing`, loaded with full pickle.
UNSAFE_PICKLES = "custom_checkpoint_*.pkl"
PREFIX = "checkpoint_"  # accelerate's automatic naming: checkpoint_<iteration>
# Config fields a resumed run may change: its budgets, where and how it logs and checkpoints, and
# where the target's outputs come from (`train.teacher`: the same losses either way).
# Every other field decides what is trained or how the best step is picked (data,
# target, drafter, loss, schedule, seed, eval_every, ...): resuming with another value would finish
# one run under another's name.
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
# What a checkpoint file that cannot be loaded raises (torch.load of a truncated zip: RuntimeError).
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
    """Checkpoints holding the completion marker (a killed write never has it), oldest step first.
    By step number, not name: `checkpoint_1000000` sorts before `checkpoint_999999` as text."""
    done = [p for p in directory.glob(f"{PREFIX}*") if p.name[len(PREFIX) :].isdigit() and is_complete(p)]
    return sorted(done, key=checkpoint_step)


def project_configuration(output_dir: Path, keep: int) -> ProjectConfiguration:
    """The Accelerator's project: checkpoints named and rotated by accelerate under
    `<output_dir>/checkpoints`, keeping the `keep` newest (>= 2, see `TrainConfig`)."""
    return ProjectConfiguration(project_dir=str(output_dir), automatic_checkpoint_naming=True, total_limit=keep)


def checkpoint_folder(accelerator: Accelerator) -> Path:
    """Where `save_state()` writes, `<project_dir>/checkpoints`: the one folder this module reads,
    so what it checks, resumes from and cleans is what accelerate rotates.

    Raises ValueError: the Accelerator was made without `project_configuration` (automatic naming off).
    """
    project = accelerator.project_configuration
    if not project.automatic_checkpoint_naming or project.project_dir is None:
        raise ValueError(
            "the Accelerator needs project_config=project_configuration(output_dir, keep): "
            "checkpoints are named and rotated by accelerate's automatic naming"
        )
    return Path(project.project_dir) / "checkpoints"


def remove_debris(directory: Path) -> None:
    """Delete what a killed save left in `directory`: every entry without the completion marker.
    accelerate counts every entry toward `total_limit` and deletes the lowest numbers, so debris
    would otherwise take a real checkpoint's place, or the name of the checkpoint being written."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            if not is_complete(entry):
                shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _saved_config(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's recorded config; None for one written before configs were recorded.
    Raises what reading a truncated file raises (OSError, ValueError)."""
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
    """Refuse a checkpoint holding files that accelerate would load with full pickle.

    Raises ValueError: naming the files and the checkpoint.
    """
    unsafe = sorted(p.name for p in checkpoint.glob(UNSAFE_PICKLES))
    if unsafe:
        raise ValueError(
            f"checkpoint {checkpoint} holds {', '.join(unsafe)}: accelerate loads such files with full pickle "
            f"(weights_only=False), which runs any code in them; specdecode never writes them (the LR scheduler is "
            f"in {SCHEDULER_FILE}). Refusing to resume: delete {checkpoint}, or train into another output_dir"
        )


def check_checkpoints(directory: Path, config: dict[str, Any], resume: bool) -> None:
    """Before any work: a fresh run (`resume` false) must not start where checkpoints are (their
    rotation and a later resume would mix the runs), and a resume must match their config and
    hold no file that would be unpickled (`refuse_pickles`).

    Raises ValueError: naming the folder and newest checkpoint, listing the differing keys, or naming a
    file that would be unpickled.
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
        refuse_pickles(checkpoint)
        _check_same_config(checkpoint, saved, config)
        return


def _unreadable_file(checkpoint: Path) -> Path | None:
    """The first file of `checkpoint` that does not parse (JSON), whose archive is damaged
    (torch.save writes zip archives, so a truncated one has lost its central directory) or that
    `weights_only=True` refuses (it names code to run)."""
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix in (".bin", ".pt", ".pth", ".pkl"):
                with zipfile.ZipFile(path) as archive:
                    if archive.testzip() is not None:
                        return path
                weights_only_load(path, map_location="cpu", weights_only=True)
        except (*_UNREADABLE, zipfile.BadZipFile):
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
    it complete; returns it.

    Every process calls this: accelerate writes per-process RNG states, and the barriers keep every
    process's view of the folder the same (which names exist, which are complete).

    Raises ValueError: `directory` is not where accelerate writes, or this step was saved already
    (before anything is deleted; accelerate would rotate first, then refuse).
    """
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
    is none; `scheduler` gets the state `save_checkpoint` stored.

    A checkpoint with a file that cannot be read (truncated by a full disk, say, or a pickle that
    `weights_only=True` refuses to run) is skipped with a warning naming the file, for the one
    before it. With `config`, a checkpoint recording another config (outside `RESUMABLE_KEYS`)
    raises ValueError listing the differing keys.

    Raises RuntimeError: checkpoints exist but none is readable, naming each bad file; ValueError: a
    checkpoint holds a file accelerate would unpickle in full (`refuse_pickles`).
    """
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
    """Delete the complete checkpoints newer than `loaded` (the ones resume fell back past): this
    run will write its own steps, and accelerate's rotation would keep a stale newer one over them
    (and refuse its name). Every process calls this, so the barrier matches."""
    if accelerator.is_main_process:
        for newer in complete_checkpoints(directory):
            if checkpoint_step(newer) > checkpoint_step(loaded):
                shutil.rmtree(newer, ignore_errors=True)
    accelerator.wait_for_everyone()
