"""What the target says about the training sequences, stored once (`training.store`) or computed
in each step (`train.teacher=online`). The store keeps the target's top-k logits at each loss
position (full logits would be 25 MB per 128-token SmolLM2 sequence); the losses read them as
p̃(v) ∝ exp(l_v / τ) over topk ∩ draft ids, 0 elsewhere. For feature drafters it keeps the target's
features at every token instead (fp16), so their teacher is exact. Held-out acceptance is exact.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors.torch
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specdecode.core.atomic import write_atomic
from specdecode.data.config import DataConfig
from specdecode.models.config import SMOKE_TARGET, TargetConfig
from specdecode.models.feature_drafter import target_features
from specdecode.models.gguf_cache import DEFAULT_TARGET
from specdecode.training.config import TrainConfig
from specdecode.training.sequences import TrainSequence

# In every store's key: its format and how its continuations are sampled.
CACHE_VERSION = 4
SCORE_BATCH = 8


@dataclass
class TeacherCache:
    """The target's top-k logits at every loss position of N `sequences`, flattened: `topk_ids`
    [P, k] int32 and raw `topk_logits` [P, k] fp32 (P = Σ num_targets), rows
    offsets[i]:offsets[i+1] of `offsets` [N + 1] belonging to sequence i."""

    sequences: list[TrainSequence]
    offsets: torch.Tensor
    topk_ids: torch.Tensor
    topk_logits: torch.Tensor
    # Feature drafters: the target's features at every token [Σ L_i, n·H] fp16, by `token_offsets`; else None.
    features: torch.Tensor | None = None
    token_offsets: torch.Tensor | None = None

    def sequence_features(self, index: int) -> torch.Tensor:
        """`[L_i, H]` fp16 target features of sequence `index` (a feature cache only)."""
        assert self.features is not None and self.token_offsets is not None
        return self.features[self.token_offsets[index] : self.token_offsets[index + 1]]

    @property
    def num_positions(self) -> int:
        """The loss positions of all sequences (P)."""
        return int(self.offsets[-1])

    def select(self, indices: Sequence[int]) -> TeacherCache:
        """A cache of sequences `indices` only, in that order (a training batch's)."""
        return concat_caches([self._one(i) for i in indices]) if indices else sequences_only([])

    def _one(self, index: int) -> TeacherCache:
        a, b = self.offsets[index], self.offsets[index + 1]
        features = self.sequence_features(index) if self.features is not None else None
        return single_cache(self.sequences[index], self.topk_ids[a:b], self.topk_logits[a:b], features)


def single_cache(
    sequence: TrainSequence, topk_ids: torch.Tensor, topk_logits: torch.Tensor, features: torch.Tensor | None
) -> TeacherCache:
    """A cache of one sequence: its `[P, k]` top-k ids and logits, and its `[L, n·H]` features or None."""
    tokens = None if features is None else torch.tensor([0, len(sequence.tokens)])
    return TeacherCache([sequence], torch.tensor([0, topk_ids.shape[0]]), topk_ids, topk_logits, features, tokens)


def concat_caches(parts: Sequence[TeacherCache]) -> TeacherCache:
    """One cache holding `parts`' sequences one part after another (a mix of domain caches)."""
    features = [p.features for p in parts]
    has_features = all(f is not None for f in features)
    return TeacherCache(
        [s for p in parts for s in p.sequences],
        offsets([s.num_targets for p in parts for s in p.sequences]),
        torch.cat([p.topk_ids for p in parts]),
        torch.cat([p.topk_logits for p in parts]),
        torch.cat(features) if has_features else None,  # type: ignore[arg-type]  # None where no part has features
        offsets([len(s.tokens) for p in parts for s in p.sequences]) if has_features else None,
    )


def pad_batch(sequences: Sequence[TrainSequence], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `input_ids` [B, T], `attention_mask` [B, T] and loss `positions` [B, T] bool."""
    width = max(len(s.tokens) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
    positions = torch.zeros(len(sequences), width, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq.tokens)] = torch.tensor(seq.tokens)
        attention_mask[row, : len(seq.tokens)] = 1
        positions[row, seq.response_start - 1 : len(seq.tokens) - 1] = True
    return input_ids, attention_mask, positions


@torch.no_grad()
def _target_outputs(
    target: PreTrainedModel,
    sequences: Sequence[TrainSequence],
    pad_id: int,
    logits: bool = True,
    feature_layers: Sequence[int] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One forward over `sequences`: `[Σ num_targets, V]` fp32 logits at the loss positions (with
    `logits`: the head is most of a small target's cost) and the `[Σ L_i, n·H]` features of
    `feature_layers` at every token (None without)."""
    input_ids, attention_mask, positions = pad_batch(sequences, pad_id)
    input_ids, attention_mask = input_ids.to(target.device), attention_mask.to(target.device)
    states = feature_layers is not None
    # the model's own forward for logits (some post-process the head's output, e.g. softcapping)
    model = target if logits else target.get_decoder()
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=states)
    features = (
        target_features(target, out.hidden_states, feature_layers)[attention_mask.bool()]
        if feature_layers is not None
        else None
    )
    return (out.logits[positions.to(out.logits.device)].float() if logits else None), features


def score_topk(
    target: PreTrainedModel,
    sequences: Sequence[TrainSequence],
    k: int,
    pad_id: int,
    *,
    features: Sequence[int] | None = None,
) -> TeacherCache:
    """The target's top-k logits over `sequences` and, with `features` (the layers a feature drafter
    reads), its features at every token; k = 0 and no features (or no sequences) runs nothing."""
    if (k == 0 and features is None) or not sequences:
        return sequences_only(sequences, k)
    ids, values, hidden = [], [], []
    for start in tqdm(
        range(0, len(sequences), SCORE_BATCH),
        desc="target forward (teacher cache)",
        leave=False,
        disable=len(sequences) <= 4 * SCORE_BATCH,
    ):
        logits, batch_hidden = _target_outputs(
            target, sequences[start : start + SCORE_BATCH], pad_id, logits=k > 0, feature_layers=features
        )
        if logits is not None:
            top = logits.topk(min(k, logits.shape[-1]), dim=-1)
            ids.append(top.indices.to(torch.int32).cpu())
            values.append(top.values.cpu())
        if batch_hidden is not None:
            hidden.append(batch_hidden.half().cpu())
    cache = feature_cache(sequences, hidden) if features is not None else sequences_only(sequences)
    if k:
        cache.topk_ids, cache.topk_logits = torch.cat(ids), torch.cat(values)
    return cache


def sequences_only(sequences: Sequence[TrainSequence], k: int = 0) -> TeacherCache:
    """A cache of `sequences` with nothing the target said about them (k empty logit columns)."""
    rows = offsets(s.num_targets for s in sequences)
    total = int(rows[-1])
    return TeacherCache(list(sequences), rows, torch.zeros(total, k, dtype=torch.int32), torch.zeros(total, k))


def offsets(counts: Iterable[int]) -> torch.Tensor:
    """`[N + 1]` start offsets of N consecutive blocks of `counts` rows."""
    return torch.tensor([0, *counts]).cumsum(0)


def feature_cache(sequences: Sequence[TrainSequence], features: Sequence[torch.Tensor]) -> TeacherCache:
    """A feature drafter's cache (no top-k logits) of `sequences` and their target `features`, one
    `[Σ L_i, n·H]` fp16 block per sequence or batch of them, in order."""
    cache = sequences_only(sequences)
    if not sequences:  # nothing to train on: the caller names why
        return cache
    cache.features = torch.cat(list(features)).half()
    cache.token_offsets = offsets(len(s.tokens) for s in sequences)
    if cache.features.shape[0] != int(cache.token_offsets[-1]):
        raise ValueError(
            f"features have {cache.features.shape[0]} rows for {int(cache.token_offsets[-1])} tokens "
            f"of {len(sequences)} sequences"
        )
    return cache


@torch.no_grad()
def heldout_targets(
    target: PreTrainedModel,
    sequences: Sequence[TrainSequence],
    draft_ids: torch.Tensor,
    temperature: float,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What held-out acceptance is measured against at every loss position (P): `[P, K]` fp16, the
    target's exact probabilities at `temperature` (0 → 1) at the drafter's K ids (for Σ min(p, q)),
    and `[P]` its full-vocabulary argmax (what greedy decoding accepts)."""
    tau = 1.0 if temperature == 0 else temperature
    probs, argmax = [], []
    for start in range(0, len(sequences), SCORE_BATCH):
        logits, _ = _target_outputs(target, sequences[start : start + SCORE_BATCH], pad_id)
        assert logits is not None  # asked for
        probs.append(logits.div(tau).softmax(-1)[:, draft_ids.to(logits.device)].half().cpu())
        argmax.append(logits.argmax(-1).cpu())
    return torch.cat(probs), torch.cat(argmax)


def cache_key(
    target: TargetConfig,
    data: DataConfig,
    train: TrainConfig,
    split: str,
    topk: int,
    limit: int | None,
    features: Sequence[int] | None = None,
    dtype: str = "float32",
) -> str:
    """Everything a store's sequences and logits depend on, hashed: a changed field is a new store.
    `topk` (0: sequences only) and `limit` are apart from `train`: other stores use other values."""
    generated = train.seq_source == "target"
    fields = {
        "version": CACHE_VERSION,
        "split": split,
        "target": asdict(target),
        "dtype": dtype,
        "data": asdict(data),
        "seq_source": train.seq_source,
        "max_prompt_tokens": train.max_prompt_tokens,
        "max_len": train.max_len,
        "max_new_tokens": train.max_new_tokens,
        "topk": topk,
        "limit": limit,
        "seed": train.seed if generated else None,
        # not the loss's temperature: the logits are stored raw
        "generation_temperatures": (train.seq_temperatures or [train.temperature]) if generated else None,
        "features": list(features) if features is not None else None,
        # a batch's continuations draw from one seeded generator
        "generation_batch": train.generation_batch if generated else None,
        "content": content_fingerprint(target, data),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def content_fingerprint(target: TargetConfig, data: DataConfig) -> dict[str, object]:
    """What the config's paths hold, so that a file edited in place is a new store: a data file's
    SHA-256, a local target's files' sizes and mtimes (hashing its weights would cost too much)."""
    fingerprint: dict[str, object] = {}
    if data.source == "file" and data.path:
        with Path(str(data.path)).expanduser().open("rb") as handle:
            fingerprint["data_sha256"] = hashlib.file_digest(handle, "sha256").hexdigest()
    local = Path(target.name).expanduser()
    if target.name not in (SMOKE_TARGET, DEFAULT_TARGET) and local.exists():
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        fingerprint["target_files"] = [
            [str(p.relative_to(local)) if p != local else p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files
        ]
    return fingerprint


def save_cache(cache: TeacherCache, path: Path) -> None:
    """Write `cache` as one safetensors file (a store's shard), atomically: sequences as flat `tokens`
    [Σ L_i] int32 with their `token_offsets` [N + 1] and `response_start` [N]."""
    tensors = {
        "tokens": torch.tensor([t for s in cache.sequences for t in s.tokens], dtype=torch.int32),
        "token_offsets": offsets(len(s.tokens) for s in cache.sequences),
        "response_start": torch.tensor([s.response_start for s in cache.sequences], dtype=torch.long),
        "offsets": cache.offsets.long(),
        "topk_ids": cache.topk_ids.to(torch.int32),
        "topk_logits": cache.topk_logits.float(),
    }
    if cache.features is not None:
        tensors["features"] = cache.features.half()
    write_atomic(path, safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()}))


def load_cache(path: Path) -> TeacherCache:
    """The `TeacherCache` a `save_cache` file holds, all in memory (a store reads shards lazily)."""
    tensors = safetensors.torch.load_file(path)
    starts, offsets = tensors["response_start"].tolist(), tensors["token_offsets"]
    tokens = tensors["tokens"].tolist()
    sequences = [TrainSequence(tokens[offsets[i] : offsets[i + 1]], start) for i, start in enumerate(starts)]
    features = tensors.get("features")
    return TeacherCache(
        sequences,
        tensors["offsets"],
        tensors["topk_ids"],
        tensors["topk_logits"],
        features,
        offsets if features is not None else None,
    )


def padded_features(cache: TeacherCache, indices: Sequence[int], width: int) -> torch.Tensor:
    """Right-padded `[B, width, n·H]` fp32 target features of `cache.sequences[i]` for i in `indices`."""
    rows = [cache.sequence_features(i) for i in indices]
    out = torch.zeros(len(rows), width, rows[0].shape[-1])
    for row, values in enumerate(rows):
        out[row, : values.shape[0]] = values.float()
    return out


def dense_teacher_logits(
    topk_ids: torch.Tensor, topk_logits: torch.Tensor, vocab_to_draft: torch.Tensor, num_draft: int
) -> torch.Tensor:
    """Spread top-k logits [..., k] over the drafter's vocabulary: [..., K], -inf where the target's
    top k has no entry (the module docstring's approximation)."""
    index = vocab_to_draft[topk_ids.long()]
    index = torch.where(index < 0, num_draft, index)  # dropped ids go to a spill column cut off below
    dense = topk_logits.new_full((*topk_logits.shape[:-1], num_draft + 1), float("-inf"))
    return dense.scatter(-1, index, topk_logits)[..., :num_draft]
