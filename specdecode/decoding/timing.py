"""Step costs at batch 1 as the speedup model, the gamma choice and the benchmarks read them
(`costs.step_pieces` timed by `costs.time_rounds`), and timed batch-1 decodes (`timed_decodes`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from specdecode.core.config import is_int
from specdecode.decoding.attention import folded_gqa
from specdecode.decoding.compiled import check_core, mark_step, nested_layers, skipped_guards
from specdecode.decoding.costs import CORES, Piece, check_counts, step_pieces, time_rounds
from specdecode.decoding.decode import autoregressive_generate, speculative_generate
from specdecode.decoding.static import GUARDED_STEPS
from specdecode.decoding.static_cache import rows_capacity
from specdecode.decoding.stats import GenerationResult
from specdecode.models.feature_drafter import FeatureDrafter

# Timed rounds behind a verify ratio: with a few, a 4-token verify's ratio to a step moved by a third
# between processes (each round is ~0.1 s for the embedded target on a 2-core CPU).
VERIFY_REPEATS = 30


@dataclass
class StepCosts:
    """Median seconds of a step's pieces at batch 1 after `context_tokens` committed tokens: a target
    step, a verify of gamma drafts, a drafter step (a gamma-th of its gamma drafts)."""

    target_step_s: float
    target_verify_s: float
    drafter_step_s: float
    gamma: int
    context_tokens: int
    # gamma → a (gamma + 1)-token verify over a one-token step, when measured (measure_verify_ratios).
    verify_ratios: dict[int, float] = field(default_factory=dict)

    @property
    def cost_ratio(self) -> float:
        """c: a drafter step relative to a target step."""
        return self.drafter_step_s / self.target_step_s

    @property
    def verify_ratio(self) -> float:
        """A (gamma + 1)-token verify pass relative to a one-token target step."""
        return self.target_verify_s / self.target_step_s

    def to_dict(self) -> dict[str, float]:
        return asdict(self) | {"cost_ratio": self.cost_ratio, "verify_ratio": self.verify_ratio}


@torch.inference_mode()
def measure_verify_ratios(
    target: PreTrainedModel, context: Sequence[int], gammas: Sequence[int], repeats: int = 5
) -> dict[int, float]:
    """gamma → the measured cost of a verify of gamma drafts over a target step, at batch 1 after
    `context` but its last max(gammas) tokens (the drafts)."""
    if len(context) <= max(gammas) + 1:
        raise ValueError(f"context must be longer than max(gammas) + 1 = {max(gammas) + 1} tokens, got {len(context)}")
    tokens = torch.tensor([list(context)], device=target.device)
    with folded_gqa(target):  # the decode loops' attention
        pieces = step_pieces(target, None, tokens, len(context) - max(gammas), gammas)
        times = time_rounds(pieces, repeats, target.device)
    return {g: times["verify", g] / times["step", 0] for g in gammas}


@torch.inference_mode()
def measure_step_costs(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    context: Sequence[int],
    gamma: int,
    repeats: int = 10,
) -> StepCosts:
    """The eager core's `StepCosts` at `gamma`, batch 1, after `context` but its last gamma tokens."""
    if len(context) <= gamma + 1:
        raise ValueError(f"context must be longer than gamma + 1 = {gamma + 1} tokens, got {len(context)}")
    return _step_costs(target, drafter, list(context), len(context) - gamma, gamma, ("eager",), None, repeats)["eager"]


@torch.inference_mode()
def measure_pass_costs(
    target: PreTrainedModel,
    drafters: Mapping[str, PreTrainedModel | FeatureDrafter],
    gammas: Mapping[str, int],
    context: Sequence[int],
    repeats: int = VERIFY_REPEATS,
) -> dict[str, float]:
    """name → one speculative pass of that drafter at `gammas[name]`, in target steps: a verify of
    gamma drafts plus the drafter's gamma drafts, timed after `context` (each gamma's verify once,
    the same figure for every drafter at it)."""
    missing = sorted(set(drafters) - set(gammas))
    if not drafters or missing:
        raise ValueError(
            f"measure_pass_costs needs a gamma for each of one or more drafters: drafters={sorted(drafters)}, "
            f"gammas={dict(gammas)}" + (f", none for {missing}" if missing else "")
        )
    gammas = {name: gammas[name] for name in drafters}
    context = long_enough_context(context, max(gammas.values()))
    verify = measure_verify_ratios(target, context, sorted(set(gammas.values())), repeats)
    return {
        name: verify[gammas[name]]
        + gammas[name] * measure_step_costs(target, drafter, context, gammas[name], repeats).cost_ratio
        for name, drafter in drafters.items()
    }


def long_enough_context(context: Sequence[int], gamma: int) -> list[int]:
    """`context`, repeated where it is too short to time a verify of gamma + 1 tokens after it."""
    context = list(context)
    if len(context) <= gamma + 1:
        context = (context * (gamma + 2))[: gamma + 2 + len(context)]
    return context


def warm_up_tokens(max_new_tokens: int, gammas: Sequence[int]) -> int:
    """An untimed warm-up decode's budget: two verifies of the widest of `gammas` (a width's first pass pays set-up)."""
    return min(max_new_tokens, 2 * max(gammas, default=1) + 2)


