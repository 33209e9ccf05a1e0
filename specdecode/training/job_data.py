"""The teacher data a training job reads: the target's sequences and scores for the training and
held-out splits, written once per config and shared through the teacher cache (a mix reads its
domains' caches)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.core.devices import autocast_dtype, resolve_mixed_precision
from specdecode.data.config import DataConfig
from specdecode.decoding.compiled import resolve_compile
from specdecode.models.compat import default_eos
from specdecode.models.loading import cast_copy, reads_features
from specdecode.training.config import TrainJobConfig
from specdecode.training.objective import Teacher
from specdecode.training.sequences import (
    build_sequences,
    domain_limit,
    domain_parts,
    effective_limit,
    load_examples,
    mix_shares,
    pool_size,
)
from specdecode.training.teacher import (
    TeacherCache,
    cache_key,
    concat_caches,
    feature_cache,
    load_cache,
    save_cache,
    score_topk,
    sequences_only,
)


def cached_teacher(path: Path, build: Any, accelerator: Accelerator) -> TeacherCache:
    """Load `path`, or build it on the main process first (the others then read the file).

    One barrier per call on every process. A cache built from another cache (the scored sequences
    from the generated ones) reads or writes the inner one without a barrier, never a nested
    `cached_teacher`: only the main process runs a build, so a nested barrier would be one the others
    never reach.
    """
    with accelerator.main_process_first():
        if path.is_file():
            return load_cache(path)
        cache = build()
        if accelerator.is_main_process:
            save_cache(cache, path)
        return cache


def job_teacher(
    cfg: TrainJobConfig, job: str, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, accelerator: Accelerator
) -> Teacher:
    """The training and held-out sequences and the target's outputs on them, each cached once
    (finetune needs no logits: k = 0; a feature drafter's teacher is the frozen head on the cached
    features, so it needs none either)."""
    train = cfg.train
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else Path(cfg.output_dir).parent / "teacher_cache"
    eos = default_eos(target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    layers = reads_features(cfg.drafter, target.config.get_text_config().num_hidden_layers)
    topk = train.teacher_topk if job == "distill" and layers is None else 0
    # The training split is written (and scored) by the target in train.data_precision (a cast copy,
    # made only if a cache has to be built); the held-out split, which model selection measures
    # against, by the target as loaded. A dtype is part of a cache's key.
    written_dtype = data_dtype(train.data_precision, target)
    data_target = functools.cache(lambda: cast_copy(target, written_dtype))

    def split_target(split: str) -> tuple[Callable[[], PreTrainedModel], str]:
        if split == "train" and written_dtype != target.dtype:
            return data_target, dtype_name(written_dtype)
        return lambda: target, cfg.dtype

    def written(data: DataConfig, split: str, limit: int | None) -> TeacherCache:
        """The split's sequences, cached apart from their scores (one set of target continuations for
        drafters of either kind), a feature drafter's features from the same passes (`build_sequences`)."""
        model, dtype = split_target(split)
        path = cache_dir / f"sequences-{split}-{cache_key(cfg.target, data, train, split, 0, limit, dtype=dtype)}.pt"
        if path.is_file():
            return load_cache(path)
        sequences, read = build_sequences(
            load_examples(data, split),
            tokenizer,
            model(),
            train,
            eos,
            limit,
            layers if train.seq_source == "target" else None,
            compile=None if cfg.compile is None else resolve_compile(cfg.compile, model().device),
        )
        if accelerator.is_main_process:
            save_cache(sequences_only(sequences), path)
        return sequences_only(sequences) if read is None else feature_cache(sequences, read)

    def domain_scored(data: DataConfig, split: str, name: str, k: int, limit: int | None) -> TeacherCache:
        model, dtype = split_target(split)

        def build() -> TeacherCache:
            cache = written(data, split, limit)
            return (
                cache
                if cache.features is not None
                else score_topk(model(), cache.sequences, k, pad_id, features=layers)
            )

        return cached_teacher(
            cache_dir / f"{name}-{cache_key(cfg.target, data, train, split, k, limit, layers, dtype)}.pt",
            build,
            accelerator,
        )

    def scored(split: str, name: str, k: int, limit: int | None) -> TeacherCache:
        """A domain's cache, or a mix's: its domains' own caches (`domain_parts`), each domain's
        share of the first `limit` interleaved sequences, so a generic drafter trained beside the
        domain drafters costs no target pass of its own."""
        # A cache is keyed by the sequences it holds: a limit past a domain's examples names the
        # same cache as their count (a mix's shares never pass them), so a mix finds its domains'.
        if not cfg.data.is_mix:
            limit = domain_limit(train, cfg.data.name, split, limit)
            return domain_scored(cfg.data, split, name, k, effective_limit(limit, pool_size(cfg.data, train, split)))
        shares = mix_shares(cfg.data, train, split, limit)
        return concat_caches(
            [domain_scored(part, split, name, k, n) for part, n in zip(domain_parts(cfg.data), shares)]
        )

    train_cache = scored("train", f"{job}-train", topk, train.train_sequences)
    heldout = scored("heldout", "heldout", 0, train.heldout_sequences)
    if not train_cache.sequences or not heldout.sequences:
        where = f"data.path={cfg.data.path!r}" if cfg.data.source == "file" else f"data.name={cfg.data.name!r}"
        raise ValueError(f"{where}: no usable {'train' if not train_cache.sequences else 'held-out'} sequences")
    return Teacher(target, train_cache, heldout, pad_id, eos, topk, layers is not None)


def data_dtype(precision: str, target: PreTrainedModel) -> torch.dtype:
    """The dtype `train.data_precision` asks the target to write training data in (`no`: its own)."""
    return autocast_dtype(resolve_mixed_precision(precision, target.device)) or target.dtype


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → "bfloat16", as configs spell dtypes."""
    return str(dtype).removeprefix("torch.")
