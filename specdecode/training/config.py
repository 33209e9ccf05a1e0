"""The schema of the drafter-training apps (train/distill.py, train/finetune.py): conf/distill.yaml,
conf/finetune.yaml and the loss/ group."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from specdecode.core.config import (
    MAX_GAMMA,
    TEMPERATURE_RANGE,
    Placement,
    is_gamma,
    is_int,
    is_number,
    is_temperature,
    require,
    require_choice,
    require_finite,
    require_int,
    require_ints,
)
from specdecode.core.devices import MIXED_PRECISIONS
from specdecode.core.tracking import Tracking
from specdecode.data.config import DataConfig
from specdecode.data.corpus import VOCAB_CORPUS_DOCS
from specdecode.data.domains import DOMAIN_NAME, DOMAINS
from specdecode.models.card import is_repo_id
from specdecode.models.config import DrafterConfig, TargetConfig
from specdecode.training.losses import LOSSES

TRAIN_SEQ_SOURCES = ("data", "target")
TEACHER_MODES = ("online", "offline", "auto")
LR_DECAYS = ("constant", "linear", "cosine")


@dataclass
class LossConfig:
    """Token-level distillation loss (specdecode.training.losses); `beta` is JSD's mixture weight."""

    name: str = "forward_kl"
    beta: float = 0.5

    def __post_init__(self) -> None:
        require(self.name in LOSSES, "loss.name", self.name, f"unknown; valid: {', '.join(sorted(LOSSES))}")
        require(is_number(self.beta) and 0 < self.beta < 1, "loss.beta", self.beta, "in (0, 1)")