def timed_decodes(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    prompts: Sequence[Sequence[int]],
    gammas: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Decode each of `prompts` at batch 1 with the target alone and with `drafter` at each of
    `gammas`, timed after one untimed warm-up each, in an order rotated per prompt so drift biases
    none. Returns `{"autoregressive_s", "seconds": {gamma: s}, "per_prompt_s": {gamma: [s]},
    "tau": {gamma: tau}, "tokens"}`, seconds summed over the prompts."""
    rows = [list(p) for p in prompts]
    if not rows or not gammas or not is_int(max_new_tokens) or max_new_tokens < 2:
        raise ValueError(
            f"timed_decodes needs one or more prompts and gammas and max_new_tokens >= 2 (a verify after the "
            f"prefill), got {len(rows)} prompts, gammas={list(gammas)}, max_new_tokens={max_new_tokens!r}"
        )
    decode = dict(temperature=temperature, seed=0, eos_token_ids=[])
    # key 0: the target alone, the baseline every gamma's speedup is measured against
    runs: dict[int, Callable[..., GenerationResult]] = {0: functools.partial(autoregressive_generate, target)}
    runs |= {g: functools.partial(speculative_generate, target, drafter, gamma=g) for g in gammas}
    for run in runs.values():  # warm-up, not counted
        run([rows[0]], max_new_tokens=warm_up_tokens(max_new_tokens, gammas), **decode)
    seconds: dict[int, list[float]] = {key: [] for key in runs}
    passes = dict.fromkeys(runs, 0)
    tokens = dict.fromkeys(runs, 0)
    order = list(runs)
    for i, ids in enumerate(rows):
        for key in order[i % len(order) :] + order[: i % len(order)]:
            start = time.perf_counter()
            result = runs[key]([ids], max_new_tokens=max_new_tokens, **decode)
            seconds[key].append(time.perf_counter() - start)
            passes[key] += result.stats.target_calls
            tokens[key] += len(result.sequences[0])
    return {
        "autoregressive_s": sum(seconds[0]),
        "seconds": {g: sum(seconds[g]) for g in gammas},
        "per_prompt_s": {g: seconds[g] for g in gammas},
        "tau": {g: tokens[g] / passes[g] for g in gammas},
        "tokens": tokens[0],
    }


def _time_pieces(
    pieces: dict[tuple[str, str], Piece],
    repeats: int,
    compiled: set[str],
    device: torch.device,
    models: tuple[torch.nn.Module, ...],
) -> dict[tuple[str, str], float]:
    """Median seconds of each (core, piece) after `GUARDED_STEPS` uncounted rounds; a compiled core's
    pieces run as its decode's steps do (`nested_layers`, `mark_step`, `skipped_guards`)."""

    @contextlib.contextmanager
    def around(key: tuple[str, str], round_: int) -> Iterator[None]:
        on = key[0] in compiled
        with nested_layers(*(models if on else ())):
            mark_step(on, device)
            with skipped_guards(on and round_ >= GUARDED_STEPS):
                yield

    return time_rounds(pieces, repeats, device, GUARDED_STEPS, around)


@torch.inference_mode()
def core_step_costs(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    prompt: Sequence[int],
    new_tokens: int,
    gamma: int,
    cores: Sequence[str] = tuple(CORES),
    repeats: int = 10,
) -> dict[str, StepCosts]:
    """core → its `StepCosts` for `drafter` at `gamma`, at batch 1 with `prompt` and half of
    `new_tokens` committed, on caches as large as that decode gets (each bad value named)."""
    unknown = [core for core in cores if core not in CORES]
    if unknown or not cores:
        raise ValueError(f"cores must be one or more of {list(CORES)}, got {list(cores)}")
    check_counts(("gamma", gamma, 1), ("new_tokens", new_tokens, 1), ("repeats", repeats, 1))
    if not prompt:
        raise ValueError("prompt must hold one or more tokens")
    length = len(prompt) + max(new_tokens // 2, 1)
    capacity = rows_capacity([prompt], [new_tokens], gamma)  # the slots a decode's static caches get
    step_capacity = rows_capacity([prompt], [new_tokens], None)
    ids = (list(prompt) * (capacity // len(prompt) + 1))[:capacity]
    return _step_costs(target, drafter, ids, length, gamma, cores, step_capacity, repeats)


def _step_costs(
    target: PreTrainedModel,
    drafter: PreTrainedModel | FeatureDrafter,
    ids: list[int],
    length: int,
    gamma: int,
    cores: Sequence[str],
    step_capacity: int | None,
    repeats: int,
) -> dict[str, StepCosts]:
    """core → its `StepCosts` for `drafter` at `gamma`, after `length` of the batch-1 `ids` committed,
    the target step's cache of `step_capacity` slots (None: the verify's)."""
    compiled = {core for core in cores if check_core(CORES[core]["static"], CORES[core].get("compile"), target.device)}
    tokens = torch.tensor([ids], device=target.device)
    pieces: dict[tuple[str, str], Piece] = {}
    with folded_gqa(target, drafter):  # the decode loops' attention
        for core in cores:
            built = step_pieces(
                target, drafter, tokens.clone(), length, [gamma], core=core, step_capacity=step_capacity
            )
            pieces |= {(core, name): piece for (name, _), piece in built.items()}
        times = _time_pieces(pieces, repeats, compiled, target.device, (target, drafter))
    return {
        core: StepCosts(
            target_step_s=times[core, "step"],
            target_verify_s=times[core, "verify"],
            drafter_step_s=times[core, "draft"] / gamma,
            gamma=gamma,
            context_tokens=length,
        )
        for core in cores
    }
