"""The decode benchmark's methods (the target alone and ours on each core, transformers' assisted
generation, the data writer), `time_group` over the evaluation's timing loop, and how a method's tokens compare.
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel

from specdecode.decoding.adaptive import AdaptiveGamma
from specdecode.decoding.decode import autoregressive_generate, speculative_generate
from specdecode.decoding.lookup import PromptLookup
from specdecode.decoding.stats import GenerationResult, StepCounters
from specdecode.decoding.timing import CORES
from specdecode.evaluation.records import Generate, RunRecord, rates, run_batched, run_interleaved
from specdecode.models.drafters import derive_drafter
from specdecode.models.feature_drafter import FeatureDrafter, derive_feature_drafter
from specdecode.models.loading import load_drafter

# The methods `eval/benchmark_gpu.py` times unless asked for more (`--only`): each compiled one compiles for a minute.
DEFAULT_METHODS = (
    "target alone, eager",
    "target alone, compiled",
    "ours (slice), compiled",
    "ours (feature), compiled",
    "transformers assisted (slice)",
    "data writer, eager",
    "data writer, compiled",
)

Drafter = PreTrainedModel | FeatureDrafter


@dataclass
class Row:
    """One method of one group: median tokens/s over the rounds (no rounds: the first call's); speedup,
    exact match and agreement against its reference; alpha, tau and `gamma_steps` pooled over the
    first call; for ours in `run_benchmark`, Leviathan's predicted speedup and measured / predicted."""

    target: str
    dtype: str
    batch_size: int
    method: str
    tokens_per_s: float
    first_call_s: float
    speedup: float | None
    alpha: float | None
    tau: float | None
    exact_match: float | None
    agreement: float | None
    gamma_steps: dict[str, int]
    cudagraph_skips: int
    predicted_speedup: float | None = None
    loop_efficiency: float | None = None


def drafters_of(target: PreTrainedModel, drafter: str | None = None) -> dict[str, Drafter]:
    """The drafters `run_core_benchmark` times with `target`: "slice", a one-layer slice of it, and
    "feature", the feature drafter saved at `drafter`, else an untrained one-layer one."""
    feature_drafter = derive_feature_drafter(target, 1) if drafter is None else load_drafter(drafter, target)
    return {"slice": derive_drafter(target, 1), "feature": feature_drafter}


def methods(
    target: PreTrainedModel,
    gamma: int,
    new_tokens: int,
    batch_size: int,
    drafters: Mapping[str, Drafter],
    capacity: int | None = None,
    *,
    cores: Sequence[str] = tuple(CORES),
    auto: Mapping[str, AdaptiveGamma] | None = None,
    eos: Sequence[int] = (),
    prompt_lookup: PromptLookup | None = None,
    **sampling: Any,
) -> dict[str, Generate]:
    """A group's methods by name, in the order they run: on each of `cores`, the target alone, ours
    with each of `drafters` at `gamma` and with each of `auto`'s adaptive gammas; then, at batch 1
    and greedy, transformers assisted generation with each causal-LM drafter."""
    decode = sampling | dict(max_new_tokens=new_tokens, eos_token_ids=list(eos))
    found: dict[str, Generate] = {}
    for core in cores:
        options = decode | CORES[core] | ({"capacity": capacity} if CORES[core]["static"] and capacity else {})
        found[f"target alone, {core}"] = functools.partial(_run, autoregressive_generate, target, **options)
        ours = functools.partial(_run, speculative_generate, target, prompt_lookup=prompt_lookup, **options)
        for name, drafter in drafters.items():
            found[f"ours ({name}), {core}"] = functools.partial(ours, drafter, gamma=gamma)
        for name, adaptive in (auto or {}).items():
            found[f"ours ({name}), gamma auto, {core}"] = functools.partial(ours, drafters[name], gamma=adaptive)
    if batch_size == 1 and not sampling.get("temperature"):
        for name, drafter in drafters.items():
            if isinstance(drafter, PreTrainedModel):  # not a feature drafter: transformers cannot run those
                found[f"transformers assisted ({name})"] = functools.partial(
                    _run, assisted_generate, target, drafter, gamma=gamma, new_tokens=new_tokens, eos=eos
                )
    return found


def data_writers(target: PreTrainedModel, new_tokens: int) -> dict[str, Generate]:
    """The training-data writer on each core: the target alone keeping its last layer's features."""
    budget = dict(max_new_tokens=new_tokens, eos_token_ids=[], feature_layers=(-1,))
    return {
        f"data writer, {core}": functools.partial(_run, autoregressive_generate, target, **options, **budget)
        for core, options in CORES.items()
    }


def _run(
    generate: Callable[..., GenerationResult], target: PreTrainedModel, *args: Any, **options: Any
) -> GenerationResult:
    """`generate(target, *args, **options)`, its wall time taken to the end of its device work."""
    start = time.perf_counter()
    result = generate(target, *args, **options)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_s = result.stats.generated_tokens / seconds if seconds > 0 else 0.0
    return replace(result, stats=replace(result.stats, wall_time_s=seconds, tokens_per_s=tokens_per_s))


def assisted_generate(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    prompts: list[list[int]],
    gamma: int,
    new_tokens: int,
    eos: Sequence[int] = (),
) -> GenerationResult:
    """transformers assisted generation of one prompt, greedy, at a fixed gamma (no counts kept; `_run` times it)."""
    (prompt,) = prompts
    drafter.generation_config = copy.deepcopy(drafter.generation_config)
    drafter.generation_config.num_assistant_tokens = gamma
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    input_ids = torch.tensor([prompt], device=target.device)
    out = target.generate(  # type: ignore[operator]  # transformers types `generate` through nn.Module's __getattr__
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        assistant_model=drafter,
        max_new_tokens=new_tokens,
        # no `eos`: the whole budget, as the other methods decode (the target's own EOS stops none of them)
        min_new_tokens=None if eos else new_tokens,
        do_sample=False,
        eos_token_id=list(eos) or None,
        pad_token_id=eos[0] if eos else 0,
    )
    return GenerationResult.build([out[0, len(prompt) :].tolist()], StepCounters(0, target.device), 0.0)


def method_names() -> list[str]:
    """Every method `run_core_benchmark` times, by name (`methods` and `data_writers`)."""
    names = [f"{who}, {core}" for core in CORES for who in ("target alone", "ours (slice)", "ours (feature)")]
    return [*names, "transformers assisted (slice)", *(f"data writer, {core}" for core in CORES)]


def check_only(words: Sequence[str]) -> None:
    """Raises ValueError naming a word of `only` that is in no method's name."""
    for word in words:
        if not any(word in name for name in method_names()):
            raise ValueError(f"only: {word!r} is in no method's name; the methods: {'; '.join(method_names())}")


def exact_match(rows: Sequence[list[int]], reference: Sequence[list[int]]) -> float:
    """The share of rows equal to their reference row."""
    return sum(a == b for a, b in zip(rows, reference, strict=True)) / len(reference)


def agreement(rows: Sequence[list[int]], reference: Sequence[list[int]]) -> float:
    """The mean share of each reference row that a row matches before its first difference."""
    shares = []
    for row, ref in zip(rows, reference, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), min(len(row), len(ref)))
        shares.append(same / len(ref) if ref else float(row == ref))
    return statistics.mean(shares)


