"""The schema of the target and drafter config groups (conf/target/, conf/drafter/)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdecode.core.config import is_int, require, require_choice, require_int

SMOKE_TARGET = "smoke"  # `target.name` of the tiny in-process target (`specdecode.models.smoke`)


# Attention kernels transformers takes as `attn_implementation` (null: the model's default).
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass
class TargetConfig:
    """The model being accelerated: an alias, HF hub id, local folder or .gguf file. Where it runs
    and in which dtype is the app's top-level `device` / `dtype` (`Placement`)."""

    name: str = "smollm2-135m-instruct"
    # A hub id's branch, tag or commit (null: the default branch).
    revision: str | None = None
    # Run the model repo's own Python code (a model transformers does not ship); off unless asked.
    trust_remote_code: bool = False
    # eager | sdpa | flash_attention_2 | flash_attention_3 | flex_attention; null: the model's default.
    attn_implementation: str | None = None
    # auto: spread a target too large for one GPU over the visible GPUs (accelerate's big-model loading).
    device_map: str | None = None

    def __post_init__(self) -> None:
        require(bool(self.name), "target.name", self.name, "must name a model")
        check_hub_options(self.revision, self.trust_remote_code, "target")
        if self.attn_implementation is not None:
            require_choice("target.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        require(
            self.device_map in (None, "auto"),
            "target.device_map",
            self.device_map,
            "null (one device) or auto (over the visible GPUs)",
        )


def check_hub_options(revision: object, trust_remote_code: object, prefix: str) -> None:
    """`revision` is null or a non-empty string and `trust_remote_code` a bool; else a ValueError naming the key."""
    require(
        revision is None or (isinstance(revision, str) and bool(revision)),
        f"{prefix}.revision",
        revision,
        "null or a branch, tag or commit of the hub repo",
    )
    require(isinstance(trust_remote_code, bool), f"{prefix}.trust_remote_code", trust_remote_code, "true or false")


DRAFTER_KINDS = ("derived", "feature", "eagle3", "pretrained")
# the kinds built from the target here (`pretrained` loads a folder)
BUILT_KINDS = ("derived", "feature", "eagle3")
# how a feature drafter runs its body (specdecode.models.feature_drafter)
FEATURE_LAYOUTS = ("specdecode", "eagle")
LAST_FEATURE = (-1,)  # a feature drafter's default `feature_layers`: the last (post-norm) state (EAGLE-1)


def check_feature_layers(
    layers: Sequence[int] | None, num_target_layers: int | None = None, name: str = "feature_layers"
) -> tuple[int, ...]:
    """`layers` as a tuple if they are distinct ints ending with -1 (the last hidden state), the
    others in [1, num_target_layers - 1]; else a ValueError naming them."""
    found = tuple(layers) if isinstance(layers, (list, tuple)) else ()
    inner = found[:-1]
    ok = (
        bool(found)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in found)
        and found[-1] == -1
        and len(set(inner)) == len(inner)
        and all(i >= 1 and (num_target_layers is None or i < num_target_layers) for i in inner)
    )
    if not ok:
        bound = f"{num_target_layers - 1}" if num_target_layers is not None else "L - 1"
        raise ValueError(
            f"{name}={list(found) if found else layers!r}: expected distinct target layers in [1, {bound}] "
            "followed by -1 (the last hidden state), e.g. [-1] or [2, 15, -1]"
        )
    return found


def default_feature_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's low / middle / high layers of an EAGLE-3 drafter: (2, L // 2, L - 3)."""
    return 2, num_target_layers // 2, num_target_layers - 3


def check_eagle3_layers(
    layers: object, num_target_layers: int | None = None, name: str = "eagle3 feature_layers"
) -> tuple[int, int, int]:
    """Three distinct target layer ids in [1, L - 1] (the input of each), or a ValueError naming them."""
    found = tuple(layers) if isinstance(layers, (list, tuple)) else ()
    bound = num_target_layers if num_target_layers is not None else float("inf")
    if len(found) != 3 or len(set(found)) != 3 or not all(is_int(i) and 1 <= i < bound for i in found):
        target = f"{num_target_layers - 1}] (the target has {num_target_layers})" if num_target_layers else "L - 1]"
        raise ValueError(
            f"{name}={list(found) or layers!r}: expected three distinct target layers in [1, {target}, "
            f"e.g. {list(default_feature_layers(max(num_target_layers or 32, 8)))}"
        )
    return found


