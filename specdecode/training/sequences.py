"""Training sequences: a prompt (chat-formatted) and a response, the dataset's own or the target's
continuation (sequence-level distillation), and how domains are mixed: a mix (`data=mix`) is each
domain's share of its first `limit` interleaved sequences (`round_robin_shares`), so it reads the
stores its domains' jobs wrote.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.data.config import DataConfig
from specdecode.data.domains import format_prompt
from specdecode.data.example import Example
from specdecode.data.registry import domain_examples
from specdecode.decoding.compiled import resolve_compile
from specdecode.decoding.decode import autoregressive_generate
from specdecode.decoding.static_buffers import release_static_buffers
from specdecode.decoding.static_cache import rows_capacity
from specdecode.training.config import TrainConfig

# The tokens from which a data writer compiles (`compile` auto): on a GPU at batch 256 a compiled
# writer is ~7x faster but first compiles for ~40 s, paid back from about 300k tokens.
WRITER_COMPILE_MIN_TOKENS = 300_000

T = TypeVar("T")


@dataclass
class TrainSequence:
    """Token ids `tokens` [L]; the response starts at `response_start` (>= 1), so the loss
    positions are t = response_start - 1 .. L - 2 (each predicts token t + 1): L - response_start."""

    tokens: list[int]
    response_start: int

    @property
    def num_targets(self) -> int:
        return len(self.tokens) - self.response_start


def load_examples(data: DataConfig, split: str) -> list[Example]:
    """The split's examples of every domain of `data`, interleaved, in a deterministic order."""
    return round_robin([domain_examples(part, split) for part in data.parts()])  # type: ignore[arg-type]  # each part is a resolved DataConfig


def round_robin(parts: Sequence[Sequence[T]]) -> list[T]:
    """One item of each part in turn (a part that runs out is skipped): how domains are mixed."""
    longest = max((len(part) for part in parts), default=0)
    return [part[i] for i in range(longest) for part in parts if i < len(part)]


def round_robin_shares(sizes: Sequence[int], limit: int | None) -> list[int]:
    """How many items of each part the first `limit` items of `round_robin` take (None: all)."""
    shares = [0] * len(sizes)
    remaining = sum(sizes) if limit is None else min(limit, sum(sizes))
    while remaining:
        for d, size in enumerate(sizes):
            if remaining and shares[d] < size:
                shares[d] += 1
                remaining -= 1
    return shares


def domain_parts(data: DataConfig) -> list[DataConfig]:
    """A mix's domains, each as the config its own drafter trains with (a mix reads their stores)."""
    return data.parts()


def training_pool(examples: Sequence[Example], train: TrainConfig) -> list[Example]:
    """The examples a training sequence can be made of (with `seq_source: data`, those with a response)."""
    return [ex for ex in examples if train.seq_source == "target" or ex.response]


def pool_size(data: DataConfig, train: TrainConfig, split: str) -> int:
    """How many sequences `data`'s split can give at most; a ValueError where `seq_source: data`
    and no example has a response."""
    examples = load_examples(data, split)
    pool = training_pool(examples, train)
    if examples and not pool:
        raise ValueError(
            f"{data_key(data)}: no usable {split} sequences: none of its {len(examples)} examples has a response, and "
            "train.seq_source=data trains on the data's responses: set data.response_column (a messages prompt "
            "gives one where an assistant turn follows its last user turn), or train.seq_source=target"
        )
    return len(pool)


def data_key(data: DataConfig) -> str:
    """The config key that names `data` in an error: its file, else its name."""
    return f"data.path={data.path!r}" if data.source == "file" else f"data.name={data.name!r}"


def domain_limit(train: TrainConfig, domain: str, split: str, limit: int | None) -> int | None:
    """The limit of one domain's `split`: `train.train_sequences_per_domain`'s where set, else `limit`."""
    own = train.train_sequences_per_domain.get(domain) if split == "train" else None
    return limit if own is None else own


def domain_size(data: DataConfig, train: TrainConfig, split: str, limit: int | None) -> int:
    """The sequences one domain's `split` takes under `limit` (None: all; `domain_limit`): its store's key."""
    own, pool = domain_limit(train, data.name, split, limit), pool_size(data, train, split)
    return pool if own is None else min(own, pool)


