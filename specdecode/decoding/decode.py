"""The decode entry points: speculative (drafter + target) and autoregressive (target alone).

Each checks its arguments once, before any work (`DecodeOptions`, `validation.py`), picks one
`Decoder` from the options (eager, static or compiled: `decoder.py`) and runs it. Greedy decoding
is token-identical to the target alone and sampling follows the target's distribution exactly, on
every decoder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from specdecode.decoding.attention import folded_gqa
from specdecode.decoding.compiled import check_core
from specdecode.decoding.decoder import Decoder, Request
from specdecode.decoding.eager import EagerDecoder
from specdecode.decoding.lookup import DEFAULT_LOOKUP, PromptLookup
from specdecode.decoding.mixed import RowDrafters, check_rows, row_drafters
from specdecode.decoding.record import StepEvent
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.static import CompiledDecoder, StaticDecoder
from specdecode.decoding.stats import GenerationResult, StepCounters
from specdecode.decoding.validation import check_feature_layers, check_seed, validate_models, validate_request
from specdecode.models.feature_drafter import FeatureDrafter

DEFAULT_GAMMA = 4


def drafter_gamma(drafter: PreTrainedModel | FeatureDrafter | RowDrafters) -> int:
    """The gamma stored with a trained drafter (`config.specdecode_gamma`), else `DEFAULT_GAMMA`;
    for a mixed batch's drafters, the smallest of theirs (every row drafts the batch's gamma, and a
    short draft wastes least where a drafter is unsure)."""
    if isinstance(drafter, RowDrafters):
        return min((drafter_gamma(model) for model in drafter.models), default=DEFAULT_GAMMA)
    gamma = getattr(drafter.config, "specdecode_gamma", None)
    return gamma if isinstance(gamma, int) and not isinstance(gamma, bool) and gamma >= 1 else DEFAULT_GAMMA


@dataclass(frozen=True)
class DecodeOptions:
    """How `speculative_generate` / `autoregressive_generate` decode, past the models, prompts and
    budgets (their keywords): checked here, once.

    Attributes:
        temperature / top_k / top_p: how tokens are drawn (`SamplingParams`; temperature 0 is greedy).
        eos_token_ids: ids that end a row (included in its output); None: the target's own.
        seed: seeds the draws (None: torch's global generator).
        static: the static-shape decoder (`static.py`: fixed caches and pass widths, finished rows masked).
        compile: with `static`, compile its steps (`CompiledDecoder`); None: on for CUDA,
            `compiled.COMPILE_ON_CPU` on the CPU.
        capacity: with `static`, the caches' slots per row (at least the longest prompt + its budget
            + the decoder's slack): calls of one batch size and capacity share compiled graphs, where
            by default (None) each call's need is rounded up to a power of two.
        record: `result.record`, one `RowRecord` per prompt (`specdecode.decoding.record`): each step's
            drafts, accepted count, the target's token, which drafts prompt lookup filled, and when the
            host saw it, at no extra host sync. Eager decoder only.
        on_step: called after every step with the tokens each row committed (a `StepEvent`), for
            views that stream: one more host sync per step. Eager decoder only.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: Sequence[int] | int | None = None
    seed: int | None = None
    static: bool = False
    compile: bool | None = None
    capacity: int | None = None
    record: bool = False
    on_step: Callable[[StepEvent], None] | None = None
    params: SamplingParams = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_seed(self.seed)
        if not isinstance(self.record, bool):
            raise TypeError(f"record must be true or false, got {self.record!r}")
        if self.on_step is not None and not callable(self.on_step):
            raise TypeError(f"on_step must be a callable taking a StepEvent, or None, got {self.on_step!r}")
        if self.static and (self.record or self.on_step is not None):
            raise ValueError(
                "record=True and on_step need the eager decoder (static=False): the static ones do not "
                "sync with the host every step"
            )
        object.__setattr__(self, "params", SamplingParams(self.temperature, self.top_k, self.top_p))

    def decoder(self, device: torch.device) -> Decoder:
        """The decoder these options choose on `device`."""
        if check_core(self.static, self.compile, device, self.capacity):
            return CompiledDecoder(self.capacity)
        if self.static:
            return StaticDecoder(self.capacity)
        return EagerDecoder(self.record, self.on_step)

    def generator(self, device: torch.device) -> torch.Generator | None:
        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


def _options(options: DecodeOptions | None, fields: dict[str, Any]) -> DecodeOptions:
    """`options` with `fields` (any `DecodeOptions` field, by keyword) set on it."""
    if options is None:
        return DecodeOptions(**fields)
    if not isinstance(options, DecodeOptions):
        raise TypeError(f"options must be a DecodeOptions or None, got {options!r}")
    return dataclasses.replace(options, **fields)


@torch.inference_mode()
def speculative_generate(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter | Mapping[str, PreTrainedModel | FeatureDrafter],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    gamma: int | None = None,
    prompt_lookup: PromptLookup | None = DEFAULT_LOOKUP,
    assign: Sequence[str | None] | None = None,
    options: DecodeOptions | None = None,
    **fields: Any,
) -> GenerationResult:
    """Generate from `target` with `drafter` proposing `gamma` tokens per target pass.

    The output distribution is exactly the target's (greedy: token-identical to target-only greedy).
    `drafter` is a causal LM sharing the target's vocabulary or a `FeatureDrafter` (it then reads
    the target's hidden states, which the verify pass computes anyway). `prompts` is a ragged batch
    of token-id lists (no padding); `max_new_tokens` is one budget or one per prompt. `gamma=None`
    uses the drafter's own (`config.specdecode_gamma`, the candidate its training timed fastest on
    held-out prompts: `choose_gamma`), else `DEFAULT_GAMMA`. `prompt_lookup`: where the drafter is
    unsure, copy what followed an earlier occurrence of the row's last tokens (exact;
    `specdecode.decoding.lookup`); None: the drafter alone. How to decode: `options`, and any of
    its fields by keyword (`temperature=0.7, static=True`: `DecodeOptions`).

    Several drafters in one batch: `drafter={"code": d1, "math": d2}` and `assign` naming each
    prompt's drafter (None: the target alone), e.g. `["code", "math", None]`. Each row drafts with
    its own drafter, and one target pass per step verifies every row (`mixed.py`; the eager decoder
    only). `gamma=None` is then the smallest of the assigned drafters' own; with `record=True`
    each row's record names its drafter.
    """
    options = _options(options, fields)
    if isinstance(drafter, Mapping) or assign is not None:
        drafter = row_drafters(target, drafter, assign, prompt_lookup)
    else:
        validate_models(target, drafter, prompt_lookup)
    decoder = options.decoder(target.device)
    gamma = drafter_gamma(drafter) if gamma is None else gamma
    lookup = prompt_lookup if prompt_lookup is not None and prompt_lookup.applies(options.temperature) else None
    request = _request(target, prompts, max_new_tokens, options, gamma=gamma, lookup=lookup)
    decoder.check_room(request)
    models = drafter.models if isinstance(drafter, RowDrafters) else (drafter,)
    if isinstance(drafter, RowDrafters):
        check_rows(drafter, len(request.prompts))
        if not isinstance(decoder, EagerDecoder):
            raise ValueError("several drafters in one batch (assign=) need the eager decoder: static=False")
    if max(request.budgets) == 0:
        return GenerationResult.empty(request.prompts, StepCounters(gamma, target.device), options.record)
    with folded_gqa(target, *models):
        if not isinstance(drafter, RowDrafters):
            return decoder.speculative(target, drafter, request)
        # where no row drafts, the target alone: no placeholder drafts to verify
        result = decoder.speculative(target, drafter, request) if models else decoder.autoregressive(target, request)
    return drafter.named(result)


@torch.inference_mode()
def autoregressive_generate(
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    feature_layers: Sequence[int] | None = None,
    options: DecodeOptions | None = None,
    **fields: Any,
) -> GenerationResult:
    """Target-only decoding on the same caches, batching and stopping rules as `speculative_generate`
    (`options` and its fields by keyword too; every token's kind in a record is `target`).

    With `feature_layers`, `result.features[i]` `[len(prompts[i]) + len(sequences[i]), n·H]` (the
    target's dtype and device) holds the target's features (`target_features`) of prompt i's tokens
    and its continuation's, taken from the passes that wrote it: sequence-level distillation of a
    feature drafter then costs one target pass, not a second forward over the text. The last
    generated token is never fed (decoding stops once it is chosen), so its row is zero, as padding
    is: a feature drafter's training never reads a sequence's last feature (its last loss position
    predicts that token from the one before)."""
    options = _options(options, fields)
    decoder = options.decoder(target.device)
    layers = check_feature_layers(feature_layers, target.config.num_hidden_layers)
    request = _request(target, prompts, max_new_tokens, options, feature_layers=layers)
    decoder.check_room(request)
    if max(request.budgets) == 0 and layers is None:
        return GenerationResult.empty(request.prompts, StepCounters(0, target.device), options.record)
    with folded_gqa(target):
        return decoder.autoregressive(target, request)


def _request(
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    options: DecodeOptions,
    **decoding: Any,
) -> Request:
    """The checked `Request` (`decoding`: its gamma, lookup or feature layers)."""
    budgets, eos, checked = validate_request(
        target, prompts, max_new_tokens, options.eos_token_ids, decoding.get("gamma")
    )
    return Request(checked, budgets, eos, options.params, options.generator(target.device), **decoding)
