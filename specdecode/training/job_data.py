"""The teacher data a training job reads: the target's sequences and its outputs on them for the
training and held-out splits, written once per config as teacher stores shared by the jobs that
train on the same sequences (a mix reads its domains'); online, the sequences only."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.core.devices import autocast_dtype, resolve_mixed_precision
from specdecode.data.config import DataConfig
from specdecode.data.domains import format_prompt
from specdecode.data.example import Example
from specdecode.decoding.compiled import resolve_compile
from specdecode.models.compat import default_eos
from specdecode.models.loading import cast_copy, reads_features
from specdecode.training.config import TrainJobConfig
from specdecode.training.objective import Teacher
from specdecode.training.sequences import (
    build_sequences,
    data_key,
    domain_parts,
    domain_size,
    load_examples,
    mix_shares,
    training_pool,
    writer_plan,
)
from specdecode.training.store import (
    SHARD_BATCHES,
    TeacherStore,
    finish_store,
    is_complete,
    shard_path,
    shard_ranges,
    write_shards,
)
from specdecode.training.teacher import cache_key, feature_cache, load_cache, save_cache, score_topk, sequences_only


def teacher_mode(setting: str, device: torch.device) -> str:
    """`train.teacher` resolved for `device`: auto is online on a GPU, offline elsewhere."""
    if setting != "auto":
        return setting
    return "online" if device.type == "cuda" else "offline"


def job_teacher(
    cfg: TrainJobConfig, job: str, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, accelerator: Accelerator
) -> Teacher:
    """The training and held-out sequences and the target's outputs on them, each stored once
    (no logits for finetune or a feature drafter); online, only the sequences."""
    train = cfg.train
    eos = default_eos(target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    layers = reads_features(cfg.drafter, target.config.get_text_config().num_hidden_layers)
    topk = train.teacher_topk if job == "distill" and layers is None else 0
    online = teacher_mode(train.teacher, accelerator.device) == "online"
    # the training split is written and scored in train.data_precision (a cast copy, made only when
    # needed), the held-out split by the target as loaded
    written_dtype = data_dtype(train.data_precision, target)
    stores = JobStores(
        cfg,
        tokenizer,
        accelerator,
        Path(cfg.cache_dir) if cfg.cache_dir else Path(cfg.output_dir).parent / "teacher_cache",
        functools.cache(lambda: cast_copy(target, written_dtype)),
        target,
        dtype_name(written_dtype) if written_dtype != target.dtype else cfg.dtype,
        pad_id,
        eos,
        layers,
        online,
    )
    train_store = stores.split("train", f"{job}-train", topk, train.train_sequences)
    heldout = stores.split("heldout", "heldout", 0, train.heldout_sequences)
    if not len(train_store) or not len(heldout):
        raise ValueError(f"{data_key(cfg.data)}: no usable {'train' if not len(train_store) else 'held-out'} sequences")
    scorer = stores.data_target() if online else None
    return Teacher(target, train_store, heldout, pad_id, eos, topk, layers is not None, scorer, layers)


@dataclass
class JobStores:
    """The stores one job reads, written where missing: per domain and split, the sequences
    (`sequences-<split>-<key>`) and, offline, the target's outputs on them (`<name>-<key>`)."""

    cfg: TrainJobConfig
    tokenizer: PreTrainedTokenizerBase
    accelerator: Accelerator
    cache_dir: Path
    data_target: Callable[[], PreTrainedModel]
    target: PreTrainedModel
    # the dtype the training split is written in, as its stores' keys name it
    data_dtype: str
    pad_id: int
    eos: list[int]
    layers: tuple[int, ...] | None
    online: bool

    def split(self, split: str, name: str, k: int, limit: int | None) -> TeacherStore:
        """A domain's store, or a mix's: its domains' own stores, each its share of the first
        `limit` interleaved sequences (a generic drafter costs no target pass of its own)."""
        data, train = self.cfg.data, self.cfg.train
        if not data.is_mix:
            return self.domain(data, split, name, k, domain_size(data, train, split, limit))
        shares = mix_shares(data, train, split, limit)
        return TeacherStore.concat(
            [self.domain(part, split, name, k, n) for part, n in zip(domain_parts(data), shares)]
        )

    def domain(self, data: DataConfig, split: str, name: str, k: int, limit: int) -> TeacherStore:
        """One domain's store of `limit` sequences: this process's share of its missing shards
        written, then its manifest (two barriers on every process)."""
        train, accelerator = self.cfg.train, self.accelerator
        dtype = self.data_dtype if split == "train" else self.cfg.dtype
        sequences = (
            self.cache_dir
            / f"sequences-{split}-{cache_key(self.cfg.target, data, train, split, 0, limit, dtype=dtype)}"
        )
        scored = (
            self.cache_dir / f"{name}-{cache_key(self.cfg.target, data, train, split, k, limit, self.layers, dtype)}"
        )
        folder = sequences if self.online else scored
        pool = training_pool(load_examples(data, split), train)[:limit]
        ranges = shard_ranges(len(pool), SHARD_BATCHES * train.generation_batch)
        if not is_complete(folder):
            shard = ShardWriter(self, split, pool, sequences, k, scored=not self.online)
            write_shards(folder, ranges, shard, accelerator.process_index, accelerator.num_processes)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            finish_store(sequences, ranges)
            finish_store(folder, ranges)
        accelerator.wait_for_everyone()
        return TeacherStore.open(folder)

    def model(self, split: str) -> PreTrainedModel:
        """The target that writes `split`: the training split in `train.data_precision`."""
        return self.data_target() if split == "train" else self.target


