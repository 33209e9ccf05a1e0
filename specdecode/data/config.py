"""The schema of the data config group (conf/data/): which domains, from which source."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdecode.core.config import is_number, require
from specdecode.data.domains import CHAT_TURNS, DOMAINS

# `synthetic`: the smoke experiment's in-process examples (specdecode.data.embedded.synthetic_dataset), no package needed.
TRAIN_DATA_SOURCES = ("embedded", "hf", "file", "synthetic")


@dataclass
class DataConfig:
    """Training prompts and responses: one or several domains (`mix`), mapped onto
    `specdecode.data.domains.load_domain` (source, path, hf_id, hf_split, columns, heldout_fraction, chat_turns)."""

    name: str = "code"
    domains: list[str] = field(default_factory=lambda: ["code"])
    source: str = "embedded"
    path: str | None = None
    hf_id: str | None = None
    hf_split: str = "train"
    prompt_column: str = "prompt"
    response_column: str | None = None
    heldout_fraction: float = 0.1
    # all: the embedded chat data's training prompts go on with its conversations' later user turns
    # (3.2x the prompts; `load_domain`'s chat_turns), for jobs that run out of chat data.
    chat_turns: str = "opening"

    def __post_init__(self) -> None:

        require(bool(self.name), "data.name", self.name, "must name the data (it names the teacher cache)")
        require(
            isinstance(self.domains, (list, tuple)) and bool(self.domains) and all(d in DOMAINS for d in self.domains),
            "data.domains", self.domains, f"a non-empty list of {'|'.join(DOMAINS)}",
        )
        require(self.source in TRAIN_DATA_SOURCES, "data.source", self.source, "|".join(TRAIN_DATA_SOURCES))
        if self.source == "file":
            require(bool(self.path), "data.path", self.path, "source 'file' needs a path to a .jsonl, .csv or .parquet file")
            require(Path(str(self.path)).expanduser().is_file(), "data.path", self.path, "does not exist")
        if self.source == "hf":
            require(bool(self.hf_id), "data.hf_id", self.hf_id, "source 'hf' needs a dataset id")
        require(self.chat_turns in CHAT_TURNS, "data.chat_turns", self.chat_turns, "|".join(CHAT_TURNS))
        require(is_number(self.heldout_fraction) and 0 < self.heldout_fraction < 1, "data.heldout_fraction", self.heldout_fraction, "in (0, 1)")
