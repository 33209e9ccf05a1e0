"""Training sequences and what the target says about them, computed once and cached.

On a CPU the target's no-grad forward costs more than the drafter's whole training step (NOTES.md:
~250 training tokens/s when it is recomputed every step), so every target forward is paid once per
training sequence and stored.

What is stored. Full-vocabulary logits would be 25 MB per 128-token sequence for SmolLM2 (49,152
ids, fp32). The cache keeps, per loss position, the target's **top-k logits and their ids** (k =
`train.teacher_topk`, default 64: ~0.5 KB per position). The losses then compare the drafter and
the target over the drafter's vocabulary (its K draft ids; all V for a full head), with the
target's distribution approximated by its top-k ids that are also draft ids, renormalised:

    p̃(v) ∝ exp(l_v / τ) for v ∈ topk ∩ draft,  0 elsewhere.

The mass dropped is the target's tail beyond its top k plus whatever falls outside the draft
vocabulary; the drafter cannot emit the latter anyway, and the former is small at τ ≤ 1 (the
model's top 64 tokens hold most of its mass). The loss is approximate; the *metric* is not: the
held-out expected acceptance uses the target's exact full-vocabulary probabilities at the draft ids
(`heldout_probs`), where Σ_v min(p, q) needs nothing else because q = 0 outside them.

Positions. A sequence is prompt + response; only positions whose next token is a response token
carry a loss (the drafter drafts responses, never prompts), so only those are scored and cached.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.atomic import write_atomic
from specdecode.config import DataConfig, TargetConfig, TrainConfig
from specdecode.data import Example, format_prompt, load_domain
from specdecode.decode import autoregressive_generate
from specdecode.gguf_cache import DEFAULT_TARGET
from specdecode.smoke import SMOKE_TARGET

CACHE_VERSION = 1
SCORE_BATCH = 8


@dataclass
class TrainSequence:
    """Token ids `tokens` [L]; the response starts at `response_start` (>= 1), so the loss
    positions are t = response_start - 1 .. L - 2 (each predicts token t + 1): L - response_start."""

    tokens: list[int]
    response_start: int

    @property
    def num_targets(self) -> int:
        return len(self.tokens) - self.response_start


@dataclass
class TeacherCache:
    """The target's top-k logits at every loss position of `sequences`, flattened.

    Attributes:
        sequences: N training sequences.
        offsets: [N + 1] long; rows offsets[i]:offsets[i+1] belong to sequence i.
        topk_ids: [P, k] int32 token ids, P = Σ num_targets.
        topk_logits: [P, k] fp32 raw target logits (temperature is applied by the loss).
    """

    sequences: list[TrainSequence]
    offsets: torch.Tensor
    topk_ids: torch.Tensor
    topk_logits: torch.Tensor


def load_examples(data: DataConfig, split: str) -> list[Example]:
    """The split's examples of every domain in `data.domains`, interleaved (a `mix` prefix covers
    all domains), in a deterministic order."""
    per_domain = [
        load_domain(
            domain, source=data.source, split=split, heldout_fraction=data.heldout_fraction,  # type: ignore[arg-type]
            path=data.path, hf_id=data.hf_id, hf_split=data.hf_split,
            prompt_column=data.prompt_column, response_column=data.response_column,
        )
        for domain in data.domains
    ]
    longest = max(len(examples) for examples in per_domain)
    return [examples[i] for i in range(longest) for examples in per_domain if i < len(examples)]


def build_sequences(
    examples: Sequence[Example],
    tokenizer: PreTrainedTokenizerBase,
    target: PreTrainedModel,
    train: TrainConfig,
    eos: Sequence[int],
    limit: int | None,
) -> list[TrainSequence]:
    """Prompt (chat-formatted, left-truncated to `max_prompt_tokens`) + response, cut at `max_len`.

    The response is the example's own (`seq_source: data`, examples without one are skipped) or the
    target's continuation (`seq_source: target`, sequence-level distillation), generated in batches
    at `train.temperature`.
    """
    pool = [ex for ex in examples if train.seq_source == "target" or ex.response]
    pool = pool if limit is None else pool[:limit]
    prompts = [format_prompt(tokenizer, ex.prompt)[-train.max_prompt_tokens :] for ex in pool]
    if train.seq_source == "data":
        stop = [eos[0]] if eos else []
        responses = [tokenizer(ex.response, add_special_tokens=False)["input_ids"] + stop for ex in pool]
    else:
        responses = generate_continuations(target, prompts, train, eos, seed=train.seed)
    sequences = []
    for prompt, response in zip(prompts, responses):
        tokens = (prompt + list(response))[: train.max_len]
        if len(tokens) > len(prompt):
            sequences.append(TrainSequence(tokens=tokens, response_start=len(prompt)))
    return sequences


def generate_continuations(
    model: PreTrainedModel, prompts: Sequence[list[int]], train: TrainConfig, eos: Sequence[int], seed: int, batch_size: int = 16
) -> list[list[int]]:
    """`model`'s continuations of `prompts` (batched, ragged), at most `max_new_tokens` each."""
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        batch = list(prompts[start : start + batch_size])
        budgets = [min(train.max_new_tokens, train.max_len - len(p)) for p in batch]
        result = autoregressive_generate(
            model, batch, max_new_tokens=budgets, temperature=train.temperature,
            eos_token_ids=list(eos) or None, seed=seed + start,
        )
        out.extend(result.sequences)
    model.train(was_training)
    return out


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
def _target_logits_at_positions(target: PreTrainedModel, sequences: Sequence[TrainSequence], pad_id: int) -> torch.Tensor:
    """[Σ num_targets, V] target logits at the loss positions of `sequences` (one forward)."""
    input_ids, attention_mask, positions = pad_batch(sequences, pad_id)
    logits = target(input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device)).logits
    return logits[positions.to(logits.device)].float()