def reference_of(method: str) -> str:
    """Whose greedy tokens a method's must equal: for ours, the target alone on the same core (in bf16
    a compiled pass rounds otherwise); for the data writer, the eager writer; else the target alone, eager."""
    core = method.rpartition(", ")[2]
    if method.startswith("ours"):
        return f"target alone, {core}"
    return "data writer, eager" if method.startswith("data writer") else "target alone, eager"


def time_group(
    found: Mapping[str, Generate],
    prompts: list[list[int]],
    batch_size: int,
    rounds: int,
    progress: Callable[[str], None] = lambda line: None,
    deadline: float = math.inf,
    reference: Callable[[str], str] = reference_of,
) -> dict[str, dict[str, Any]]:
    """Every method on `prompts` in batches of `batch_size`, a first call each, then `rounds` rounds of
    `run_interleaved`: name → `Row`'s measured fields against `reference(name)`. Nothing new starts
    past `deadline`."""
    first: dict[str, RunRecord] = {}
    skips: dict[str, int] = {}
    for name, method in found.items():
        if time.perf_counter() > deadline:
            progress(f"  {name}: not timed, past the time limit")
            continue
        before = cudagraph_skips()
        first[name] = run_batched(method, prompts, batch_size)
        skips[name] = cudagraph_skips() - before
        skipped = f", {skips[name]} compiled graphs not captured as CUDA graphs" if skips[name] else ""
        progress(f"  first call of {name}: {first[name].seconds:.1f} s{skipped}")
    timed: list[dict[str, RunRecord]] = []
    for done in range(rounds):
        if done and time.perf_counter() > deadline:
            progress(f"  {done} of {rounds} rounds: past the time limit")
            break
        timed.append(run_interleaved({name: found[name] for name in first}, prompts, batch_size, first=done))
    measured: dict[str, dict[str, Any]] = {}
    for name, record in first.items():
        steps: Counter[int] = Counter()
        for result in record.results:
            steps.update(result.stats.gamma_steps)
        measured[name] = rates(record.counts(None)) | {
            "first_call_s": record.seconds,
            "tokens_per_s": statistics.median(r[name].tokens / r[name].seconds for r in timed or [first]),
            "gamma_steps": {str(g): n for g, n in sorted(steps.items())},  # JSON keys
            "cudagraph_skips": skips[name],
        }
    for name, row in measured.items():
        other = reference(name)
        if other not in first:  # not timed in this group: nothing to compare with
            row |= {"speedup": None, "exact_match": None, "agreement": None}
            continue
        rows, expected = first[name].sequences, first[other].sequences
        row |= {
            "speedup": row["tokens_per_s"] / measured[other]["tokens_per_s"],
            "exact_match": exact_match(rows, expected),
            "agreement": agreement(rows, expected),
        }
    return measured


def cudagraph_skips() -> int:
    """How many compiled graphs inductor has run without CUDA graphs so far (zero off CUDA)."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
