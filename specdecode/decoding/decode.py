"""The decode entry points: speculative (drafter + target) and autoregressive (target alone).

Each checks its arguments before any work, picks one `Decoder` (eager, static or compiled) from its
options and runs it. Greedy is token-identical to the target alone, sampling exact, on every decoder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from specdecode.core.config import is_int, is_number
from specdecode.decoding.adaptive import DEFAULT_PRIOR_ALPHA, AdaptiveGamma
from specdecode.decoding.attention import folded_gqa
from specdecode.decoding.compiled import check_core
from specdecode.decoding.costs import COST_MAX_GAMMA, step_table
from specdecode.decoding.decoder import Decoder, Request
from specdecode.decoding.eager import EagerDecoder
from specdecode.decoding.lookup import DEFAULT_LOOKUP, PromptLookup
from specdecode.decoding.mixed import RowDrafters, row_drafters
from specdecode.decoding.record import StepEvent
from specdecode.decoding.sampling import SamplingParams
from specdecode.decoding.static import CompiledDecoder, StaticDecoder
from specdecode.decoding.stats import GenerationResult, StepCounters
from specdecode.decoding.validation import check_feature_layers, check_seed, validate_models, validate_request
from specdecode.models.feature_drafter import FeatureDrafter

DEFAULT_GAMMA = 4
# `speculative_generate(gamma=AUTO)`: each step's gamma chosen while decoding (`adaptive.py`)
AUTO = "auto"
# gamma="auto": after this many target steps in a row the target decodes alone to the end
LEAVE_AFTER = 16


def drafter_gamma(drafter: PreTrainedModel | FeatureDrafter | RowDrafters) -> int:
    """The gamma stored with a trained drafter (`config.specdecode_gamma`), else `DEFAULT_GAMMA`;
    for a mixed batch, the smallest of its drafters' (a short draft wastes least where one is unsure)."""
    if isinstance(drafter, RowDrafters):
        return min((drafter_gamma(model) for model in drafter.models), default=DEFAULT_GAMMA)
    gamma = getattr(drafter.config, "specdecode_gamma", None)
    return gamma if is_int(gamma) and gamma >= 1 else DEFAULT_GAMMA


def drafter_alpha(drafter: PreTrainedModel | FeatureDrafter, temperature: float = 0.0) -> float:
    """Where the adaptive gamma starts each row: the held-out acceptance stored with a trained
    drafter, else `DEFAULT_PRIOR_ALPHA`. Greedy: `config.specdecode_alpha`. Sampled at T: between it
    and `config.specdecode_alpha_sampled` (Σ min(p, q) at its temperature t), linear in T up to t, which
    sampled acceptance tends to as T falls to 0 (both distributions then one-hot at their argmax)."""
    alpha = getattr(drafter.config, "specdecode_alpha", None)
    greedy = float(alpha) if is_number(alpha) and 0.0 <= alpha <= 1.0 else DEFAULT_PRIOR_ALPHA
    sampled = getattr(drafter.config, "specdecode_alpha_sampled", None)
    if temperature == 0.0 or not isinstance(sampled, dict):
        return greedy
    at, value = sampled.get("temperature"), sampled.get("alpha")
    if not (is_number(at) and at > 0 and is_number(value) and 0.0 <= value <= 1.0):
        return greedy
    return greedy + (float(value) - greedy) * min(temperature / at, 1.0)


def adaptive_gamma(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter | RowDrafters,
    params: SamplingParams = SamplingParams(),
    remeasure: bool = False,
) -> AdaptiveGamma:
    """The adaptive gamma `gamma="auto"` decodes with: this machine's step table for these models and
    sampling mode (`costs.step_table`, measured once then cached, scaled by the decode's own step times),
    rows starting at the drafter's alpha, leaving the speculative loop after `LEAVE_AFTER` target steps.
    A mixed batch's drafters each get a table too, so each pays its own drafts (`drafter_costs`)."""
    models = drafter.models if isinstance(drafter, RowDrafters) else (drafter,)
    tables = tuple(step_table(target, model, params, remeasure=remeasure) for model in models)
    drafter_costs = tables if len(tables) > 1 else ()
    prior = drafter_alpha(models[0], params.temperature)
    return AdaptiveGamma(tables[0], prior, drafter_costs=drafter_costs, calibrate=True, leave_after=LEAVE_AFTER)


