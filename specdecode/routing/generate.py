"""Routed generation: each prompt decoded with the drafter the router picks for it, one batched
decode per chosen drafter."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedModel

from specdecode.decoding.decode import autoregressive_generate, speculative_generate
from specdecode.decoding.record import RowRecord, StepEvent
from specdecode.decoding.stats import GenerationResult
from specdecode.models.feature_drafter import FeatureDrafter
from specdecode.routing.router import NO_DRAFTER, Router


@dataclass
class RoutedGeneration:
    """Per prompt (caller's order) its output, chosen drafter and, with `record=True`, `RowRecord`;
    per drafter name its prompt indices and its group's run; the router's seconds for the batch."""

    sequences: list[list[int]]
    drafters: list[str]
    groups: dict[str, list[int]]
    results: dict[str, GenerationResult]
    routing_time_s: float
    records: list[RowRecord] | None = None


def generate_with(
    target: PreTrainedModel, drafter: Any, prompts: Sequence[Sequence[int]], **decode: Any
) -> GenerationResult:
    """`speculative_generate` with `drafter`, or the target alone where it is None (gamma and prompt lookup dropped)."""
    if drafter is None:
        plain = {k: v for k, v in decode.items() if k not in ("gamma", "prompt_lookup")}
        return autoregressive_generate(target, prompts, **plain)
    return speculative_generate(target, drafter, prompts, **decode)


def match_drafters(
    router: Router,
    drafters: Mapping[str, PreTrainedModel | FeatureDrafter] | Sequence[tuple[str, PreTrainedModel | FeatureDrafter]],
) -> list[PreTrainedModel | FeatureDrafter | None]:
    """The drafters in the router's order, by name (None for `NO_DRAFTER`); a ValueError naming both
    lists where the names differ."""
    pairs: list[tuple[str, PreTrainedModel | FeatureDrafter]] = (
        list(drafters.items()) if isinstance(drafters, Mapping) else [(name, model) for name, model in drafters]
    )
    names = [name for name, _ in pairs]
    real = [name for name in router.drafters if name != NO_DRAFTER]
    if len(names) != len(real) or sorted(names) != sorted(real):
        raise ValueError(f"the router routes between drafters {real} but was given drafters {names}")
    by_name = dict(pairs) | {NO_DRAFTER: None}
    return [by_name[name] for name in router.drafters]


def route_and_generate(
    router: Router,
    target: PreTrainedModel,
    drafters: Mapping[str, PreTrainedModel | FeatureDrafter] | Sequence[tuple[str, PreTrainedModel | FeatureDrafter]],
    prompts: Sequence[Sequence[int]],
    *,
    texts: Sequence[str],
    max_new_tokens: int | Sequence[int],
    **decode_kwargs: Any,
) -> RoutedGeneration:
    """Route each prompt to a drafter by `texts[i]` (the user message), then decode the `prompts` ids
    one batch per drafter (`generate_with`); an `on_step` callback sees rows as indices into `prompts`."""
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
    records: list[RowRecord] = [RowRecord(len(p)) for p in prompts]
    groups: dict[str, list[int]] = {}
    results: dict[str, GenerationResult] = {}
    on_step = decode_kwargs.pop("on_step", None)
    for k, (name, drafter) in enumerate(zip(router.drafters, models)):
        rows = [i for i, choice in enumerate(choices) if choice == k]
        if not rows:
            continue
        kwargs = decode_kwargs | ({"on_step": _in_caller_rows(on_step, rows)} if on_step is not None else {})
        result = generate_with(
            target, drafter, [prompts[i] for i in rows], max_new_tokens=[budgets[i] for i in rows], **kwargs
        )
        groups[name], results[name] = rows, result
        for j, (i, sequence) in enumerate(zip(rows, result.sequences)):
            sequences[i] = sequence
            if result.record is not None:
                records[i] = replace(result.record[j], drafter=name)
    return RoutedGeneration(
        sequences,
        [router.drafters[k] for k in choices],
        groups,
        results,
        routing_time_s,
        records if decode_kwargs.get("record") else None,
    )


def _in_caller_rows(on_step: Callable[[StepEvent], None], rows: list[int]) -> Callable[[StepEvent], None]:
    """`on_step` for one group's decode: its events' rows mapped to the caller's prompt indices."""
    return lambda event: on_step(replace(event, rows=[rows[r] for r in event.rows]))