def score_topk(target: PreTrainedModel, sequences: Sequence[TrainSequence], k: int, pad_id: int) -> TeacherCache:
    """Run the target over `sequences` (batches of `SCORE_BATCH`) and keep its top-k logits;
    k = 0 keeps the sequences only and runs nothing (as does an empty list: the caller names why)."""
    counts = torch.tensor([0] + [s.num_targets for s in sequences])
    if k == 0 or not sequences:
        total = int(counts.sum())
        return TeacherCache(list(sequences), counts.cumsum(0), torch.zeros(total, k, dtype=torch.int32), torch.zeros(total, k))
    ids, values = [], []
    for start in range(0, len(sequences), SCORE_BATCH):
        logits = _target_logits_at_positions(target, sequences[start : start + SCORE_BATCH], pad_id)
        top = logits.topk(min(k, logits.shape[-1]), dim=-1)
        ids.append(top.indices.to(torch.int32).cpu())
        values.append(top.values.cpu())
    return TeacherCache(list(sequences), counts.cumsum(0), torch.cat(ids), torch.cat(values))


@torch.no_grad()
def heldout_probs(
    target: PreTrainedModel, sequences: Sequence[TrainSequence], draft_ids: torch.Tensor, temperature: float, pad_id: int
) -> torch.Tensor:
    """[Σ num_targets, K] fp16: the target's exact full-vocabulary probabilities at `temperature`
    (0 → 1, as the losses), at the drafter's K vocabulary ids, at every loss position."""
    tau = 1.0 if temperature == 0 else temperature
    chunks = []
    for start in range(0, len(sequences), SCORE_BATCH):
        logits = _target_logits_at_positions(target, sequences[start : start + SCORE_BATCH], pad_id)
        chunks.append(logits.div(tau).softmax(-1)[:, draft_ids.to(logits.device)].half().cpu())
    return torch.cat(chunks)


def cache_key(target: TargetConfig, data: DataConfig, train: TrainConfig, split: str, topk: int, limit: int | None) -> str:
    """Everything the cached sequences and logits depend on, hashed: a changed field is a new file.

    `topk` (0: sequences only) and `limit` (sequences kept) are passed apart from `train` because
    the held-out and fine-tuning caches use other values than the training fields."""
    fields = {
        "version": CACHE_VERSION, "split": split, "target": asdict(target), "data": asdict(data),
        "seq_source": train.seq_source, "max_prompt_tokens": train.max_prompt_tokens, "max_len": train.max_len,
        "max_new_tokens": train.max_new_tokens, "temperature": train.temperature, "topk": topk,
        "limit": limit, "seed": train.seed if train.seq_source == "target" else None,
        "content": content_fingerprint(target, data),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def content_fingerprint(target: TargetConfig, data: DataConfig) -> dict[str, object]:
    """What the config's paths hold, so that editing a file in place is a new cache, not a stale hit.

    A `data.source=file` file is hashed (SHA-256 of its bytes). A local target (`.gguf` file or HF
    folder) is fingerprinted by the size and mtime of each of its files: hashing gigabytes of
    weights on every run would cost more than the cache saves. Aliases and hub ids name fixed
    content (a package version, a hub revision) and add nothing.
    """
    fingerprint: dict[str, object] = {}
    if data.source == "file" and data.path:
        digest = hashlib.sha256()
        with Path(str(data.path)).expanduser().open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        fingerprint["data_sha256"] = digest.hexdigest()
    local = Path(target.name).expanduser()
    if target.name not in (SMOKE_TARGET, DEFAULT_TARGET) and local.exists():
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        fingerprint["target_files"] = [
            [str(p.relative_to(local)) if p != local else p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files
        ]
    return fingerprint


def save_cache(cache: TeacherCache, path: Path) -> None:
    """torch.save through `write_atomic`: never half-written, readable under the umask."""
    payload = asdict(cache) | {"sequences": [asdict(s) for s in cache.sequences]}
    write_atomic(path, lambda handle: torch.save(payload, handle))


def load_cache(path: Path) -> TeacherCache:
    payload = torch.load(path, weights_only=True)
    payload["sequences"] = [TrainSequence(**s) for s in payload["sequences"]]
    return TeacherCache(**payload)


def dense_teacher_logits(
    topk_ids: torch.Tensor, topk_logits: torch.Tensor, vocab_to_draft: torch.Tensor, num_draft: int
) -> torch.Tensor:
    """Spread top-k logits [..., k] over the drafter's vocabulary: [..., K], -inf where the target's
    top k has no entry (or the id is not a draft id). See the module docstring for the approximation."""
    index = vocab_to_draft[topk_ids.long()]
    index = torch.where(index < 0, num_draft, index)  # dropped ids go to a spill column cut off below
    dense = topk_logits.new_full((*topk_logits.shape[:-1], num_draft + 1), float("-inf"))
    return dense.scatter(-1, index, topk_logits)[..., :num_draft]
