"""Fitting the router (router/fit.py): each of its MLPs regresses the labels' train rows,
early-stopped on its own held-out slice of them, and the ensemble is reported on the labels'
held-out rows."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from specdecode.core.atomic import write_atomic
from specdecode.core.devices import resolve_device
from specdecode.core.locking import check_writable
from specdecode.data.registry import domain_examples
from specdecode.routing.config import FitRouterConfig
from specdecode.routing.domain import DomainRouter
from specdecode.routing.embedders import Embedder, make_embedder, prompt_features
from specdecode.routing.labels import read_labels
from specdecode.routing.report import report_markdown, routing_report
from specdecode.routing.router import NO_DRAFTER, Router, RouterMLP, feature_scale, label_matrix


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
    members: int = 5,
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
) -> tuple[Router, list[FitHistory]]:
    """Fit `members` MLPs to `targets`, member e on a train / validation split seeded `seed + e`,
    each keeping its best validation epoch; the router averages their scores.

    Args:
        features: `[N, F]` raw features (`prompt_features`), N >= 2.
        targets: `[N, K]` per-drafter objective (e.g. predicted speedup).
        drafters: the K names, in the targets' column order.
        embedder: what made the features (kept in the router for routing new texts).
        members: E, the MLPs averaged (`RouterModelConfig.members`); member 0 is the single fit of
            the same seed, so `members=1` is one MLP.
        relative: regress `targets - targets.mean(1)` (see `FitRouterConfig.relative`).
        embedder_spec: the embedder's config, saved so `Router.load` can rebuild it.
        The rest are the usual MLP / AdamW / early-stopping knobs.

    Returns:
        The router (in eval mode) and each member's fit history.
    """
    if features.dim() != 2 or targets.dim() != 2 or features.shape[0] != targets.shape[0]:
        raise ValueError(
            f"features {tuple(features.shape)} and targets {tuple(targets.shape)} must be [N, F] and [N, K]"
        )
    if targets.shape[1] != len(drafters):
        raise ValueError(
            f"targets have {targets.shape[1]} columns but {len(drafters)} drafters were named: {list(drafters)}"
        )
    if features.shape[0] < 2:
        raise ValueError(f"need at least 2 labelled prompts to fit a router, got {features.shape[0]}")
    if members < 1:
        raise ValueError(f"members={members}: a router needs at least one MLP")
    features, targets = features.float(), targets.float()
    if relative:
        targets = targets - targets.mean(dim=1, keepdim=True)
    mlps, stats, histories = [], [], []
    for member_seed in range(seed, seed + members):
        generator = torch.Generator().manual_seed(member_seed)
        order = torch.randperm(features.shape[0], generator=generator)
        num_val = min(max(1, round(val_fraction * features.shape[0])), features.shape[0] - 1)
        val, train = order[:num_val], order[num_val:]

        # Statistics from the member's training rows only, so its validation measures
        # generalisation honestly; the target floor keeps constant columns (a drafter whose label
        # never varies) finite.
        feature_mean, feature_std = features[train].mean(0), feature_scale(features[train].std(0, unbiased=False))
        target_mean, target_std = targets[train].mean(0), targets[train].std(0, unbiased=False).clamp_min(1e-6)
        x = (features - feature_mean) / feature_std
        y = (targets - target_mean) / target_std

        history = FitHistory(val_rows=val.tolist())
        mlps.append(
            _train_mlp(
                x,
                y,
                train,
                val,
                generator,
                history,
                hidden=hidden,
                dropout=dropout,
                epochs=epochs,
                batch_size=batch_size,
                lr=lr,
                weight_decay=weight_decay,
                patience=patience,
                seed=member_seed,
            )
        )
        stats.append((feature_mean, feature_std, target_mean, target_std))
        histories.append(history)
    feature_mean, feature_std, target_mean, target_std = (torch.stack(column) for column in zip(*stats))
    router = Router(
        nn.ModuleList(mlps).eval(),
        embedder,
        list(drafters),
        feature_mean,
        feature_std,
        target_mean,
        target_std,
        prompt_length=prompt_length,
        objective=objective,
        relative=relative,
        embedder_spec=embedder_spec,
        hidden=hidden,
        dropout=dropout,
    )
    return router, histories


def _train_mlp(
    x: torch.Tensor,
    y: torch.Tensor,
    train: torch.Tensor,
    val: torch.Tensor,
    generator: torch.Generator,
    history: FitHistory,
    *,
    hidden: int,
    dropout: float,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    patience: int,
    seed: int,
) -> RouterMLP:
    """Fit an MLP from standardised `x` `[N, F]` to `y` `[N, K]` on rows `train`, one shuffled
    epoch (drawn from `generator`) at a time; keep the epoch with the lowest MSE on rows `val`, and
    stop `patience` epochs after it. Appends to `history`; returns the MLP in eval mode."""
    # fork_rng: seeding init and dropout must not reseed the caller's global generator.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = RouterMLP(x.shape[1], y.shape[1], hidden, dropout)
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
    return mlp.eval()


def _fit_mlp(
    cfg: FitRouterConfig,
    features: torch.Tensor,
    targets: torch.Tensor,
    drafters: list[str],
    embedder: Embedder,
    bar: Any,
) -> tuple[Router, list[FitHistory]]:
    """`fit_router` with `cfg`'s knobs; `bar` advances once the features are in."""
    bar.update(1)
    return fit_router(
        features,
        targets,
        drafters,
        embedder,
        prompt_length=cfg.router.prompt_length,
        hidden=cfg.router.hidden,
        dropout=cfg.router.dropout,
        members=cfg.router.members,
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        val_fraction=cfg.val_fraction,
        patience=cfg.patience,
        seed=cfg.seed,
        relative=cfg.relative,
        objective=cfg.objective,
        embedder_spec=asdict(cfg.router.embedder),
    )