def check_layout(layout: str, name: str = "layout") -> str:
    """`layout` if it is one of FEATURE_LAYOUTS; otherwise a ValueError naming it."""
    require_choice(name, layout, FEATURE_LAYOUTS)
    return layout


@dataclass
class DrafterConfig:
    """`derived`: the target's first num_layers layers; `feature`: an EAGLE-style drafter reading
    the target's hidden states (specdecode.models.feature_drafter); `eagle3`: EAGLE-3's one layer
    over three target states, with its own head (specdecode.models.eagle3_drafter); `pretrained`:
    a drafter folder of any kind, or any HF causal LM with the target's tokenizer, at `path`."""

    kind: str = "derived"
    num_layers: int = 2
    # Size of the truncated LM head (the most frequent tokens of the domain corpora); null = full.
    draft_vocab: int | None = 8192
    path: str | None = None
    # feature drafters: null starts their layers at random (EAGLE's choice); an int copies the
    # target's layers ending at that one (-1: the last)
    init_from_layer: int | None = None
    # feature drafters: the target states read, -1 (the last) last, e.g. [2, 15, -1]; eagle3: the
    # three layers whose input states it fuses, null: the engines' (2, L // 2, L - 3)
    feature_layers: list[int] | None = field(default_factory=lambda: [-1])
    # feature drafters: eagle (EAGLE-1's, as vLLM runs it) | specdecode (the decoder as cut from
    # the target); null: eagle for a feature drafter, specdecode for the other kinds
    layout: str | None = None
    # pretrained drafters from the hub: the repo's branch, tag or commit, and whether to run its own code
    revision: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        require_choice("drafter.kind", self.kind, DRAFTER_KINDS)
        check_hub_options(self.revision, self.trust_remote_code, "drafter")
        if self.layout is None:
            self.layout = "eagle" if self.kind == "feature" else "specdecode"
        check_layout(self.layout, "drafter.layout")
        if self.kind == "feature":
            self.feature_layers = list(check_feature_layers(self.feature_layers, name="drafter.feature_layers"))
        else:
            require(
                self.layout == "specdecode",
                "drafter.layout",
                self.layout,
                f"is set but drafter.kind={self.kind!r} (only a feature drafter has a layout); use specdecode",
            )
        if self.kind == "eagle3":
            self._check_eagle3()
        if self.kind in BUILT_KINDS:
            require_int("drafter.num_layers", self.num_layers, 1)
            require_int("drafter.draft_vocab", self.draft_vocab, 1, nullable=True)
            # A path here means the user meant to load a drafter; training a derived one instead would be silent.
            require(
                self.path is None,
                "drafter.path",
                self.path,
                f"is set but drafter.kind={self.kind!r} (built from the target, it reads no path); "
                "use drafter=pretrained or drop the path",
            )
        else:
            require(bool(self.path), "drafter.path", self.path, "a pretrained drafter needs a path or hub id")
            require(
                self.draft_vocab is None,
                "drafter.draft_vocab",
                self.draft_vocab,
                f"is set but drafter.kind={self.kind!r} (a pretrained drafter keeps its own head); use null",
            )

    def _check_eagle3(self) -> None:
        """EAGLE-3's drafter: one layer, started at random, reading null (the engines') or three target layers."""
        if self.feature_layers is not None:
            self.feature_layers = list(check_eagle3_layers(self.feature_layers, name="drafter.feature_layers"))
        require(
            self.num_layers == 1, "drafter.num_layers", self.num_layers, "1 for an eagle3 drafter (EAGLE-3's one layer)"
        )
        require(
            self.init_from_layer is None,
            "drafter.init_from_layer",
            self.init_from_layer,
            "null for an eagle3 drafter (its layer reads 2H and starts at random)",
        )
