"""Adaptive routing (router/collect.py, router/fit.py): per-prompt drafter labels by teacher
forcing, sentence embedders, the router (an MLP naming a prompt's domain), its fit and report, and
routed generation."""

from specdecode.routing.collect import run_collect
from specdecode.routing.config import CollectConfig, EmbedderConfig, FitRouterConfig, RouterModelConfig
from specdecode.routing.embedders import HashingEmbedder, SentenceTransformerEmbedder, embed, make_embedder
from specdecode.routing.fit import fit_router, run_fit
from specdecode.routing.generate import RoutedGeneration, route_and_generate
from specdecode.routing.labels import Labels, collect_labels, read_labels, teacher_forced_acceptance
from specdecode.routing.router import NO_DRAFTER, Router, label_matrix

__all__ = [
    "NO_DRAFTER",
    "CollectConfig",
    "EmbedderConfig",
    "FitRouterConfig",
    "HashingEmbedder",
    "Labels",
    "RoutedGeneration",
    "Router",
    "RouterModelConfig",
    "SentenceTransformerEmbedder",
    "collect_labels",
    "embed",
    "fit_router",
    "label_matrix",
    "make_embedder",
    "read_labels",
    "route_and_generate",
    "run_collect",
    "run_fit",
    "teacher_forced_acceptance",
]
