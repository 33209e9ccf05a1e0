"""Drafter training jobs, the library behind train/distill.py and train/finetune.py: `run_distill`
(token-level distillation, DistillSpec) and `run_finetune` (next-token loss). A job writes to
`output_dir`: `drafter/` (the step with the best held-out acceptance, not the lowest loss),
`metrics.json`, `config.yaml`, `metrics.jsonl` and `checkpoints/`."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import OmegaConf
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.core.atomic import atomic_folder, write_atomic
from specdecode.core.devices import autocast_dtype, placed_accelerator, resolve_mixed_precision
from specdecode.core.locking import locks_output_dir
from specdecode.core.tracking import check_tracker_installed, start_tracking
from specdecode.decoding.gamma import choose_gamma
from specdecode.models.card import push_to_hub, write_training_card
from specdecode.models.cpu_matmul import kernel_picks
from specdecode.models.eagle3_drafter import Eagle3Drafter
from specdecode.models.feature_drafter import FeatureDrafter
from specdecode.models.loading import build_drafter, check_drafter_tokenizer, load_target
from specdecode.training.checkpoints import (
    LoopState,
    check_checkpoints,
    checkpoint_folder,
    project_configuration,
    resume,
)
from specdecode.training.config import TrainConfig, TrainJobConfig
from specdecode.training.feature_training import FeatureDrafterLogits
from specdecode.training.job_data import data_dtype, dtype_name, job_teacher, teacher_mode
from specdecode.training.loop import (
    DrafterLogits,
    MetricsLogger,
    load_trainable_state,
    lr_scheduler,
    peak_memory_mb,
    train_loop,
)
from specdecode.training.objective import Objective, Teacher
from specdecode.training.sequences import decoding_prompts
from specdecode.training.sharding import held_fraction, shard_target


def run_distill(cfg: TrainJobConfig) -> dict[str, Any]:
    """Token-level distillation from the target; returns the metrics written to metrics.json."""
    return _run(cfg, "distill")


def run_finetune(cfg: TrainJobConfig) -> dict[str, Any]:
    """Next-token cross-entropy on the sequences (dataset or target-generated responses)."""
    return _run(cfg, "finetune")


@locks_output_dir
def _run(cfg: TrainJobConfig, job: str) -> dict[str, Any]:
    # 0. everything that can fail cheaply fails first
    check_tracker_installed(cfg)
    train = cfg.train
    output = Path(cfg.output_dir)
    accelerator, device = placed_accelerator(
        cfg.device,
        gradient_accumulation_steps=train.grad_accum,
        log_with=cfg.log_with,
        project_config=project_configuration(output, train.keep_checkpoints),
    )
    if train.batch_size % (accelerator.num_processes * train.grad_accum):
        raise ValueError(
            f"train.batch_size={train.batch_size} must be a multiple of processes x grad_accum "
            f"= {accelerator.num_processes} x {train.grad_accum}"
        )
    set_seed(train.seed)
    checkpoints = checkpoint_folder(accelerator)  # <output_dir>/checkpoints, where save_state() writes
    check_checkpoints(checkpoints, asdict(cfg), train.resume)
    if train.shard_target and teacher_mode(train.teacher, device) != "online":
        raise ValueError(f"train.teacher={train.teacher!r} is offline on {device}: train.shard_target needs online")
    # a sharded target is loaded whole into host memory, then each process keeps its shards on the device
    sharded = train.shard_target and accelerator.num_processes > 1
    target, tokenizer = load_target(cfg.target, cfg.dtype, "cpu" if sharded else device, cfg.skinny_matmul)
    check_drafter_tokenizer(cfg.drafter, tokenizer)
    vocab_size = target.config.get_text_config().vocab_size
    if job == "distill" and train.teacher_topk > vocab_size:
        raise ValueError(
            f"train.teacher_topk={train.teacher_topk} is more than the target's vocabulary of {vocab_size} ids"
        )
    # no trackers (logger=jsonl): a no-op; wandb writes its run under output_dir/wandb/
    start_tracking(accelerator, cfg, asdict(cfg), output)
    logger = MetricsLogger(accelerator, output / "metrics.jsonl")

    # 1. sequences and the target's outputs on them, cached; 2. the drafter and what is trained
    cache_start = time.perf_counter()
    teacher = job_teacher(cfg, job, target, tokenizer, accelerator)
    drafter = _trainable_drafter(cfg, teacher, tokenizer)
    if sharded:
        for whole in {id(m): m for m in (teacher.target, teacher.scorer) if m is not None}.values():
            shard_target(whole, accelerator.device, accelerator.num_processes)
    objective = Objective(cfg, job, teacher, drafter, accelerator)
    cache_seconds = time.perf_counter() - cache_start
    autocast = autocast_dtype(resolve_mixed_precision(train.mixed_precision, accelerator.device))
    model = _logits_module(drafter, train, autocast)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=train.lr, weight_decay=train.weight_decay
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    # warm-up, then train.lr_decay over the budget; every checkpoint keeps it (as JSON), so a resume continues it
    scheduler = lr_scheduler(optimizer, train)
    objective.model = model

    # 3. resume or start, then train
    state, best = LoopState(), dict[str, torch.Tensor]()
    if train.resume and (restored := resume(accelerator, checkpoints, asdict(cfg), scheduler)) is not None:
        state, best = restored
        logger.log({"resumed_from_step": state.step})
    state, best = train_loop(
        accelerator,
        model,
        optimizer,
        scheduler,
        train,
        len(teacher.train_cache.sequences),
        objective.make_batches,
        objective.loss_sum,
        objective.evaluate,
        checkpoints,
        logger,
        state,
        best,
        asdict(cfg),
    )

    # 4. keep the best held-out acceptance, not the last step, and write the outputs
    metrics = _metrics(cfg, job, state, objective, cache_seconds)
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(model).drafter
        load_trainable_state(final, best)
        _store_acceptance(final, state, train.select_temperature or 1.0)
        if train.gamma_candidates:
            metrics["gamma"] = _choose_gamma(cfg, target, tokenizer, final, teacher, state.best_acceptance)
        _save(cfg, final, tokenizer, metrics, accelerator)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # finishes the trackers (the wandb run)
    return metrics


def _choose_gamma(
    cfg: TrainJobConfig,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    drafter: PreTrainedModel | FeatureDrafter,
    teacher: Teacher,
    acceptance: float,
) -> dict[str, Any]:
    """Store the gamma that decodes fastest with `drafter` (`choose_gamma`) on the first
    `train.gamma_prompts` held-out prompts that fit the target's context; with none, Leviathan's
    model on step costs timed after the longest held-out sequence."""
    train = cfg.train
    context = max((s.tokens for s in teacher.heldout.sequences), key=len)
    # a prompt the target cannot decode gamma_new_tokens after is left out (all left out: the model)
    limit = getattr(target.config, "max_position_embeddings", None)
    prompts = [
        p
        for p in decoding_prompts(cfg.data, tokenizer, train.gamma_prompts)
        if limit is None or len(p) + train.gamma_new_tokens <= limit
    ]
    figures = choose_gamma(
        target,
        drafter,
        context,
        acceptance,
        train.gamma_candidates,
        prompts,
        train.gamma_new_tokens,
        train.select_temperature,
    )
    drafter.config.specdecode_gamma = figures["chosen"]  # saved with the drafter, read by decode.drafter_gamma
    return figures


def _store_acceptance(drafter: PreTrainedModel | FeatureDrafter, state: LoopState, temperature: float) -> None:
    """Store the best evaluation's held-out acceptance with the drafter, where `gamma="auto"` starts
    each row (`decode.drafter_alpha`): greedy, and expected (Σ min(p, q)) at the selection `temperature`."""
    best = next((h for h in state.history if h["step"] == state.best_step), None)
    if best is not None and "greedy" in best and "expected" in best:
        drafter.config.specdecode_alpha = best["greedy"]
        drafter.config.specdecode_alpha_sampled = {"temperature": temperature, "alpha": best["expected"]}


def _logits_module(
    drafter: PreTrainedModel | FeatureDrafter, train: TrainConfig, autocast: torch.dtype | None
) -> torch.nn.Module:
    """The module the loop trains: the drafter's logits, a feature drafter's unrolled as decoding runs it."""
    if isinstance(drafter, FeatureDrafter):
        return FeatureDrafterLogits(drafter, train.unroll_steps, autocast, train.feature_noise)
    return DrafterLogits(drafter, autocast)


def _trainable_drafter(
    cfg: TrainJobConfig, teacher: Teacher, tokenizer: PreTrainedTokenizerBase
) -> PreTrainedModel | FeatureDrafter:
    """The drafter the config names (its truncated vocabulary from the training sequences), in
    train mode, its embeddings and head frozen as asked (`train.freeze_head` null: only an EAGLE-3
    drafter's own head trains)."""
    train = cfg.train
    corpus = [s.tokens for s in teacher.train_cache.sequences[: train.vocab_corpus_docs]]
    drafter = build_drafter(cfg.drafter, teacher.target, tokenizer, lambda: corpus)
    drafter.requires_grad_(True)
    if train.freeze_embeddings:
        drafter.get_input_embeddings().requires_grad_(False)
    freeze_head = train.freeze_head if train.freeze_head is not None else not isinstance(drafter, Eagle3Drafter)
    if freeze_head:
        drafter.get_output_embeddings().requires_grad_(False)
    drafter.train()
    return drafter


def _metrics(
    cfg: TrainJobConfig, job: str, state: LoopState, objective: Objective, cache_seconds: float
) -> dict[str, Any]:
    """metrics.json: the run's outcome (best held-out acceptance and when), its costs and its data."""
    train, teacher, accelerator, drafter = cfg.train, objective.teacher, objective.accelerator, objective.drafter
    num_train, select = len(teacher.train_cache.sequences), train.select_temperature
    return {
        "job": job,
        "data": cfg.data.name,
        "loss": cfg.loss.name if job == "distill" else "cross_entropy",
        "acceptance_before": state.acceptance_before,
        "acceptance_best": state.best_acceptance,
        "acceptance_gain": state.best_acceptance - (state.acceptance_before or 0.0),
        "best_step": state.best_step,
        "steps": state.step,
        "last_loss": state.last_loss,
        "train_tokens": state.train_tokens,
        "train_seconds": state.train_seconds,
        "train_tokens_per_s": state.train_tokens / state.train_seconds if state.train_seconds else None,
        "cache_and_setup_seconds": cache_seconds,
        "peak_memory_mb": peak_memory_mb(accelerator.device),
        "train_sequences": num_train,
        "heldout_sequences": len(teacher.heldout.sequences),
        "heldout_positions": teacher.heldout.num_positions,
        # where the target's outputs came from: the teacher store (offline) or its forward in the step (online)
        "teacher": "online" if teacher.scorer is not None else "offline",
        "draft_vocab": len(objective.draft_ids),
        "feature_layers": list(drafter.feature_layers) if isinstance(drafter, FeatureDrafter) else None,
        "num_processes": accelerator.num_processes,
        # the share of the target's parameters each process held (train.shard_target)
        "target_held": held_fraction(teacher.scorer or teacher.target),
        "mixed_precision": resolve_mixed_precision(train.mixed_precision, accelerator.device),
        "data_dtype": dtype_name(data_dtype(train.data_precision, teacher.target)),
        "drafter_kind": "eagle3" if isinstance(drafter, Eagle3Drafter) else "feature" if teacher.features else "slice",
        "select_temperature": select,
        "selection_metric": f"expected acceptance at T={select}" if select else "greedy acceptance",
        "best": next((h for h in state.history if h["step"] == state.best_step), None),
        "epochs": state.step * train.batch_size / num_train,
        "history": state.history,
        # the target's CPU kernels in this process: they set the step and verify costs the gamma choice timed
        "cpu_kernels": kernel_picks(teacher.target),
    }


def _save(
    cfg: TrainJobConfig,
    drafter: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    metrics: dict[str, Any],
    accelerator: Accelerator,
) -> None:
    """Write drafter/, metrics.json and config.yaml, each atomically (main process only)."""
    output = Path(cfg.output_dir)
    with atomic_folder(output / "drafter") as folder:
        drafter.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        write_training_card(folder, cfg, metrics)  # README.md: target, data, budget, acceptance, command
    if cfg.push_to_hub:
        push_to_hub(output / "drafter", cfg.push_to_hub)
    write_atomic(output / "metrics.json", json.dumps(metrics, indent=2))
    write_atomic(output / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(asdict(cfg))))
    if cfg.logger == "wandb":
        # the run's summary is metrics.json (through JSON: wandb refuses the int keys of metrics["gamma"])
        outcome = json.loads(json.dumps({k: v for k, v in metrics.items() if k != "history"}))
        accelerator.get_tracker("wandb", unwrap=True).summary.update(outcome)