@dataclass
class TrainConfig:
    """The training loop, sequence source and teacher cache (see specdecode.training.job)."""

    # Responses: the dataset's ("data") or the target's continuations ("target"); the drafter's with
    # probability lambda_on_policy per step (GKD).
    seq_source: str = "target"
    lambda_on_policy: float = 0.0
    # Distillation temperature; match decoding's (0 = greedy, distilled at 1 like the losses do).
    temperature: float = 1.0
    # seq_source=target: one continuation per prompt at each of these temperatures (null = [temperature]).
    seq_temperatures: list[float] | None = field(default_factory=lambda: [0.0, 0.7])
    # Model selection: held-out acceptance at the decoding temperature (0: greedy agreement; T: Σ min(p_T, q_T)).
    select_temperature: float = 0.0
    # Stop after this many evaluations without a new best held-out acceptance (null = never).
    early_stop_evals: int | None = None
    # Feature drafters: drafting steps unrolled in training (EAGLE-3's training-time test), and the
    # weight of the feature regression beside the token loss (null: 1, or 0 for an eagle3 drafter).
    unroll_steps: int = 2
    feature_loss_weight: float | None = None
    # Feature drafters: EAGLE's uniform noise U(-a, a) on the target features read in training; 0 = none.
    feature_noise: float = 0.0
    # After training: the fastest of these gammas on gamma_prompts held-out prompts, timed
    # (`choose_gamma`), is stored with the drafter ([] = none; gamma_prompts 0: Leviathan's model).
    gamma_candidates: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8])
    gamma_prompts: int = 8
    gamma_new_tokens: int = 64
    max_prompt_tokens: int = 96
    max_len: int = 192
    max_new_tokens: int = 96
    # Rows per pass when the target writes continuations (of generation_batch // n prompts at n temperatures).
    generation_batch: int = 64
    # The target's top-k logits kept per position (specdecode.training.teacher).
    teacher_topk: int = 64
    # The target's outputs: offline = written once to the teacher store; online = its forward in each
    # step; auto = online on a GPU, offline elsewhere (a CPU forward costs more than the drafter's step).
    teacher: str = "auto"
    # Online: the target's decoder layers sharded over the processes (FSDP2), for a target that does
    # not fit one device; trains on the data's responses (seq_source=data) and chooses no gamma.
    shard_target: bool = False
    train_sequences: int | None = 512
    # Per domain, in place of train_sequences where not null (a mix takes at most that many of it).
    train_sequences_per_domain: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(DOMAINS))
    heldout_sequences: int = 32
    # Global batch (sequences per optimizer step, over all processes and accumulation steps).
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    # Linear warm-up, then constant | linear | cosine decay over the budget (max_steps or max_minutes).
    warmup_steps: int = 10
    lr_decay: str = "constant"
    max_grad_norm: float = 1.0
    # The drafter's autocast: auto = bf16 where the device computes it natively, else no; or no | bf16 | fp16.
    mixed_precision: str = "auto"
    # The precision the target writes and scores the training split in (as mixed_precision); the
    # held-out split stays in the job's dtype.
    data_precision: str = "auto"
    max_steps: int = 1000
    max_minutes: float | None = None
    eval_every: int = 50
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    resume: bool = False
    freeze_embeddings: bool = True
    # null: frozen, but trained for an eagle3 drafter (its own head, as EAGLE-3 trains it)
    freeze_head: bool | None = None
    log_every: int = 10
    seed: int = 0
    # Training documents tokenised to pick a derived drafter's truncated vocabulary.
    vocab_corpus_docs: int = VOCAB_CORPUS_DOCS

    def __post_init__(self) -> None:
        self._check_sequences()
        self._check_sizes()
        self._check_optimizer()

    def _check_sequences(self) -> None:
        """The training data's and the decoding settings' fields."""
        require_choice("train.seq_source", self.seq_source, TRAIN_SEQ_SOURCES)
        require(
            is_number(self.lambda_on_policy) and 0 <= self.lambda_on_policy <= 1,
            "train.lambda_on_policy",
            self.lambda_on_policy,
            "must be in [0, 1]",
        )
        require(is_temperature(self.temperature), "train.temperature", self.temperature, TEMPERATURE_RANGE)
        require_choice("train.teacher", self.teacher, TEACHER_MODES)
        require(
            self.seq_temperatures is None
            or (
                isinstance(self.seq_temperatures, (list, tuple))
                and bool(self.seq_temperatures)
                and all(is_temperature(t) for t in self.seq_temperatures)
            ),
            "train.seq_temperatures",
            self.seq_temperatures,
            f"null or a non-empty list of temperatures, each {TEMPERATURE_RANGE}",
        )
        if self.seq_temperatures is not None:
            self.seq_temperatures = [float(t) for t in self.seq_temperatures]
        selected = self.select_temperature
        require(is_temperature(selected), "train.select_temperature", selected, TEMPERATURE_RANGE)
        require_int("train.early_stop_evals", self.early_stop_evals, 1, nullable=True)
        require_int("train.unroll_steps", self.unroll_steps, 1, 8)
        if self.feature_loss_weight is not None:
            require_finite("train.feature_loss_weight", self.feature_loss_weight, 0, note=", or null")
        require_finite("train.feature_noise", self.feature_noise, 0)
        require(
            isinstance(self.gamma_candidates, (list, tuple)) and all(is_gamma(g) for g in self.gamma_candidates),
            "train.gamma_candidates",
            self.gamma_candidates,
            f"a list of ints in [1, {MAX_GAMMA}] (empty: keep the default gamma)",
        )
        self.gamma_candidates = list(self.gamma_candidates)
        require_int("train.gamma_prompts", self.gamma_prompts, 0, note=" (0 = Leviathan's model)")
        require_int("train.gamma_new_tokens", self.gamma_new_tokens, 2, note=" (a verify after the prefill)")
        self._check_shard_target()

    def _check_shard_target(self) -> None:
        """A sharded target runs only forwards every process makes together (`specdecode.training.sharding`)."""
        require(isinstance(self.shard_target, bool), "train.shard_target", self.shard_target, "true or false")
        if not self.shard_target:
            return
        require(
            self.teacher != "offline",
            "train.teacher",
            self.teacher,
            "online (or auto on a GPU) with train.shard_target",
        )
        require(
            self.seq_source == "data",
            "train.seq_source",
            self.seq_source,
            "data with train.shard_target (write the target's continuations with your serving engine and "
            "train on them as data)",
        )
        gamma_note = "[] with train.shard_target (choosing a gamma times decodes on one process)"
        require(not self.gamma_candidates, "train.gamma_candidates", self.gamma_candidates, gamma_note)
        require(not self.lambda_on_policy, "train.lambda_on_policy", self.lambda_on_policy, "0 with train.shard_target")

    def _check_sizes(self) -> None:
        """Lengths, batch sizes, sequence counts and intervals."""
        sizes = "max_prompt_tokens max_len max_new_tokens generation_batch teacher_topk heldout_sequences"
        require_ints(self, f"{sizes} batch_size grad_accum eval_every checkpoint_every log_every", prefix="train.")
        require_int("train.vocab_corpus_docs", self.vocab_corpus_docs, 1)
        require(
            is_int(self.keep_checkpoints) and self.keep_checkpoints >= 2,
            "train.keep_checkpoints",
            self.keep_checkpoints,
            "at least 2 (accelerate deletes the oldest checkpoint before writing the next, "
            "so with 1 a kill during a save would leave none)",
        )
        require(
            self.max_prompt_tokens < self.max_len,
            "train.max_prompt_tokens",
            self.max_prompt_tokens,
            f"< train.max_len={self.max_len}",
        )
        require(
            self.batch_size % self.grad_accum == 0,
            "train.batch_size",
            self.batch_size,
            f"a multiple of train.grad_accum={self.grad_accum}",
        )
        require_int("train.train_sequences", self.train_sequences, 1, nullable=True)
        per_domain = self.train_sequences_per_domain
        require(
            isinstance(per_domain, Mapping)
            and all(
                isinstance(d, str) and DOMAIN_NAME.fullmatch(d) and (n is None or (is_int(n) and n >= 1))
                for d, n in per_domain.items()
            ),
            "train.train_sequences_per_domain",
            per_domain,
            "a mapping of domain names to null or an int >= 1",
        )
        self.train_sequences_per_domain = dict(per_domain)

    def _check_optimizer(self) -> None:
        """The budget, the optimizer and the precision."""
        require_int("train.max_steps", self.max_steps, 0)
        if self.max_minutes is not None:
            require_finite("train.max_minutes", self.max_minutes, 0, strict=True, note=", or null")
        require_finite("train.lr", self.lr, 0, strict=True)
        require_finite("train.weight_decay", self.weight_decay, 0, note=" (0 = none)")
        require_finite(
            "train.max_grad_norm",
            self.max_grad_norm,
            0,
            strict=True,
            note=" (the gradient norm clipped to; a large value clips nothing)",
        )
        require(is_int(self.seed) and 0 <= self.seed < 2**32, "train.seed", self.seed, "an int in [0, 2**32)")
        require_choice("train.mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        require_choice("train.data_precision", self.data_precision, MIXED_PRECISIONS)
        require_choice("train.lr_decay", self.lr_decay, LR_DECAYS)
        require_int("train.warmup_steps", self.warmup_steps, 0)


@dataclass
class TrainJobConfig(Placement, Tracking):
    """train/distill.py and train/finetune.py. `target.name: smoke` is the tiny in-process target;
    `logger=wandb` also logs the metrics to a wandb run (`specdecode.core.tracking`)."""

    # The job's name ("distill", "finetune"): names output folders in conf/, nothing else.
    name: str = "distill"
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output_dir: str = "outputs/distill"
    # Where teacher caches live, shared by the jobs that train on the same sequences;
    # null = <output_dir>/../teacher_cache.
    cache_dir: str | None = "outputs/teacher_cache"
    # A hub repo id (owner/name) to upload drafter/ (model card included) to when training ends; null: no upload.
    push_to_hub: str | None = None

    def __post_init__(self) -> None:
        self.check_placement()
        require(bool(self.output_dir), "output_dir", self.output_dir, "must name a folder")
        self.check_tracking()
        # A feature drafter's every step reads the target's features: no drafter-only (on-policy) generation.
        require(
            not (self.drafter.kind in ("feature", "eagle3") and self.train.lambda_on_policy > 0),
            "train.lambda_on_policy",
            self.train.lambda_on_policy,
            f"must be 0 with drafter.kind={self.drafter.kind!r} (it cannot generate without the target)",
        )
        require(
            not (self.drafter.kind == "eagle3" and self.train.feature_loss_weight),
            "train.feature_loss_weight",
            self.train.feature_loss_weight,
            "must be null or 0 with drafter.kind='eagle3' (its outputs are its own states, not the target's features)",
        )
        ok = self.push_to_hub is None or is_repo_id(self.push_to_hub)
        require(ok, "push_to_hub", self.push_to_hub, "null or a hub repo id owner/name")