def mix_shares(data: DataConfig, train: TrainConfig, split: str, limit: int | None) -> list[int]:
    """Each domain's share (in `domain_parts` order) of a mix's first `limit` interleaved sequences."""
    return round_robin_shares([domain_size(part, train, split, None) for part in domain_parts(data)], limit)


def mix_limit(data: DataConfig, train: TrainConfig, split: str, per_domain: int | None) -> int:
    """The mix `limit` whose shares are each domain's `domain_size` in jobs with
    `train_sequences = per_domain`: a mix job then reads exactly the stores those jobs wrote."""
    return sum(domain_size(part, train, split, per_domain) for part in domain_parts(data))


def decoding_prompts(data: DataConfig, tokenizer: PreTrainedTokenizerBase, count: int) -> list[list[int]]:
    """The first `count` held-out prompts of `data`, chat-formatted and whole (prompt lookup copies
    from them), as the gamma choice decodes them (`choose_gamma`)."""
    return [format_prompt(tokenizer, ex) for ex in load_examples(data, "heldout")[:count]]


def build_sequences(
    examples: Sequence[Example],
    tokenizer: PreTrainedTokenizerBase,
    target: PreTrainedModel,
    train: TrainConfig,
    eos: Sequence[int],
    limit: int | None,
    feature_layers: Sequence[int] | None = None,
    compile: bool | None = False,
    first: int = 0,
    capacity: int | None = None,
) -> tuple[list[TrainSequence], list[torch.Tensor] | None]:
    """Prompt (chat-formatted, left-truncated to `max_prompt_tokens`) + response, cut at `max_len`:
    the example's own (`seq_source: data`) or the target's continuation at each temperature. With
    `feature_layers`, also each sequence's target features `[L_i, n·H]` (fp16, CPU, zero where a token
    was never fed). `compile`: by the compiled static core (None: `writer_compiles`); `first`:
    `examples[0]`'s index in the job (offsets a shard's seeds); `capacity`: shared by every shard.
    """
    if feature_layers is not None and train.seq_source != "target":
        raise ValueError(
            f"train.seq_source={train.seq_source!r}: only the target's own continuations come with its "
            "features (score the dataset's responses with a forward instead)"
        )
    pool = training_pool(examples, train)
    pool = pool if limit is None else pool[:limit]
    prompts = [format_prompt(tokenizer, ex)[-train.max_prompt_tokens :] for ex in pool]
    features: list[torch.Tensor] | None = None
    if train.seq_source == "data":
        stop = [eos[0]] if eos else []
        responses = [tokenizer(ex.response, add_special_tokens=False)["input_ids"] + stop for ex in pool]
    else:
        # one continuation per prompt and temperature: more data, around the target's own distribution
        temperatures = train.seq_temperatures or [train.temperature]
        if compile is None:
            budgets = sum(_budget(train, p) for p in prompts) * len(temperatures)
            compile = writer_compiles(target.device, budgets)
        responses, features = generate_continuations(
            target,
            prompts,
            train,
            eos,
            seed=train.seed + first,
            batch_size=train.generation_batch,
            temperature=temperatures,
            feature_layers=feature_layers,
            compile=compile,
            capacity=capacity,
        )
        prompts = prompts * len(temperatures)
    sequences, kept = [], []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        tokens = (prompt + list(response))[: train.max_len]
        if len(tokens) > len(prompt):
            sequences.append(TrainSequence(tokens=tokens, response_start=len(prompt)))
            kept.append(i)
    if features is not None:
        features = [features[i][: len(s.tokens)] for i, s in zip(kept, sequences)]
    return sequences, features


def _budget(train: TrainConfig, prompt: Sequence[int]) -> int:
    """The tokens the writer continues `prompt` by: up to `max_new_tokens`, within `max_len`."""
    return min(train.max_new_tokens, train.max_len - len(prompt))


def writer_plan(
    prompts: Iterable[Sequence[int]], train: TrainConfig, device: torch.device, compile: bool | None
) -> tuple[bool, int | None]:
    """Whether a sharded writer of all the job's `prompts` compiles (`compile`, None:
    `writer_compiles`) and, if so past one batch, the cache capacity its batches share (one shape)."""
    if compile is False or (compile is None and not resolve_compile(None, device)):
        return False, None
    count, slots, tokens = 0, 0, 0
    for prompt in prompts:
        budget = _budget(train, prompt)
        count, slots, tokens = count + 1, max(slots, len(prompt) + budget), tokens + budget
    temperatures = len(train.seq_temperatures or [train.temperature])
    if compile is None and not writer_compiles(device, tokens * temperatures):
        return False, None
    return True, (rows_capacity([[0] * slots], [0], None) if count > train.generation_batch else None)