@dataclass
class ShardWriter:
    """`(start, stop, path)`: writes one shard of a domain's store from the prompts `pool[start:stop]`:
    its sequences (read from their own store or written), then for a scored store the target's
    outputs. The scored shard is saved first: a kill between the two leaves seeded sequences to
    write again, not features to recompute (a forward's are not the writer's bit for bit)."""

    stores: JobStores
    split: str
    pool: Sequence[Example]
    sequences: Path
    k: int
    scored: bool

    def __call__(self, start: int, stop: int, path: Path) -> None:
        stores, train = self.stores, self.stores.cfg.train
        layers = stores.layers if self.scored else None
        own = shard_path(self.sequences, start, stop)
        if own.is_file():
            cache = load_cache(own)
        else:
            compile, capacity = self.plan
            written, read = build_sequences(
                self.pool[start:stop],
                stores.tokenizer,
                stores.model(self.split),
                train,
                stores.eos,
                None,
                layers if train.seq_source == "target" else None,
                compile=compile,
                first=start,
                capacity=capacity,
            )
            cache = sequences_only(written) if read is None else feature_cache(written, read)
        if self.scored and cache.features is None and (self.k or layers is not None):
            cache = score_topk(stores.model(self.split), cache.sequences, self.k, stores.pad_id, features=layers)
        save_cache(cache, path)
        if path != own and not own.is_file():
            save_cache(sequences_only(cache.sequences), own)

    @functools.cached_property
    def plan(self) -> tuple[bool, int | None]:
        """Whether the writer compiles, and the capacity every shard's batches share (`writer_plan`)."""
        stores, train = self.stores, self.stores.cfg.train
        if train.seq_source != "target":
            return False, None
        device = stores.model(self.split).device
        setting = None if stores.cfg.compile is None else resolve_compile(stores.cfg.compile, device)
        prompts = (format_prompt(stores.tokenizer, ex)[-train.max_prompt_tokens :] for ex in self.pool)
        return writer_plan(prompts, train, device, setting)


def data_dtype(precision: str, target: PreTrainedModel) -> torch.dtype:
    """The dtype `train.data_precision` asks the target to write training data in (`no`: its own)."""
    return autocast_dtype(resolve_mixed_precision(precision, target.device)) or target.dtype


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → "bfloat16", as configs spell dtypes."""
    return str(dtype).removeprefix("torch.")
