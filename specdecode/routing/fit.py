"""Fitting the router (router/fit.py): its MLP learns domains from the labels' train prompts and
more of each domain's; its table is each domain's mean predicted speedup per drafter; its far-prompt
threshold is fitted on prompts it never learnt from; it is reported on the labels' held-out rows."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdecode.core.atomic import write_atomic
from specdecode.core.devices import resolve_device
from specdecode.core.locking import check_writable
from specdecode.data.registry import domain_examples
from specdecode.routing.config import FitRouterConfig
from specdecode.routing.embedders import Embedder, embed, make_embedder
from specdecode.routing.labels import read_labels
from specdecode.routing.novelty import fallback_route, fit_novelty
from specdecode.routing.report import report_markdown, routing_report
from specdecode.routing.router import NO_DRAFTER, OBJECTIVE, Router, RouterMLP, feature_scale, label_matrix


def fit_router(
    features: torch.Tensor,
    domains: Sequence[str],
    labels: torch.Tensor,
    label_domains: Sequence[str],
    drafters: Sequence[str],
    embedder: Embedder,
    *,
    hidden: int = 256,
    dropout: float = 0.1,
    epochs: int = 200,
    lr: float = 1e-3,
    weight_decay: float = 1e-2,
    seed: int = 0,
    embedder_spec: dict[str, Any] | None = None,
) -> Router:
    """The router whose MLP learns the `domains` of M prompts from their `features` `[M, F]` and whose
    table averages the `labels` `[N, K]` (objective per drafter) by `label_domains`. A ValueError
    for mismatched shapes, a domain without labels, or fewer than 2 labelled domains.
    """
    if features.dim() != 2 or features.shape[0] != len(domains) or features.shape[0] < 1:
        raise ValueError(f"need [M, F] features and M domains, got {tuple(features.shape)} and {len(domains)}")
    if labels.dim() != 2 or labels.shape[0] != len(label_domains) or labels.shape[1] != len(drafters):
        raise ValueError(
            f"need [N, K] labels, N label domains and K drafters, got {tuple(labels.shape)}, "
            f"{len(label_domains)} and {len(drafters)}: {list(drafters)}"
        )
    names = sorted(set(label_domains))
    unknown = sorted(set(domains) - set(names))
    if unknown:
        raise ValueError(f"prompts of domains {unknown} have no labels to route them by (labelled: {names})")
    if len(names) < 2:
        raise ValueError(f"need labels of at least 2 domains to route between, got {names}")
    table = torch.stack([labels[torch.tensor([d == name for d in label_domains])].float().mean(0) for name in names])
    features = features.float()
    feature_mean, feature_std = features.mean(0), feature_scale(features.std(0, unbiased=False))
    x, classes = (features - feature_mean) / feature_std, torch.tensor([names.index(d) for d in domains])
    # `epochs` full-batch AdamW steps, a function of `seed` alone (the caller's generator is left as it was)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = RouterMLP(x.shape[1], len(names), hidden, dropout)
        optimizer = torch.optim.AdamW(mlp.parameters(), lr=lr, weight_decay=weight_decay)
        mlp.train()
        for _ in range(epochs):
            loss = torch.nn.functional.cross_entropy(mlp(x), classes)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return Router(mlp.eval(), embedder, list(drafters), names, feature_mean, feature_std, table, embedder_spec)


def _domain_prompts(
    train_rows: list[dict[str, Any]], meta: dict[str, Any], per_domain: int, novelty: int = 0
) -> tuple[dict[str, str], dict[str, str]]:
    """Prompt → domain for the MLP: the labels' train prompts, then the first `per_domain` training
    prompts of each labelled domain (its data config from labels.meta.json); and for the far-prompt
    threshold, up to `novelty` training prompts after those, which the MLP never sees."""
    tagged = {r["prompt"]: r["domain"] for r in train_rows}
    unseen: dict[str, str] = {}
    collected = meta.get("config", {})
    for domain in sorted({r["domain"] for r in train_rows}):
        data = collected.get("data", {}).get(domain)
        if (per_domain or novelty) and data is None:
            raise ValueError(
                f"the labels' config (labels.meta.json) holds no data config for domain {domain!r}: "
                "collect the labels again with router/collect.py"
            )
        examples = domain_examples(data, "train", per_domain + novelty) if per_domain or novelty else []
        labelled = set(tagged)
        tagged |= {ex.prompt: domain for ex in examples[:per_domain] if ex.prompt not in labelled}
        unseen |= {ex.prompt: domain for ex in examples[per_domain:] if ex.prompt not in labelled}
    return tagged, unseen


def _with_novelty(
    router: Router,
    cfg: FitRouterConfig,
    features: torch.Tensor,
    tagged: dict[str, str],
    unseen: dict[str, str],
    heldout_rows: list[dict[str, Any]],
) -> tuple[Router, dict[str, Any] | None]:
    """`router` with its far-prompt threshold fitted on the `unseen` prompts (a domain without any: on
    its held-out ones), and what the report says of it; unchanged without `cfg.novelty_prompts`."""
    if not cfg.novelty_prompts:
        return router, None
    unseen = dict(unseen)
    for domain in router.domains:
        if domain not in unseen.values():
            heldout = [r["prompt"] for r in heldout_rows if r["domain"] == domain]
            unseen |= dict.fromkeys(heldout[: cfg.novelty_prompts], domain)
    novelty = fit_novelty(
        features,
        list(tagged.values()),
        embed(router.embedder, list(unseen)),
        list(unseen.values()),
        router.domains,
        quantile=cfg.novelty_quantile,
        fallback=cfg.fallback,
    )
    report = {
        "fallback": cfg.fallback,
        "quantile": cfg.novelty_quantile,
        "heldout_prompts": {d: list(unseen.values()).count(d) for d in router.domains},
        "thresholds": dict(zip(router.domains, novelty.thresholds.tolist())),
    }
    return replace(router, novelty=novelty), report


def run_fit(cfg: FitRouterConfig, *, progress: bool = True) -> dict[str, Any]:
    """Fit a router on `cfg.labels`, save it to `cfg.output_dir`, and report on the held-out rows
    (`report.json`, `report.md`, printed)."""
    check_writable(Path(cfg.output_dir))
    rows, meta = read_labels(cfg.labels)
    train_rows = [r for r in rows if r["split"] == "train"]
    heldout_rows = [r for r in rows if r["split"] == "heldout"]
    if len(train_rows) < 2 or not heldout_rows:
        raise ValueError(
            f"labels={cfg.labels!r} has {len(train_rows)} train and {len(heldout_rows)} held-out rows; "
            "need >= 2 and >= 1 (collect with splits [train, heldout])"
        )
    drafters = list(meta["drafters"]) + ([NO_DRAFTER] if cfg.no_drafter else [])
    if cfg.novelty_prompts:
        fallback_route(cfg.fallback, drafters, NO_DRAFTER)  # before any embedding
    bar = tqdm(total=3, desc="fit router", unit="stage", disable=not progress)
    embedder = make_embedder(cfg.router.embedder, str(resolve_device(cfg.device)))
    tagged, unseen = _domain_prompts(train_rows, meta, cfg.router.domain_prompts, cfg.novelty_prompts)
    features = embed(embedder, list(tagged))
    bar.update(1)
    router = fit_router(
        features,
        list(tagged.values()),
        label_matrix(train_rows, OBJECTIVE, drafters),
        [r["domain"] for r in train_rows],
        drafters,
        embedder,
        hidden=cfg.router.hidden,
        dropout=cfg.router.dropout,
        epochs=cfg.epochs,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        seed=cfg.seed,
        embedder_spec=asdict(cfg.router.embedder),
    )
    router, novelty = _with_novelty(router, cfg, features, tagged, unseen, heldout_rows)
    output = Path(cfg.output_dir)
    router.save(output)
    bar.update(1)
    named = [router.domains[i] for i in router.domain_logits(features).argmax(1).tolist()]
    report = routing_report(router, heldout_rows, latency_repeats=cfg.latency_repeats)
    report["fit"] = {
        "train_prompts": len(train_rows),
        "classifier_prompts": len(tagged),
        "domains": router.domains,
        "train_domain_accuracy": sum(n == d for n, d in zip(named, tagged.values())) / len(tagged),
        "novelty": novelty,
    }
    report["labels"] = {"path": str(cfg.labels)} | {
        key: meta[key] for key in ("gammas", "cost_ratios", "verify_ratios", "temperature")
    }
    report["config"] = asdict(cfg)
    bar.update(1)
    bar.close()
    write_atomic(output / "report.json", json.dumps(report, indent=2))
    markdown = report_markdown(report)
    write_atomic(output / "report.md", markdown)
    print(markdown)
    return report
