"""The schema of the target and drafter config groups (conf/target/, conf/drafter/)."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.core.config import require

SMOKE_TARGET = "smoke"
"""`target.name` that selects the tiny in-process target (`specdecode.models.smoke`)."""


@dataclass
class TargetConfig:
    """The model being accelerated: an alias, HF hub id, local folder or .gguf file. Where it runs
    and in which dtype is the app's top-level `device` / `dtype` (`Placement`)."""

    name: str = "smollm2-135m-instruct"

    def __post_init__(self) -> None:
        require(bool(self.name), "target.name", self.name, "must name a model")


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
        require(self.kind in DRAFTER_KINDS, "drafter.kind", self.kind, "|".join(DRAFTER_KINDS))
        if self.kind in ("derived", "feature"):
            require(isinstance(self.num_layers, int) and self.num_layers >= 1, "drafter.num_layers", self.num_layers, "an int >= 1")
            require(
                self.draft_vocab is None or (isinstance(self.draft_vocab, int) and self.draft_vocab >= 1),
                "drafter.draft_vocab",
                self.draft_vocab,
                "null or an int >= 1",
            )
            # A path here means the user meant to load a drafter; training a derived one instead would be silent.
            require(self.path is None, "drafter.path", self.path,
                    "is set but drafter.kind='derived' (cut from the target, it reads no path); use drafter=pretrained or drop the path")
        else:
            require(bool(self.path), "drafter.path", self.path, "a pretrained drafter needs a path or hub id")
            require(self.draft_vocab is None, "drafter.draft_vocab", self.draft_vocab,
                    f"is set but drafter.kind={self.kind!r} (a pretrained drafter keeps its own head); use null")
