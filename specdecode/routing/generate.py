"""Routed generation: each prompt decoded with the drafter the router picks for it.

`route_and_generate` embeds a batch of prompts, groups them by chosen drafter, runs one batched
`speculative_generate` per group (plain decoding for the no-drafter route) and returns the outputs
in the caller's order.
"""

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
    """`sequences[i]` and `drafters[i]`: output and chosen drafter of prompt i, in the caller's order;
    `groups[name]`: the prompt indices routed to `name`; `results[name]`: that group's run (its
    `.stats` are the group's); `routing_time_s`: embedding + MLP for the whole batch; `records[i]`:
    prompt i's `RowRecord`, its `drafter` named, when decoded with `record=True`."""

    sequences: list[list[int]]
    drafters: list[str]
    groups: dict[str, list[int]]
    results: dict[str, GenerationResult]
    routing_time_s: float
    records: list[RowRecord] | None = None


def match_drafters(
    router: Router,
    drafters: Mapping[str, PreTrainedModel | FeatureDrafter] | Sequence[tuple[str, PreTrainedModel | FeatureDrafter]],
) -> list[PreTrainedModel | FeatureDrafter | None]:
    """The drafters in the router's order, by name (None for the router's `NO_DRAFTER` route).

    Raises ValueError: naming both lists when the names or their count differ.
    """
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
    """Route each prompt to a drafter, then run one batched `speculative_generate` per drafter
    (and plain decoding for prompts routed to `NO_DRAFTER`, if the router has that route).

    The router reads text, the decoder token ids, so both are given: `texts[i]` is the prompt as
    the router was fitted on it (the user message, as in the labels) and `prompts[i]` the ids
    decoded from (usually `format_prompt(tokenizer, texts[i])`).

    `drafters` carry the names of `router.drafters`; `max_new_tokens` is one budget or one per
    prompt; `decode_kwargs` go to every `speculative_generate` (gamma, temperature, seed, ...): with
    `record=True` each row's record names its drafter, and an `on_step` callback sees
    `StepEvent.rows` as indices into `prompts`. The result is in the caller's order.
    """
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
        if drafter is None:  # the no-drafter route: plain decoding, on the same machinery
            plain = {k: v for k, v in kwargs.items() if k not in ("gamma", "prompt_lookup")}
            result = autoregressive_generate(
                target, [prompts[i] for i in rows], max_new_tokens=[budgets[i] for i in rows], **plain
            )
        else:
            result = speculative_generate(
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
