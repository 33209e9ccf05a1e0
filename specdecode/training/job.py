"""Drafter training jobs: `run_distill` (token-level distillation, DistillSpec) and `run_finetune`
(next-token loss on domain text), the library behind train/distill.py and train/finetune.py.

A job: validate the config (before any heavy work), load the target, build the drafter (derived
from the target with a truncated-vocab head, or any HF model with the target's tokenizer), build or
load the teacher cache (specdecode.training.teacher), train (specdecode.training.loop), and write to `output_dir`:
`drafter/` (HF `save_pretrained`, the checkpoint with the best held-out expected acceptance, not
the lowest loss), `metrics.json`, `config.yaml`, `metrics.jsonl` and `checkpoints/`; with
`logger=wandb` the same records also go to a wandb run (accelerate's tracker) under `wandb/`.

Trainable: the decoder layers and final norm; embeddings and LM head are frozen by default, which
keeps the drafter's step cheap and its head aligned with the embedding space it was cut from.

On-policy sequences (`train.lambda_on_policy` > 0): with probability lambda per step the drafter
writes the continuations (batched `autoregressive_generate`) and the target scores them on the
spot. Nothing can be cached there, so such a step costs a drafter generation plus a target forward
(on this CPU ~4-5x an off-policy step of the same size).
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import OmegaConf
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.core.atomic import atomic_folder, write_atomic
from specdecode.models.config import TargetConfig
from specdecode.training.config import TrainJobConfig
from specdecode.core.devices import placed_accelerator
from specdecode.core.locking import locks_output_dir
from specdecode.training.losses import get_loss
from specdecode.training.feature_training import FeatureDrafterLogits, feature_regression_sum, frozen_head_rows, pass_positions
from specdecode.models.draft_vocab import draft_vocab_ids
from specdecode.models.loading import build_drafter, check_drafter_tokenizer, load_model, reads_features
from specdecode.decoding.speedup import choose_gamma
from specdecode.training.teacher import (
    TeacherCache,
    TrainSequence,
    build_sequences,
    cache_key,
    dense_teacher_logits,
    generate_continuations,
    heldout_targets,
    load_cache,
    padded_features,
    load_examples,
    pad_batch,
    save_cache,
    score_topk,
)
from specdecode.training.checkpoints import LoopState, check_checkpoints, resume
from specdecode.training.loop import Batch, DrafterLogits, MetricsLogger, load_trainable_state, peak_memory_mb, train_loop
from specdecode.models.compat import default_eos

JOBS = ("distill", "finetune")


def run_distill(cfg: TrainJobConfig) -> dict[str, Any]:
    """Token-level distillation from the target; returns the metrics written to metrics.json."""
    return _run(cfg, "distill")


def run_finetune(cfg: TrainJobConfig) -> dict[str, Any]:
    """Next-token cross-entropy on the sequences (dataset or target-generated responses)."""
    return _run(cfg, "finetune")


def load_target(
    cfg: TargetConfig, dtype: str, device: torch.device, skinny_matmul: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target in eval mode, frozen (`smoke` is the tiny in-process one, see `load_model`)."""
    target, tokenizer = load_model(cfg.name, dtype=dtype, device=device, skinny_matmul=skinny_matmul)
    target.requires_grad_(False)
    return target, tokenizer


def _check_environment(cfg: TrainJobConfig) -> None:
    if cfg.logger == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ImportError("logger=wandb needs the wandb package, which is not installed: pip install wandb")


def _load_or_build(path: Path, build: Any, save: bool) -> TeacherCache:
    """Load `path`, or build it (and save it when `save`). No barrier: see `_cached`."""
    if path.is_file():
        return load_cache(path)
    cache = build()
    if save:
        save_cache(cache, path)
    return cache


def _cached(path: Path, build: Any, accelerator: Accelerator) -> TeacherCache:
    """Load `path`, or build it on the main process first (the others then read the file).

    One barrier per call on every process. A cache built from another cache (the scored sequences
    from the generated ones) reads the inner one with `_load_or_build`, never a nested `_cached`:
    only the main process runs a build, so a nested barrier would be one the others never reach.
    """
    with accelerator.main_process_first():
        return _load_or_build(path, build, save=accelerator.is_main_process)