@dataclass(frozen=True)
class DecodeOptions:
    """How `speculative_generate` / `autoregressive_generate` decode, past the models, prompts and
    budgets: checked here, once.

    Attributes:
        temperature / top_k / top_p: how tokens are drawn (`SamplingParams`; temperature 0 is greedy).
        eos_token_ids: ids that end a row (included in its output); None: the target's own.
        seed: seeds the draws (None: torch's global generator).
        static: the static-shape decoder (fixed caches and pass widths, finished rows masked).
        compile: with `static`, compile its steps; None: on for CUDA, `COMPILE_ON_CPU` on the CPU.
        capacity: with `static`, the caches' slots per row; calls of one batch size and capacity
            share compiled graphs (None: each call's need rounded up to a power of two).
        record: `result.record`, one `RowRecord` per prompt, at no extra host sync. Eager only.
        on_step: called after every step with a `StepEvent` (one more host sync per step). Eager only.
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
    gamma: int | str | AdaptiveGamma | None = None,
    prompt_lookup: PromptLookup | None = DEFAULT_LOOKUP,
    assign: Sequence[str | None] | None = None,
    options: DecodeOptions | None = None,
    **fields: Any,
) -> GenerationResult:
    """Generate from `target` with `drafter` proposing `gamma` tokens per target pass.

    The output distribution is exactly the target's (greedy: token-identical to target-only greedy).
    `drafter`: a causal LM sharing the target's vocabulary, or a `FeatureDrafter`. `prompts`: a
    ragged batch of token-id lists; `max_new_tokens`: one budget or one per prompt. `gamma=None`:
    the drafter's stored one (`config.specdecode_gamma`), else `DEFAULT_GAMMA`; `gamma="auto"` (or
    an `AdaptiveGamma`): each step's gamma, 0 included, chosen from this machine's step costs and
    each row's running acceptance (`adaptive.py`; a static decoder takes one gamma per call).
    `prompt_lookup`: where the drafter is unsure, copy what followed an earlier occurrence of the
    row's last tokens (exact; `lookup.py`); None: the drafter alone. `options`, or any of its
    fields by keyword (`temperature=0.7, static=True`): `DecodeOptions`.

    Several drafters in one batch (eager decoder only): `drafter={"code": d1, "math": d2}` and
    `assign` naming each prompt's drafter (None: the target alone), e.g. `["code", "math", None]`;
    one target pass per step verifies every row, `gamma=None` is the smallest of theirs, and
    with `record=True` each row's record names its drafter.
    """
    options = _options(options, fields)
    drafting: PreTrainedModel | FeatureDrafter | RowDrafters
    if isinstance(drafter, Mapping) or assign is not None:
        drafting = row_drafters(target, drafter, assign, prompt_lookup)
    else:
        validate_models(target, drafter, prompt_lookup)
        drafting = drafter
    decoder = options.decoder(target.device)
    adaptive = _adaptive(gamma)
    fixed = drafter_gamma(drafting) if gamma is None else gamma if isinstance(gamma, int) else None
    lookup = prompt_lookup if prompt_lookup is not None and prompt_lookup.applies(options.temperature) else None
    # an adaptive gamma's widest step sizes the rows' slack; its costs are measured after the checks
    widest = fixed if fixed is not None else adaptive.widest if adaptive is not None else COST_MAX_GAMMA
    request = _request(target, prompts, max_new_tokens, options, gamma=widest, lookup=lookup)
    decoder.check_room(request)
    models = drafting.models if isinstance(drafting, RowDrafters) else (drafting,)
    if isinstance(drafting, RowDrafters):
        if len(drafting.owners) != len(request.prompts):
            raise ValueError(f"assign has {len(drafting.owners)} drafter names for {len(request.prompts)} prompts")
        if not isinstance(decoder, EagerDecoder):
            raise ValueError("several drafters in one batch (assign=) need the eager decoder: static=False")
    if max(request.budgets) == 0:
        return GenerationResult.empty(request.prompts, StepCounters(widest, target.device), options.record)
    if fixed is None and models:
        adaptive = adaptive or adaptive_gamma(target, drafting, options.params)
        if isinstance(decoder, EagerDecoder):
            priors, groups = None, None
            if isinstance(drafting, RowDrafters):  # each row starts at its drafter's alpha (0: it drafts nothing)
                priors = tuple(
                    0.0 if k is None else drafter_alpha(models[k], options.temperature) for k in drafting.owners
                )
                groups = [drafting.owners.count(k) for k in range(len(models))]
            # where no draft pays at the rows' stated acceptance, the target decodes alone
            starts = priors or (adaptive.prior_alpha,) * len(request.prompts)
            opening = adaptive.opening_gamma(starts, [max(b - 1, 0) for b in request.budgets], groups)
            request = dataclasses.replace(
                request, gamma=adaptive.widest if opening else 0, adaptive=adaptive, priors=priors
            )
        else:  # steps of one shape: one gamma for the call
            request = dataclasses.replace(request, gamma=adaptive.fixed_gamma(len(request.prompts)))
    with folded_gqa(target, *models):
        if request.gamma == 0 or not models:  # the target alone: no drafts pay, or no row drafts
            result = decoder.autoregressive(target, dataclasses.replace(request, gamma=None, lookup=None))
            if fixed is None and models:  # gamma chosen, 0: every step after the prefill a target step
                result.stats.gamma_steps = {0: result.stats.target_calls - 1}
        else:
            result = decoder.speculative(target, drafting, request)
    return drafting.named(result) if isinstance(drafting, RowDrafters) else result


def _adaptive(gamma: object) -> AdaptiveGamma | None:
    """The `AdaptiveGamma` that `gamma` is, else None (`"auto"` gets its costs after the checks)."""
    if isinstance(gamma, AdaptiveGamma):
        return gamma
    if isinstance(gamma, str) and gamma != AUTO:
        raise ValueError(f"gamma must be an int >= 1, {AUTO!r}, an AdaptiveGamma or None, got {gamma!r}")
    if gamma is not None and not isinstance(gamma, (int, str)):
        raise TypeError(f"gamma must be an int >= 1, {AUTO!r}, an AdaptiveGamma or None, got {gamma!r}")
    return None


@torch.inference_mode()
def autoregressive_generate(
    target: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    feature_layers: Sequence[int] | None = None,
    temperatures: Sequence[float] | None = None,
    options: DecodeOptions | None = None,
    **fields: Any,
) -> GenerationResult:
    """Target-only decoding on the same caches, batching and stopping rules as `speculative_generate`.

    With `feature_layers`, `result.features[i]` `[len(prompts[i]) + len(sequences[i]), n·H]` holds
    the target's features (`target_features`) of prompt i and its continuation, taken from the
    passes that wrote it (distillation data at no second forward). The last generated token is
    never fed, so its row is zero; a feature drafter's training never reads it.

    With `temperatures` (eager decoder), each prompt is continued once per temperature from one
    prefill of it: `result.sequences[i * n + j]` (and `features`, `record`, `on_step`'s rows) is
    prompt i's at `temperatures[j]`."""
    options = _options(options, fields)
    decoder = options.decoder(target.device)
    layers = check_feature_layers(feature_layers, target.config.num_hidden_layers)
    fan_out = _check_temperatures(temperatures, options, decoder)
    request = _request(target, prompts, max_new_tokens, options, feature_layers=layers, temperatures=fan_out)
    decoder.check_room(request)
    if max(request.budgets) == 0 and layers is None:
        rows = [p for p in request.prompts for _ in fan_out or (None,)]
        return GenerationResult.empty(rows, StepCounters(0, target.device), options.record)
    with folded_gqa(target):
        return decoder.autoregressive(target, request)


def _check_temperatures(
    temperatures: Sequence[float] | None, options: DecodeOptions, decoder: Decoder
) -> tuple[float, ...] | None:
    """`autoregressive_generate`'s `temperatures` as a tuple, checked (None stays None)."""
    if temperatures is None:
        return None
    if isinstance(temperatures, (str, bytes)) or not isinstance(temperatures, Sequence) or not temperatures:
        raise ValueError(f"temperatures must be a non-empty list of temperatures, got {temperatures!r}")
    for t in temperatures:
        SamplingParams(t)  # names a bad temperature
    if options.temperature != 0.0:
        raise ValueError(f"give temperature or temperatures, not both: temperature={options.temperature!r}")
    if not isinstance(decoder, EagerDecoder):
        raise ValueError("several continuations per prompt (temperatures=) need the eager decoder: static=False")
    return tuple(float(t) for t in temperatures)


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
