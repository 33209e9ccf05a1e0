"""Structured configs: the schema behind conf/*.yaml. Each validates itself and names the bad field."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a (Hydra-resolved) dict; unknown keys are an error, not ignored."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown config field(s) {', '.join(where + k for k in unknown)}; known: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        nested = _NESTED.get((cls.__name__, name))
        kwargs[name] = from_dict(nested, value, f"{where}{name}.") if nested and isinstance(value, dict) else value
    return cls(**kwargs)


def _require(condition: bool, name: str, value: object, expectation: str) -> None:
    if not condition:
        raise ValueError(f"{name}={value!r}: {expectation}")


@dataclass
class TargetConfig:
    """The model being accelerated: an alias, HF hub id, local folder or .gguf file."""

    name: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        _require(bool(self.name), "target.name", self.name, "must name a model")
        _require(self.dtype in ("float32", "bfloat16", "float16"), "target.dtype", self.dtype, "float32|bfloat16|float16")


@dataclass
class DrafterConfig:
    """`derived`: cut from the target (first num_layers layers, optional truncated vocab);
    `pretrained`: any HF causal LM with the target's tokenizer, at `path`."""

    kind: str = "derived"
    num_layers: int = 2
    # Size of the truncated LM head (the most frequent tokens of the domain corpora); null = full.
    draft_vocab: int | None = 8192
    path: str | None = None

    def __post_init__(self) -> None:
        _require(self.kind in ("derived", "pretrained"), "drafter.kind", self.kind, "derived|pretrained")
        if self.kind == "derived":
            _require(isinstance(self.num_layers, int) and self.num_layers >= 1, "drafter.num_layers", self.num_layers, "an int >= 1")
            _require(
                self.draft_vocab is None or (isinstance(self.draft_vocab, int) and self.draft_vocab >= 1),
                "drafter.draft_vocab",
                self.draft_vocab,
                "null or an int >= 1",
            )
        else:
            _require(bool(self.path), "drafter.path", self.path, "a pretrained drafter needs a path or hub id")


@dataclass
class BenchmarkConfig:
    """eval/benchmark.py: target alone vs ours vs transformers assisted generation, batch 1 and B."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    gamma: int = 4
    max_new_tokens: int = 128
    # Prompts: the first held-out prompts of each domain, interleaved (code, math, chat, code, ...).
    num_prompts: int = 8
    max_prompt_tokens: int = 256
    batch1_prompts: int = 3
    batch_size: int = 8
    temperature: float = 0.0
    seed: int = 0
    hf_assisted: bool = True
    cost_repeats: int = 10
    # Documents per domain tokenised to pick the drafter's truncated vocabulary.
    vocab_corpus_docs: int = 2000
    output_dir: str = "outputs/benchmark"

    def __post_init__(self) -> None:
        _require(isinstance(self.gamma, int) and self.gamma >= 1, "gamma", self.gamma, "an int >= 1")
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "an int >= 1")
        _require(self.num_prompts >= 1, "num_prompts", self.num_prompts, ">= 1")
        _require(1 <= self.batch1_prompts <= self.num_prompts, "batch1_prompts", self.batch1_prompts, f"in [1, num_prompts={self.num_prompts}]")
        _require(1 <= self.batch_size <= self.num_prompts, "batch_size", self.batch_size, f"in [1, num_prompts={self.num_prompts}]")
        _require(self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _require(self.cost_repeats >= 1, "cost_repeats", self.cost_repeats, ">= 1")


_NESTED: dict[tuple[str, str], type] = {
    ("BenchmarkConfig", "target"): TargetConfig,
    ("BenchmarkConfig", "drafter"): DrafterConfig,
}