@locks_output_dir
def _run(cfg: TrainJobConfig, job: str) -> dict[str, Any]:
    # 0. everything that can fail cheaply fails first
    _check_environment(cfg)
    train = cfg.train
    output = Path(cfg.output_dir)
    accelerator, device = placed_accelerator(cfg.device, gradient_accumulation_steps=train.grad_accum,
                                             log_with="wandb" if cfg.logger == "wandb" else None, project_dir=output)
    if train.batch_size % (accelerator.num_processes * train.grad_accum):
        raise ValueError(f"train.batch_size={train.batch_size} must be a multiple of processes x grad_accum "
                         f"= {accelerator.num_processes} x {train.grad_accum}")
    set_seed(train.seed)
    check_checkpoints(output / "checkpoints", asdict(cfg), train.resume)
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else output.parent / "teacher_cache"
    target, tokenizer = load_target(cfg.target, cfg.dtype, device, cfg.skinny_matmul)
    check_drafter_tokenizer(cfg.drafter, tokenizer)
    vocab_size = target.config.get_text_config().vocab_size
    if job == "distill" and train.teacher_topk > vocab_size:
        raise ValueError(f"train.teacher_topk={train.teacher_topk} is more than the target's vocabulary of {vocab_size} ids")
    loss_fn = get_loss(cfg.loss.name)
    loss_kwargs = {"beta": cfg.loss.beta} if cfg.loss.name == "jsd" else {}
    eos = default_eos(target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    # no trackers (logger=jsonl): a no-op; wandb writes its run under output_dir/wandb/
    accelerator.init_trackers(project_name=cfg.wandb_project, config=asdict(cfg),
                              init_kwargs={"wandb": {"mode": cfg.wandb_mode, "dir": str(output)}})
    logger = MetricsLogger(accelerator, output / "metrics.jsonl")

    # 1. sequences and the target's top-k logits on them, cached (finetune needs no logits: k = 0)
    cache_start = time.perf_counter()
    # (a feature drafter's teacher is the frozen head on the cached features: no top-k needed)
    features = reads_features(cfg.drafter)
    topk = train.teacher_topk if job == "distill" and not features else 0
    def sequences(split: str, limit: int | None) -> list[TrainSequence]:
        """The split's training sequences, cached apart from what is scored on them, so drafters of
        either kind trained on the same data share one (costly) set of target continuations."""
        key = cache_key(cfg.target, cfg.data, train, split, 0, limit, dtype=cfg.dtype)
        return _load_or_build(cache_dir / f"sequences-{split}-{key}.pt", lambda: score_topk(target, build_sequences(
            load_examples(cfg.data, split), tokenizer, target, train, eos, limit), 0, pad_id), accelerator.is_main_process).sequences

    train_cache = _cached(
        cache_dir / f"{job}-train-{cache_key(cfg.target, cfg.data, train, 'train', topk, train.train_sequences, features, cfg.dtype)}.pt",
        lambda: score_topk(target, sequences("train", train.train_sequences), topk, pad_id, features=features),
        accelerator,
    )
    heldout = _cached(
        cache_dir / f"heldout-{cache_key(cfg.target, cfg.data, train, 'heldout', 0, train.heldout_sequences, features, cfg.dtype)}.pt",
        lambda: score_topk(target, sequences("heldout", train.heldout_sequences), 0, pad_id, features=features),
        accelerator,
    )
    if not train_cache.sequences or not heldout.sequences:
        where = f"data.path={cfg.data.path!r}" if cfg.data.source == "file" else f"data.name={cfg.data.name!r}"
        raise ValueError(f"{where}: no usable {'train' if not train_cache.sequences else 'held-out'} sequences")

    # 2. the drafter, its vocabulary and what is trained
    corpus = [s.tokens for s in train_cache.sequences[: train.vocab_corpus_docs]]
    drafter = build_drafter(cfg.drafter, target, tokenizer, lambda: corpus)
    draft_ids = draft_vocab_ids(drafter)
    vocab_to_draft = torch.full((target.config.get_text_config().vocab_size,), -1, dtype=torch.long)
    vocab_to_draft[draft_ids] = torch.arange(len(draft_ids))
    drafter.requires_grad_(True)
    if train.freeze_embeddings:
        drafter.get_input_embeddings().requires_grad_(False)
    if train.freeze_head:
        drafter.get_output_embeddings().requires_grad_(False)
    drafter.train()
    # Held-out: each process scores its share of the sequences once (exact p at the draft ids, and
    # the target's argmax), at the temperature selection is made for (greedy: p at T = 1 is logged).
    my_indices = list(range(len(heldout.sequences)))[accelerator.process_index :: accelerator.num_processes]
    my_heldout = [heldout.sequences[i] for i in my_indices]
    select_tau = train.select_temperature or 1.0
    my_heldout_p, my_heldout_argmax = heldout_targets(target, my_heldout, draft_ids, select_tau, pad_id) if my_heldout else (None, None)
    cache_seconds = time.perf_counter() - cache_start

    if features:
        teacher_weight, teacher_bias = frozen_head_rows(target.get_output_embeddings(), draft_ids)
        model = FeatureDrafterLogits(drafter, train.unroll_steps)
    else:
        model = DrafterLogits(drafter)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=train.lr, weight_decay=train.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    tau = 1.0 if train.temperature == 0 else train.temperature

    def micro_batches(sequences: list[TrainSequence], scored: TeacherCache, picks: list[int]) -> list[Batch]:
        """`grad_accum` micro-batches of `sequences`, which are `scored`'s sequences `picks`."""
        size = len(sequences) // train.grad_accum
        out = []
        for start in range(0, len(sequences), size):
            mine = picks[start : start + size]
            input_ids, attention_mask, positions = pad_batch(sequences[start : start + size], pad_id)
            batch = {"input_ids": input_ids, "attention_mask": attention_mask}
            if features:  # the distillation teacher is then the frozen head on them (loss_sum)
                batch["features"] = padded_features(scored, mine, input_ids.shape[1])
            if job == "finetune":
                labels = torch.cat([vocab_to_draft[input_ids[:, 1:]], torch.full_like(input_ids[:, :1], -1)], 1)
                positions = positions & (labels >= 0)
                batch["labels"] = labels
            elif not features:
                ids = torch.zeros(*positions.shape, topk, dtype=torch.int32)
                logits = torch.zeros(*positions.shape, topk)
                ids[positions] = torch.cat([scored.topk_ids[scored.offsets[i] : scored.offsets[i + 1]] for i in mine])
                logits[positions] = torch.cat([scored.topk_logits[scored.offsets[i] : scored.offsets[i + 1]] for i in mine])
                positions = positions & (vocab_to_draft[ids.long()] >= 0).any(-1)
                batch |= {"topk_ids": ids, "topk_logits": logits}
            out.append(batch | {"positions": positions})
        return out

    def make_batches(indices: list[int], step: int, on_policy: bool) -> list[Batch]:
        if not on_policy:
            return micro_batches([train_cache.sequences[i] for i in indices], train_cache, indices)
        # GKD: the drafter writes the continuations, the target scores them now (not cacheable)
        prompts = [train_cache.sequences[i].tokens[: train_cache.sequences[i].response_start] for i in indices]
        seed = train.seed + 7919 * step + 104_729 * accelerator.process_index
        responses = generate_continuations(accelerator.unwrap_model(model).drafter, prompts, train, eos, seed)
        # an empty continuation stays: 0 counted tokens, but every process keeps `grad_accum` micro-batches
        sequences = [TrainSequence(p + r, len(p)) for p, r in zip(prompts, responses)]
        return micro_batches(sequences, score_topk(target, sequences, topk, pad_id), list(range(len(sequences))))

    def loss_sum(module: torch.nn.Module, batch: Batch) -> torch.Tensor:
        if features:
            return feature_loss_sum(module, batch)
        student = module(batch["input_ids"], batch["attention_mask"])  # [B, T, K]
        if job == "finetune":
            return F.cross_entropy(student[batch["positions"]], batch["labels"][batch["positions"]], reduction="sum")
        teacher = dense_teacher_logits(batch["topk_ids"], batch["topk_logits"], vocab_to_draft.to(student.device), student.shape[-1])
        return loss_fn(student, teacher, batch["positions"], temperature=tau, reduction="sum", **loss_kwargs)

    def feature_loss_sum(module: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """Token loss of every unrolled pass (vs the frozen head on the target's features, or the
        next token) plus the weighted regression of the target's feature."""
        logits, predicted = module(batch["input_ids"], batch["attention_mask"], batch["features"])  # [S, B, T, K|H]
        masks = pass_positions(batch["positions"], logits.shape[0])
        total = logits.new_zeros(())
        if job == "distill":
            teacher = F.linear(batch["features"], teacher_weight.to(logits.device), None if teacher_bias is None else teacher_bias.to(logits.device))
        for j in range(logits.shape[0]):
            if job == "finetune":
                total = total + F.cross_entropy(logits[j][masks[j]], batch["labels"][masks[j]], reduction="sum")
            else:
                total = total + loss_fn(logits[j], teacher, masks[j], temperature=tau, reduction="sum", **loss_kwargs)
            if train.feature_loss_weight:
                total = total + train.feature_loss_weight * feature_regression_sum(predicted[j], batch["features"], masks[j])
        return total

    def heldout_logits(module: torch.nn.Module, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`[S, P, K]` drafter logits at the loss positions of held-out sequences `indices` (S
        unrolled passes for a feature drafter, 1 otherwise) and the `[S, P]` mask of positions
        each pass can score."""
        chunk = [heldout.sequences[i] for i in indices]
        input_ids, attention_mask, positions = pad_batch(chunk, pad_id)
        input_ids, attention_mask = input_ids.to(accelerator.device), attention_mask.to(accelerator.device)
        if not features:
            logits = module(input_ids, attention_mask)[positions.to(accelerator.device)].unsqueeze(0)
            return logits, torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)
        target_features = padded_features(heldout, indices, input_ids.shape[1]).to(accelerator.device)
        logits, _ = module(input_ids, attention_mask, target_features)
        scored = pass_positions(positions.to(accelerator.device), logits.shape[0])
        on_positions = positions.to(accelerator.device)
        return logits[:, on_positions], scored[:, on_positions]

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        """Held-out acceptance, all processes pooled: `greedy` = how often the drafter's argmax is
        the target's (greedy decoding's acceptance), `expected` = mean Σ_v min(p, q) at the selection
        temperature (1 when selecting for greedy); for a feature drafter averaged over the unrolled
        passes. `score` is the one selection uses."""
        module = accelerator.unwrap_model(model)
        module.eval()
        totals = torch.zeros(3, device=accelerator.device)
        row = 0
        for start in range(0, len(my_indices), 8):
            logits, scored = heldout_logits(module, my_indices[start : start + 8])  # [S, P, K], [S, P]
            count = logits.shape[1]
            p = my_heldout_p[row : row + count].to(logits.device, torch.float32)
            argmax = my_heldout_argmax[row : row + count].to(logits.device)
            row += count
            q = logits.float().div(select_tau).softmax(-1)
            expected = torch.minimum(p.unsqueeze(0), q).sum(-1)
            greedy = (draft_ids.to(logits.device)[logits.argmax(-1)] == argmax.unsqueeze(0)).float()
            totals += torch.stack([expected[scored].sum(), greedy[scored].sum(), scored.sum().float()])
        module.train()
        summed = accelerator.gather_for_metrics(totals.unsqueeze(0)).sum(0)
        expected, greedy = (summed[:2] / summed[2].clamp_min(1)).tolist()
        return {"score": greedy if train.select_temperature == 0 else expected, "greedy": greedy, "expected": expected}

    # 3. resume or start, then train
    checkpoints = output / "checkpoints"
    state, best = LoopState(), {}
    if train.resume and (restored := resume(accelerator, checkpoints, asdict(cfg))) is not None:
        state, best = restored
        logger.log({"resumed_from_step": state.step})
    state, best = train_loop(accelerator, model, optimizer, train, len(train_cache.sequences), make_batches,
                             loss_sum, evaluate, checkpoints, logger, state, best, asdict(cfg))

    # 4. keep the best held-out acceptance, not the last step, and write the outputs
    metrics = {
        "job": job, "data": cfg.data.name, "loss": cfg.loss.name if job == "distill" else "cross_entropy",
        "acceptance_before": state.acceptance_before, "acceptance_best": state.best_acceptance,
        "acceptance_gain": state.best_acceptance - (state.acceptance_before or 0.0),
        "best_step": state.best_step, "steps": state.step, "last_loss": state.last_loss,
        "train_tokens": state.train_tokens, "train_seconds": state.train_seconds,
        "train_tokens_per_s": state.train_tokens / state.train_seconds if state.train_seconds else None,
        "cache_and_setup_seconds": cache_seconds, "peak_memory_mb": peak_memory_mb(accelerator.device),
        "train_sequences": len(train_cache.sequences), "heldout_sequences": len(heldout.sequences),
        "heldout_positions": int(heldout.offsets[-1]), "draft_vocab": len(draft_ids),
        "num_processes": accelerator.num_processes, "drafter_kind": "feature" if features else "slice",
        "select_temperature": train.select_temperature,
        "selection_metric": "greedy acceptance" if train.select_temperature == 0 else f"expected acceptance at T={train.select_temperature}",
        "best": next((h for h in state.history if h["step"] == state.best_step), None),
        "epochs": state.step * train.batch_size / len(train_cache.sequences), "history": state.history,
    }
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(model).drafter
        load_trainable_state(final, best)
        if train.gamma_candidates:
            context = max((s.tokens for s in heldout.sequences), key=len)
            metrics["gamma"] = choose_gamma(target, final, context, state.best_acceptance, train.gamma_candidates)
        with atomic_folder(output / "drafter") as folder:
            final.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        write_atomic(output / "metrics.json", json.dumps(metrics, indent=2))
        write_atomic(output / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(asdict(cfg))))
        if cfg.logger == "wandb":
            # the run's summary shows the job's outcome as metrics.json has it (JSON: wandb refuses
            # the int keys of metrics["gamma"]), not just the last logged step
            outcome = json.loads(json.dumps({k: v for k, v in metrics.items() if k != "history"}))
            accelerator.get_tracker("wandb", unwrap=True).summary.update(outcome)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # finishes the trackers (the wandb run)
    return metrics