def writer_compiles(device: torch.device, tokens: int) -> bool:
    """Whether a data writer of `tokens` tokens compiles with `compile` auto: on by default for
    `device`, and enough tokens to pay it back."""
    return resolve_compile(None, device) and tokens >= WRITER_COMPILE_MIN_TOKENS


def generate_continuations(
    model: PreTrainedModel,
    prompts: Sequence[list[int]],
    train: TrainConfig,
    eos: Sequence[int],
    seed: int,
    batch_size: int = 64,
    temperature: float | Sequence[float] | None = None,
    feature_layers: Sequence[int] | None = None,
    compile: bool = False,
    capacity: int | None = None,
) -> tuple[list[list[int]], list[torch.Tensor] | None]:
    """`model`'s continuations of `prompts` (batched, ragged), at most `max_new_tokens` each, at
    `temperature` (default `train.temperature`), and with `feature_layers` each sequence's features
    `[L_i, n·H]` fp16 on the CPU (else None). Compiled, every batch is filled up to `batch_size`.
    A list of n temperatures: one continuation of each prompt at each, temperature-major (output
    j * len(prompts) + i is prompt i's at the j-th); eager, a prompt's n share one prefill and a
    batch holds `max(1, batch_size // n)` prompts; compiled, one call per temperature."""
    asked = list(temperature) if isinstance(temperature, Sequence) else [temperature]
    if not asked:
        raise ValueError("temperature must be a temperature or a non-empty list of them, got []")
    temperatures = [train.temperature if t is None else t for t in asked]
    if compile and len(temperatures) > 1:  # the static decoders draw one way per call: a call each
        parts = [
            generate_continuations(
                model, prompts, train, eos, seed + 1000 * j, batch_size, t, feature_layers, compile, capacity
            )
            for j, t in enumerate(temperatures)
        ]
        features = None if feature_layers is None else [f for _, read in parts for f in read or []]
        return [w for written, _ in parts for w in written], features
    was_training = model.training
    model.eval()
    n = len(temperatures)
    fan_out = None if n == 1 else temperatures
    batch_size = batch_size if n == 1 else max(1, batch_size // n)
    # Similar lengths batch together (less padding); the output keeps the prompts' order.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    by_index: dict[tuple[int, int], list[int]] = {}
    features_by_index: dict[tuple[int, int], torch.Tensor] = {}
    bar = tqdm(
        total=len(prompts),
        desc="target continuations" + (" and features" if feature_layers is not None else ""),
        disable=len(prompts) <= batch_size,
        leave=False,
    )
    budget = {i: _budget(train, prompts[i]) for i in order}
    # compiled, every batch has one shape (each compiles for tens of seconds on a GPU)
    fill = compile and (capacity is not None or len(order) > batch_size)
    if compile and order and capacity is None:
        capacity = rows_capacity([prompts[i] for i in order], list(budget.values()), None)
    try:
        for start in range(0, len(order), batch_size):
            picks = order[start : start + batch_size]
            filler = batch_size - len(picks) if fill else 0
            batch = [list(prompts[i]) for i in picks] + [list(prompts[picks[0]])] * filler
            result = autoregressive_generate(
                model,
                batch,
                max_new_tokens=[budget[i] for i in picks] + [0] * filler,
                temperature=temperatures[0] if n == 1 else 0.0,
                temperatures=fan_out,
                eos_token_ids=list(eos) or None,
                seed=seed + start,
                feature_layers=feature_layers,
                static=compile,
                compile=compile,
                capacity=capacity if compile else None,
            )
            keys = [(j, i) for i in picks for j in range(n)]  # the rows' order (fan_out)
            by_index.update(zip(keys, result.sequences))
            if result.features is not None:
                features_by_index.update(zip(keys, (f.half().cpu() for f in result.features)))
            bar.update(len(picks))
    finally:
        # the KV buffers compiled calls keep for the next call of their shape: training wants the memory
        release_static_buffers(model)
    bar.close()
    model.train(was_training)
    keys = [(j, i) for j in range(n) for i in range(len(prompts))]
    return [by_index[k] for k in keys], ([features_by_index[k] for k in keys] if feature_layers is not None else None)