def _domain_prompts(train_rows: list[dict[str, Any]], meta: dict[str, Any], per_domain: int) -> dict[str, str]:
    """Prompt → domain for the domain classifier: the labels' train prompts, then the first
    `per_domain` training prompts of each labelled domain from the source the labels were collected
    on (labels.meta.json's config holds each domain's data config; the same split, so held-out
    prompts stay unseen)."""
    tagged = {r["prompt"]: r["domain"] for r in train_rows}
    collected = meta.get("config", {})
    for domain in sorted({r["domain"] for r in train_rows}):
        data = collected.get("data", {}).get(domain)
        if per_domain and data is None:
            raise ValueError(
                f"the labels' config (labels.meta.json) holds no data config for domain {domain!r}: "
                "collect the labels again with router/collect.py"
            )
        examples = domain_examples(data, "train", per_domain) if per_domain else []
        tagged |= {ex.prompt: domain for ex in examples if ex.prompt not in tagged}
    return tagged


def run_fit(cfg: FitRouterConfig, *, progress: bool = True) -> dict[str, Any]:
    """Fit a router on `cfg.labels`, save it to `cfg.output_dir`, and report on the held-out rows.

    Writes `router.safetensors`, `router.json`, `report.json` and `report.md`; prints the report.
    """
    check_writable(Path(cfg.output_dir))
    rows, meta = read_labels(cfg.labels)
    train_rows = [r for r in rows if r["split"] == "train"]
    heldout_rows = [r for r in rows if r["split"] == "heldout"]
    if len(train_rows) < 2 or not heldout_rows:
        raise ValueError(
            f"labels={cfg.labels!r} has {len(train_rows)} train and {len(heldout_rows)} held-out rows; "
            "need >= 2 and >= 1 (collect with splits [train, heldout])"
        )
    missing = [i for i, r in enumerate(rows, start=1) if cfg.objective not in r]
    if missing:
        raise ValueError(
            f"objective={cfg.objective!r}: labels={cfg.labels!r} line {missing[0]} has no such label "
            f"(decode_* labels are greedy only: collect with temperature 0, or fit another objective)"
        )
    drafters = list(meta["drafters"]) + ([NO_DRAFTER] if cfg.no_drafter else [])
    bar = tqdm(total=4, desc="fit router", unit="stage", disable=not progress)
    embedder = make_embedder(cfg.router.embedder, str(resolve_device(cfg.device)))
    bar.update(1)
    texts, targets = [r["prompt"] for r in train_rows], label_matrix(train_rows, cfg.objective, drafters)
    if cfg.router.kind == "domain":
        tagged = _domain_prompts(train_rows, meta, cfg.router.domain_prompts)
        bar.update(1)
        router: Router | DomainRouter = DomainRouter.fit(
            embedder.encode(list(tagged)),
            list(tagged.values()),
            targets,
            [r["domain"] for r in train_rows],
            drafters,
            embedder,
            l2=cfg.router.domain_l2,
            objective=cfg.objective,
            embedder_spec=asdict(cfg.router.embedder),
        )
        histories: list[FitHistory] = []
        classified = len(tagged)
    else:
        classified = 0
        router, histories = _fit_mlp(
            cfg,
            prompt_features(embedder, texts, prompt_length=cfg.router.prompt_length),
            targets,
            drafters,
            embedder,
            bar,
        )
    output = Path(cfg.output_dir)
    router.save(output)
    bar.update(1)
    report = routing_report(router, heldout_rows, latency_repeats=cfg.latency_repeats)  # type: ignore[arg-type]
    report["fit"] = {
        "train_prompts": len(train_rows),
        "kind": cfg.router.kind,
        "classifier_prompts": classified,
        "members": len(histories),
        "val_prompts": [len(h.val_rows) for h in histories],
        "best_epoch": [h.best_epoch for h in histories],
        "epochs_run": [len(h.val_loss) for h in histories],
        "best_val_mse": [h.val_loss[h.best_epoch] for h in histories],
    }
    # (labels collected before per-drafter gammas hold one `gamma` and `verify_ratio`)
    report["labels"] = {
        "path": str(cfg.labels),
        "gammas": meta.get("gammas", meta.get("gamma")),
        "cost_ratios": meta["cost_ratios"],
        "verify_ratios": meta.get("verify_ratios", meta.get("verify_ratio")),
        "temperature": meta["temperature"],
    }
    report["config"] = asdict(cfg)
    bar.update(1)
    bar.close()
    write_atomic(output / "report.json", json.dumps(report, indent=2))
    markdown = report_markdown(report)
    write_atomic(output / "report.md", markdown)
    print(markdown)
    return report
