"""The training loop shared by distillation and fine-tuning. A step's loss is summed over tokens
and divided by the step's global token count (as torchtune's `scale_grads`), so 1 process with
accumulation A matches A processes without it; data order is a pure function of (seed, step).
"""

from __future__ import annotations

import json
import math
import random
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specdecode.core.devices import autocast_context
from specdecode.models.draft_vocab import DraftVocabHead
from specdecode.training.checkpoints import LoopState, checkpoint_path, is_complete, save_checkpoint
from specdecode.training.config import TrainConfig

Batch = dict[str, torch.Tensor]


class DrafterLogits(nn.Module):
    """The drafter's logits over its own K vocabulary ids: a module of its own so DDP wraps the
    whole computation, and so a truncated head never builds its `[B, T, V]` scatter."""

    def __init__(self, drafter: PreTrainedModel, autocast: torch.dtype | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        # mixed precision: the forward under autocast at this dtype, the logits returned in fp32
        self.autocast = autocast

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`[B, T, K]` logits, or `[P, K]` at the loss `positions` `[B, T]` bool only (the head at
        every position was half of a CPU training step)."""
        with autocast_context(input_ids.device, self.autocast):
            hidden = self.drafter.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            if positions is not None:
                hidden = hidden[positions]
            head = self.drafter.get_output_embeddings()
            logits = F.linear(hidden, head.weight, head.bias) if isinstance(head, DraftVocabHead) else head(hidden)
        return logits if self.autocast is None else logits.float()


class MetricsLogger:
    """stdout and `metrics.jsonl` on the main process, and the accelerator's trackers (wandb)."""

    def __init__(self, accelerator: Accelerator, path: Path) -> None:
        self.accelerator = accelerator
        self.path = path

    def log(self, record: dict[str, Any], bar: tqdm | None = None) -> None:
        if not self.accelerator.is_main_process:
            return
        line = json.dumps(record)
        (bar.write if bar is not None else print)(line)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(line + "\n")
        self.accelerator.log(record, step=record.get("step"))


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


def peak_memory_mb(device: torch.device) -> float:
    """Peak resident memory of this process (CPU) or peak allocated CUDA memory, in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class BudgetSchedule:
    """The learning-rate multiplier of a step, a `LambdaLR` lambda: linear warm-up over
    `warmup_steps`, times `decay` of the budget's `progress` p in [0, 1] (`constant` 1, `linear`
    1 - p, `cosine` (1 + cos πp) / 2). The loop sets `progress` before each step, so a time-limited
    run decays over its minutes; an object, so that `LambdaLR.state_dict` saves it for a resume.
    `decay` is one of `LR_DECAYS` (`TrainConfig` checks it).
    """

    def __init__(self, warmup_steps: int, decay: str) -> None:
        self.warmup_steps = warmup_steps
        self.decay = decay
        self.progress = 0.0

    def __call__(self, step: int) -> float:
        warm = step / self.warmup_steps if step < self.warmup_steps else 1.0
        p = min(max(self.progress, 0.0), 1.0)
        if self.decay == "linear":
            return warm * (1.0 - p)
        if self.decay == "cosine":
            return warm * 0.5 * (1.0 + math.cos(math.pi * p))
        return warm


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    """`cfg.lr` warmed up over `cfg.warmup_steps` and decayed over the budget (`BudgetSchedule`)."""
    return LambdaLR(optimizer, BudgetSchedule(cfg.warmup_steps, cfg.lr_decay))


def budget_progress(steps: int, seconds: float, cfg: TrainConfig) -> float:
    """How much of the training budget `steps` optimizer steps in `seconds` of training have used."""
    by_steps = steps / cfg.max_steps if cfg.max_steps else 1.0
    by_time = seconds / (60 * cfg.max_minutes) if cfg.max_minutes else 0.0
    return min(1.0, max(by_steps, by_time))


def _set_progress(scheduler: LRScheduler, progress: float) -> None:
    for schedule in getattr(scheduler, "lr_lambdas", ()):
        if isinstance(schedule, BudgetSchedule):
            schedule.progress = progress


def train_loop(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
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
    """Train until `max_steps`, `max_minutes` (over resumptions) or `early_stop_evals` evaluations
    without a new best; return the final state and the best weights. `make_batches(indices, step,
    on_policy)`: this process's micro-batches, each with bool `positions` [B, T]; `loss_sum(model,
    batch)`: its summed loss; `evaluate()`: held-out figures, `score` selecting."""
    drafter = accelerator.unwrap_model(model).drafter
    per_process = cfg.batch_size // accelerator.num_processes
    bar = tqdm(
        total=None if cfg.max_minutes else cfg.max_steps,
        initial=state.step,
        desc="train",
        disable=not accelerator.is_main_process,
    )
    select = lambda: _eval_and_select(evaluate, state, best, drafter, cfg, num_sequences, logger, bar)  # noqa: E731
    if state.acceptance_before is None:
        select()
    model.train()
    while state.step < cfg.max_steps:
        out_of_time = (cfg.max_minutes is not None and state.train_seconds >= 60 * cfg.max_minutes) or _stale(
            state, cfg
        )
        if accelerator.reduce(torch.tensor(float(out_of_time), device=accelerator.device), "sum").item() > 0:
            break
        start = time.perf_counter()
        # 1. this process's share of the global batch; on-policy with probability lambda (GKD)
        indices = global_batch_indices(state.step, cfg.batch_size, num_sequences, cfg.seed)
        mine = indices[accelerator.process_index * per_process : (accelerator.process_index + 1) * per_process]
        on_policy = random.Random(f"{cfg.seed}-{state.step}").random() < cfg.lambda_on_policy
        # 2.-3. forward / backward per micro-batch, one optimizer step
        lr = float(scheduler.get_last_lr()[0])  # what this step uses
        # the next step's lr, set as this one ends, follows the budget used by then (mean step time)
        _set_progress(
            scheduler, budget_progress(state.step + 1, state.train_seconds * (1 + 1 / max(state.step, 1)), cfg)
        )
        mean_loss, count = _step(
            accelerator, model, optimizer, scheduler, cfg, make_batches(mine, state.step, on_policy), loss_sum
        )
        _check_finite(mean_loss, state.step + 1, lr, cfg)
        state.step += 1
        state.train_tokens += count
        state.train_seconds += time.perf_counter() - start
        state.last_loss = mean_loss
        # 4. log, evaluate, checkpoint
        _log_step(logger, bar, state, cfg, lr, on_policy)
        if state.step % cfg.eval_every == 0:
            select()
        if state.step % cfg.checkpoint_every == 0:
            save_checkpoint(accelerator, checkpoints, state, best, config, scheduler)
    bar.close()
    if not state.history or state.history[-1]["step"] != state.step:
        select()
    if not is_complete(checkpoint_path(checkpoints, state.step)):  # saved in the loop, or resumed from it
        save_checkpoint(accelerator, checkpoints, state, best, config, scheduler)
    return state, best


def _log_step(logger: MetricsLogger, bar: tqdm, state: LoopState, cfg: TrainConfig, lr: float, on_policy: bool) -> None:
    """The progress bar after each step; the metrics every `log_every` steps."""
    bar.update(1)
    minutes = {"minutes": f"{state.train_seconds / 60:.1f}/{cfg.max_minutes:g}"} if cfg.max_minutes else {}
    bar.set_postfix(loss=f"{state.last_loss:.4f}", **minutes)
    if state.step % cfg.log_every == 0:
        rate = state.train_tokens / state.train_seconds
        record = {"step": state.step, "loss": state.last_loss, "lr": lr, "on_policy": on_policy, "tokens_per_s": rate}
        logger.log(record, bar)


def _check_finite(loss: float, step: int, lr: float, cfg: TrainConfig) -> None:
    """A FloatingPointError on a non-finite loss (all-reduced: every process stops) before its
    gradients reach the weights, naming the step, its lr and the settings to look at."""
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"training loss is {loss} at step {step} (lr {lr:g}): stopped without saving a drafter; lower "
            f"train.lr={cfg.lr:g} or train.max_grad_norm={cfg.max_grad_norm}, "
            "or check the data and the distillation temperature"
        )


def _step(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    cfg: TrainConfig,
    micro_batches: list[Batch],
    loss_sum: Callable[[nn.Module, Batch], torch.Tensor],
) -> tuple[float, int]:
    """One optimizer step (and one scheduler step) over `micro_batches`; returns the step's mean
    loss per counted token and the number of tokens counted on all processes."""
    # the global token count of the step: the divisor of every micro-batch's summed loss
    local = torch.stack([b["positions"].sum() for b in micro_batches]).sum().to(accelerator.device)
    count = accelerator.reduce(local.clone(), "sum").clamp_min(1)
    # accelerate divides by `grad_accum` and DDP averages over the processes: undo both
    scale = accelerator.num_processes * cfg.grad_accum / count
    total = torch.zeros((), device=accelerator.device)
    for batch in micro_batches:
        with accelerator.accumulate(model):
            loss = loss_sum(model, {k: v.to(accelerator.device) for k, v in batch.items()})
            accelerator.backward(loss * scale)
            total += loss.detach()
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return float((accelerator.reduce(total, "sum") / count).item()), int(count.item())


def _eval_and_select(
    evaluate: Callable[[], dict[str, float]],
    state: LoopState,
    best: dict[str, torch.Tensor],
    drafter: nn.Module,
    cfg: TrainConfig,
    num_sequences: int,
    logger: MetricsLogger,
    bar: Any,
) -> None:
    """Evaluate on the held-out set; keep the drafter's trainable weights in `best` on a new best score."""
    figures = evaluate()
    acceptance = figures["score"]
    epochs = state.step * cfg.batch_size / num_sequences
    state.history.append(
        {
            "step": state.step,
            "epochs": round(epochs, 3),
            "acceptance": acceptance,
            **{k: v for k, v in figures.items() if k != "score"},
        }
    )
    if state.acceptance_before is None:
        state.acceptance_before = acceptance
    if acceptance > state.best_acceptance:
        state.best_acceptance, state.best_step = acceptance, state.step
        best.clear()
        best.update(trainable_state(drafter))
    logger.log(
        {
            "step": state.step,
            "epochs": round(epochs, 3),
            "heldout_acceptance": acceptance,
            **{k if k.startswith("train_") else f"heldout_{k}": v for k, v in figures.items() if k != "score"},
            "best": state.best_acceptance,
        },
        bar,
    )


def _stale(state: LoopState, cfg: TrainConfig) -> bool:
    """No new best in the last `early_stop_evals` evaluations (identical on every process)."""
    patience = cfg.early_stop_evals
    return (
        patience is not None
        and len(state.history) > patience
        and all(h["step"] > state.best_step for h in state.history[-patience:])
    )
