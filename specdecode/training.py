"""The training loop shared by distillation and fine-tuning, with atomic, exactly-resumable checkpoints.

One optimizer step consumes a global batch of `train.batch_size` sequences, split evenly over the
processes and then over `train.grad_accum` micro-batches. The loss is a *sum* over tokens divided
by the step's global token count (all micro-batches of all processes, all-reduced), as torchtune's
`scale_grads`: a short micro-batch does not weigh more than a long one, and 1 process with
accumulation A matches A processes without it.

Data order is a pure function of (seed, step): epoch e visits the sequences in a permutation seeded
by (seed, e), so a resumed run picks up at exactly the batch it would have seen, with no dataloader
state to save. Optimizer and RNG states go through `accelerator.save_state`.

Each checkpoint records the job's resolved config (`config.json`). A resume must match it except in
`RESUMABLE_KEYS`, and a fresh run refuses a folder that already holds checkpoints
(`check_checkpoints`): either would otherwise continue, rotate or restore another run's state.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import resource
import shutil
import signal
import time
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specdecode.config import TrainConfig
from specdecode.models import DraftVocabHead

Batch = dict[str, torch.Tensor]
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


class DrafterLogits(nn.Module):
    """The drafter's logits over its own vocabulary, `[B, T, K]` (K draft ids, or all V).

    A module of its own so DDP / FSDP wrap the whole computation (a call that bypassed the wrapper
    would skip gradient synchronisation), and so a truncated head never builds its `[B, T, V]`
    scatter: the losses only need the K scored ids.
    """

    def __init__(self, drafter: PreTrainedModel) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.drafter.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        head = self.drafter.get_output_embeddings()
        if isinstance(head, DraftVocabHead):
            return F.linear(hidden, head.weight, head.bias)
        return head(hidden)


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


class MetricsLogger:
    """stdout + `metrics.jsonl` on the main process, and wandb when `use_wandb` (imported lazily)."""

    def __init__(self, accelerator: Accelerator, path: Path, wandb_run: Any = None) -> None:
        self.main = accelerator.is_main_process
        self.path = path
        self.wandb_run = wandb_run

    def log(self, record: dict[str, Any], bar: tqdm | None = None) -> None:
        if not self.main:
            return
        line = json.dumps(record)
        (bar.write if bar is not None else print)(line)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(line + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=record.get("step"))


def global_batch_indices(step: int, batch_size: int, num_sequences: int, seed: int) -> list[int]:
    """Sequence indices of optimizer step `step`: epochs of seeded permutations, read in order."""
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_sequences)
        order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        indices.append(int(order[offset]))
    return indices


def trainable_state(drafter: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in drafter.named_parameters() if p.requires_grad}


def load_trainable_state(drafter: nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(drafter.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


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
    """`save_state` into a temp dir, add the loop state, best weights and job config, mark
    complete, rename.

    Every process calls this (accelerate writes per-process RNG states); the temp name is
    deterministic so all of them write into the same folder.
    """
    final = directory / f"step_{state.step:06d}"
    tmp = directory / f".tmp.step_{state.step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=False)
    if accelerator.is_main_process:
        torch.save(best, tmp / BEST_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state)))
        if config is not None:
            (tmp / CONFIG_FILE).write_text(json.dumps(config))
        (tmp / COMPLETE).write_text("ok")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
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


def peak_memory_mb(device: torch.device) -> float:
    """Peak resident memory of this process (CPU) or peak allocated CUDA memory, in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_loop(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    num_sequences: int,
    make_batches: Callable[[list[int], int, bool], list[Batch]],
    loss_sum: Callable[[nn.Module, Batch], torch.Tensor],
    evaluate: Callable[[], dict[str, float]],
    checkpoints: Path,
    logger: MetricsLogger,
    state: LoopState,
    best: dict[str, torch.Tensor],
    config: dict[str, Any] | None = None,
) -> tuple[LoopState, dict[str, torch.Tensor]]:
    """Train until `max_steps` or `max_minutes` (of training time, summed over resumptions).

    `make_batches(indices, step, on_policy)` turns this process's share of the global batch into
    `grad_accum` micro-batches, each with a bool `positions` [B, T] of counted tokens;
    `loss_sum(model, batch)` returns the batch's summed loss; `evaluate()` held-out acceptance
    figures, identical on every process, whose `score` selects the best weights; `config` (the
    job's, as a dict) is recorded in each checkpoint. Stops early after `early_stop_evals`
    evaluations without a new best. Returns the final state and the best weights.
    """
    drafter = accelerator.unwrap_model(model).drafter
    world, accum = accelerator.num_processes, cfg.grad_accum
    per_process = cfg.batch_size // world

    def eval_and_select() -> None:
        figures = evaluate()
        acceptance = figures["score"]
        epochs = state.step * cfg.batch_size / num_sequences
        state.history.append({"step": state.step, "epochs": round(epochs, 3), "acceptance": acceptance,
                              **{k: v for k, v in figures.items() if k != "score"}})
        if state.acceptance_before is None:
            state.acceptance_before = acceptance
        if acceptance > state.best_acceptance:
            state.best_acceptance, state.best_step = acceptance, state.step
            best.clear()
            best.update(trainable_state(drafter))
        logger.log({"step": state.step, "epochs": round(epochs, 3), "heldout_acceptance": acceptance,
                    **{f"heldout_{k}": v for k, v in figures.items() if k != "score"}, "best": state.best_acceptance}, bar)

    def stale() -> bool:
        """No new best in the last `early_stop_evals` evaluations (identical on every process)."""
        patience = cfg.early_stop_evals
        return patience is not None and len(state.history) > patience and all(
            h["step"] > state.best_step for h in state.history[-patience:])

    bar = tqdm(total=cfg.max_steps, initial=state.step, desc="train", disable=not accelerator.is_main_process)
    if state.acceptance_before is None:
        eval_and_select()
    model.train()
    while state.step < cfg.max_steps:
        out_of_time = (cfg.max_minutes is not None and state.train_seconds >= 60 * cfg.max_minutes) or stale()
        if accelerator.reduce(torch.tensor(float(out_of_time), device=accelerator.device), "sum").item() > 0:
            break
        start = time.perf_counter()
        # 1. this process's share of the global batch; on-policy with probability lambda (GKD)
        indices = global_batch_indices(state.step, cfg.batch_size, num_sequences, cfg.seed)
        mine = indices[accelerator.process_index * per_process : (accelerator.process_index + 1) * per_process]
        on_policy = random.Random(f"{cfg.seed}-{state.step}").random() < cfg.lambda_on_policy
        micro_batches = make_batches(mine, state.step, on_policy)
        # 2. global token count of the step: the divisor of every micro-batch's summed loss
        local = sum(b["positions"].sum() for b in micro_batches).to(accelerator.device)
        count = accelerator.reduce(local.clone(), "sum").clamp_min(1)
        # accelerate divides by `accum` and DDP averages over `world`: undo both
        scale = world * accum / count
        total = torch.zeros((), device=accelerator.device)
        # 3. forward / backward per micro-batch, one optimizer step
        for batch in micro_batches:
            with accelerator.accumulate(model):
                loss = loss_sum(model, {k: v.to(accelerator.device) for k, v in batch.items()})
                accelerator.backward(loss * scale)
                total += loss.detach()
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    for group in optimizer.param_groups:
                        group["lr"] = cfg.lr * min(1.0, (state.step + 1) / max(1, cfg.warmup_steps))
                    optimizer.step()
                    optimizer.zero_grad()
        mean_loss = (accelerator.reduce(total, "sum") / count).item()
        state.step += 1
        state.train_tokens += int(count.item())
        state.train_seconds += time.perf_counter() - start
        state.last_loss = mean_loss
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.4f}")
        # 4. log, evaluate, checkpoint
        if state.step % cfg.log_every == 0:
            logger.log({"step": state.step, "loss": mean_loss, "on_policy": on_policy,
                        "tokens_per_s": state.train_tokens / state.train_seconds}, bar)
        if state.step % cfg.eval_every == 0:
            eval_and_select()
        if state.step % cfg.checkpoint_every == 0:
            save_checkpoint(accelerator, checkpoints, state, best, cfg.keep_checkpoints, config)
        if state.step == cfg.debug_kill_after_step:
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()
    if not state.history or state.history[-1]["step"] != state.step:
        eval_and_select()
    if latest_checkpoint(checkpoints) is None or latest_checkpoint(checkpoints).name != f"step_{state.step:06d}":
        save_checkpoint(accelerator, checkpoints, state, best, cfg.keep_checkpoints, config)
    return state, best
