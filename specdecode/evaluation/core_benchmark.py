"""The decode cores side by side: eager, static, compiled; target alone, ours, transformers assisted.

One run times, per (target, dtype, batch size) group, every method on the same prompts, the
methods interleaved round by round (A, B, C, A, B, C, ...) so that a shared or throttled machine
slows them alike, and reports each method's median tokens/s, its first call's seconds (where a
compiled method pays for compiling each of its shapes), its exact-match rate (the share of rows
whose greedy tokens equal the target alone's in the same dtype and batch shape, on the same core:
`reference_of`) and its agreement (the mean share of a row's tokens before its first difference:
in bf16 a near-tie flips a long row somewhere, and this says how far in). The training-data writer
(`autoregressive_generate(feature_layers=...)`) is timed at its own batch size.

Targets: `core_targets.TARGETS`. Drafters are built from the target: a one-layer slice (ours and
transformers assisted share it) and an untrained one-layer feature drafter. Their acceptance is not
the point; the cost of the loop around them is.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from specdecode.decoding.decode import autoregressive_generate, speculative_generate
from specdecode.decoding.static_cache import static_capacity
from specdecode.decoding.stats import GenerationResult
from specdecode.decoding.timing import CORES, StepCosts, core_step_costs
from specdecode.evaluation.benchmark import assisted_generate
from specdecode.evaluation.core_targets import build_target
from specdecode.evaluation.profiling import host_profile, profile_call
from specdecode.models.drafters import derive_drafter
from specdecode.models.feature_drafter import FeatureDrafter, derive_feature_drafter
from specdecode.models.loading import load_drafter, resolve_dtype

# The methods timed unless asked for more (`eval/benchmark_gpu.py`'s default `--only`): each compiled
# method first compiles for 64-86 s in bf16 on an H200, so every core of every method takes long.
DEFAULT_METHODS = (
    "target alone, eager",
    "target alone, compiled",
    "ours (slice), compiled",
    "ours (feature), compiled",
    "transformers assisted (slice)",
    "data writer, eager",
    "data writer, compiled",
)


@dataclass
class Row:
    """One method of one group: median tokens/s over the rounds, the first (compiling) call's
    seconds, the exact-match rate and the agreement (against `reference_of(method)`; None where
    that method was not timed in the group), the realised alpha, and how many of its graphs were
    compiled without CUDA graphs (`cudagraph_skips`)."""

    target: str
    dtype: str
    batch_size: int
    method: str
    tokens_per_s: float
    first_call_s: float
    exact_match: float | None
    alpha: float | None
    agreement: float | None
    cudagraph_skips: int


# A method decodes a batch of prompts greedily: (sequences, seconds, alpha or None).
Method = Callable[[list[list[int]]], tuple[list[list[int]], float, float | None]]


def drafters_of(target: PreTrainedModel, drafter: str | None = None) -> dict[str, PreTrainedModel | FeatureDrafter]:
    """The drafters the benchmark times with `target`: "slice", a one-layer slice of it (ours and
    transformers assisted share it), and "feature", the saved feature drafter at `drafter`, else an
    untrained one-layer one."""
    feature_drafter = derive_feature_drafter(target, 1) if drafter is None else load_drafter(drafter, target)
    return {"slice": derive_drafter(target, 1), "feature": feature_drafter}


def methods(
    target: PreTrainedModel,
    gamma: int,
    new_tokens: int,
    batch_size: int,
    drafters: dict[str, PreTrainedModel | FeatureDrafter],
    capacity: int | None = None,
) -> dict[str, Method]:
    """The methods of a group, by name: the target alone and ours with each of `drafters`
    (`drafters_of`) on each core, the static cores' caches of `capacity` slots (one compiled shape
    for prompts of any length); transformers assisted generation with the slice drafter at batch 1."""
    decode: dict[str, Any] = dict(max_new_tokens=new_tokens, eos_token_ids=[])

    def timed(call: Callable[[], GenerationResult]) -> tuple[list[list[int]], float, float | None]:
        start = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - start
        return result.sequences, seconds, result.stats.alpha

    def alone(options: dict[str, Any]) -> Method:
        return lambda p: timed(lambda: autoregressive_generate(target, p, **decode, **options))

    def ours(options: dict[str, Any], drafter: PreTrainedModel | FeatureDrafter) -> Method:
        return lambda p: timed(
            lambda: speculative_generate(target, drafter, p, gamma=gamma, prompt_lookup=None, **decode, **options)
        )

    found: dict[str, Method] = {}
    for core, core_options in CORES.items():
        options: dict[str, Any] = core_options | ({"capacity": capacity} if core_options["static"] and capacity else {})
        found[f"target alone, {core}"] = alone(options)
        for kind, drafter in drafters.items():
            found[f"ours ({kind}), {core}"] = ours(options, drafter)
    if batch_size == 1 and isinstance(slice_drafter := drafters["slice"], PreTrainedModel):
        found["transformers assisted (slice)"] = lambda p: hf_assisted(target, slice_drafter, p[0], gamma, new_tokens)
    return found


def method_names() -> list[str]:
    """Every method the benchmark times, by name (`methods` and the data writer)."""
    names = [f"{who}, {core}" for core in CORES for who in ("target alone", "ours (slice)", "ours (feature)")]
    return [*names, "transformers assisted (slice)", *(f"data writer, {core}" for core in CORES)]


def check_only(words: Sequence[str]) -> None:
    """Raises ValueError naming a word of `only` that is in no method's name."""
    for word in words:
        if not any(word in name for name in method_names()):
            raise ValueError(f"only: {word!r} is in no method's name; the methods: {'; '.join(method_names())}")


def hf_assisted(
    target: PreTrainedModel, drafter: PreTrainedModel, prompt: list[int], gamma: int, new_tokens: int
) -> tuple[list[list[int]], float, None]:
    """transformers assisted generation of exactly `new_tokens` (no EOS stop), as `timed` returns a run."""
    tokens, seconds = assisted_generate(target, drafter, prompt, gamma, new_tokens, [], min_new_tokens=new_tokens)
    return [tokens], seconds, None


def time_group(
    found: dict[str, Method],
    batches: Sequence[list[list[int]]],
    rounds: int,
    progress: Callable[[str], None] = lambda line: None,
    deadline: float = math.inf,
) -> dict[str, dict]:
    """Every method over every batch of prompts, round after round, methods interleaved within a
    round; a first untimed-for-throughput call per method pays its compiling. Past `deadline` (a
    `time.perf_counter()` time) no method starts its first call and no round starts after the
    first: the methods timed so far are reported, each from at least one round."""
    first: dict[str, float] = {}
    skips: dict[str, int] = {}
    outputs: dict[str, list[list[int]]] = {}
    alphas: dict[str, float | None] = {}
    for name, method in found.items():
        if time.perf_counter() > deadline:
            progress(f"  {name}: not timed, past the time limit")
            continue
        before = cudagraph_skips()
        sequences, seconds, alpha = zip(*(method(batch) for batch in batches))
        first[name], skips[name] = sum(seconds), cudagraph_skips() - before
        skipped = f", {skips[name]} compiled graphs not captured as CUDA graphs" if skips[name] else ""
        progress(f"  first call of {name}: {first[name]:.1f} s{skipped}")
        outputs[name] = [row for rows in sequences for row in rows]
        alphas[name] = statistics.mean(alpha) if all(a is not None for a in alpha) else None
    if not first:
        return {}
    speeds: dict[str, list[float]] = {name: [] for name in first}
    for done in range(rounds):
        if done and time.perf_counter() > deadline:
            progress(f"  {done} of {rounds} rounds: past the time limit")
            break
        for name in first:
            runs = [found[name](batch) for batch in batches]
            tokens = sum(len(row) for sequences, _, _ in runs for row in sequences)
            speeds[name].append(tokens / sum(seconds for _, seconds, _ in runs))

    def compared(name: str) -> dict[str, float | None]:
        reference = outputs.get(reference_of(name))
        if reference is None:  # not timed in this group: nothing to compare with
            return {"exact_match": None, "agreement": None}
        return {"exact_match": exact_match(outputs[name], reference), "agreement": agreement(outputs[name], reference)}

    return {
        name: {
            "tokens_per_s": statistics.median(speeds[name]),
            "first_call_s": first[name],
            "alpha": alphas[name],
            **compared(name),
            "cudagraph_skips": skips[name],
        }
        for name in first
    }


def profile_group(
    found: dict[str, Method], batch: list[list[int]], progress: Callable[[str], None], deadline: float = math.inf
) -> None:
    """`profile_call` of each method on `batch`, printed, until `deadline`; run after the group's
    rows are printed, so that a profile that fails or runs out of time loses no timing."""
    for name, method in found.items():
        if time.perf_counter() > deadline:
            progress(f"  profile of {name}: not run, past the time limit")
            continue
        try:
            progress(f"  profile of {name}: {profile_call(functools.partial(method, batch))}")
            progress(f"  host of {name}: {host_profile(functools.partial(method, batch))}")
        except Exception as error:  # a diagnostic: its failure must not end the benchmark
            progress(f"  profile of {name} failed: {error!r}")


def cudagraph_skips() -> int:
    """How many compiled graphs inductor has run without CUDA graphs so far (each is launched kernel
    by kernel from the host instead: mutated inputs, CPU tensors, ...; zero off CUDA)."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


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
    """Whose greedy tokens a method's must equal: ours on a core, the target alone on that core (the
    same kernels; in bf16 a compiled pass rounds otherwise than an eager one); the target alone on
    a core, and transformers, the target alone eager; the data writer, the eager writer."""
    core = method.rpartition(", ")[2]
    if method.startswith("ours"):
        return f"target alone, {core}"
    return "data writer, eager" if method.startswith("data writer") else "target alone, eager"


def run_core_benchmark(
    target_name: str,
    device: str,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    batch_sizes: Sequence[int] = (1, 8),
    gamma: int = 4,
    new_tokens: int = 64,
    prompts_at_batch_1: int = 3,
    rounds: int = 3,
    writer_batch: int = 256,
    writer_tokens: int = 64,
    drafter: str | None = None,
    only: Sequence[str] = (),
    progress: Callable[[str], None] = print,
    profile: bool = False,
    time_limit_s: float | None = None,
    step_costs: bool = False,
) -> list[Row]:
    """Per dtype, time the data writer at `writer_batch` (0: not; see the module docstring), then
    every method per batch size. `drafter`: a saved feature drafter of the target to time instead of
    an untrained one; `only`: the methods whose names contain one of these (all when empty);
    `profile`: print where each method's time goes (`profile_call`); `time_limit_s`: start no
    method, round or profile after this many seconds (`time_group`), for a run of fixed length;
    `step_costs`: first print each drafter's step costs on each core (`timing.core_step_costs`:
    c, the verify ratio) at batch 1 after the first prompt."""
    check_only(only)
    for dtype in dtypes:
        resolve_dtype(dtype)  # a bad name fails before any group is timed
    if time_limit_s is not None and not time_limit_s > 0:  # NaN too
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s}")
    deadline = math.inf if time_limit_s is None else time.perf_counter() + time_limit_s
    rows: list[Row] = []
    for dtype in dtypes:
        if time.perf_counter() > deadline:
            progress(f"{target_name} in {dtype}: not timed, past the time limit")
            continue
        target, prompts = build_target(
            target_name, dtype, device, max([*batch_sizes, prompts_at_batch_1, writer_batch])
        )
        progress(f"{target_name} in {dtype} on {device}")
        drafters = drafters_of(target, drafter)
        if step_costs and time.perf_counter() < deadline:
            costs = {kind: core_step_costs(target, d, prompts[0], new_tokens, gamma) for kind, d in drafters.items()}
            progress(f"step costs at gamma {gamma}, batch 1:\n{costs_markdown(costs)}")
        writer: dict[str, Method] = {
            f"data writer, {core}": functools.partial(_writer, target, new_tokens=writer_tokens, options=options)
            for core, options in CORES.items()
        }
        # the data writer first: it compiles one shape, where the decode groups compile several
        groups = [(writer_batch, writer, [prompts[:writer_batch]])] if writer_batch else []
        for batch_size in batch_sizes:
            batches = [[p] for p in prompts[:prompts_at_batch_1]] if batch_size == 1 else [prompts[:batch_size]]
            # one cache capacity for all of the group's prompts: one compiled shape per method
            capacity = static_capacity(max(len(p) for b in batches for p in b) + new_tokens + gamma + 2)
            found = methods(target, gamma, new_tokens, batch_size, drafters, capacity)
            groups.append((batch_size, found, batches))
        for batch_size, found, batches in groups:
            found = {name: m for name, m in found.items() if not only or any(word in name for word in only)}
            for name, measured in time_group(found, batches, rounds, progress, deadline).items():
                rows.append(Row(target_name, dtype, batch_size, name, **measured))
                progress(format_row(rows[-1]))
            if profile:
                profile_group(found, batches[0], progress, deadline)
    return rows


def _writer(
    target: PreTrainedModel, prompts: list[list[int]], new_tokens: int, options: dict
) -> tuple[list[list[int]], float, float | None]:
    start = time.perf_counter()
    result = autoregressive_generate(
        target, prompts, max_new_tokens=new_tokens, eos_token_ids=[], feature_layers=(-1,), **options
    )
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return result.sequences, time.perf_counter() - start, None


def format_row(row: Row) -> str:
    alpha = "" if row.alpha is None else f"{row.alpha:.3f}"
    return (
        f"| {row.target} | {row.dtype} | {row.batch_size} | {row.method} | {row.tokens_per_s:.1f} | "
        f"{row.first_call_s:.1f} | {_share(row.exact_match)} | {_share(row.agreement)} | {alpha} |"
    )


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def report_markdown(rows: Sequence[Row], device: str) -> str:
    header = [
        "| target | dtype | batch | method | tokens/s (median) | first call s | exact | agree | alpha |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return f"device: {device}, torch {torch.__version__}\n\n" + "\n".join(header + [format_row(r) for r in rows])


def rows_as_dicts(rows: Sequence[Row]) -> list[dict]:
    return [asdict(r) for r in rows]


def costs_markdown(costs: dict[str, dict[str, StepCosts]]) -> str:
    """A table of `core_step_costs` per drafter: drafter name → core → costs."""
    lines = [
        "| drafter | core | target step ms | verify ms | drafter step ms | c | verify ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for drafter, by_core in costs.items():
        for core, c in by_core.items():
            lines.append(
                f"| {drafter} | {core} | {c.target_step_s * 1e3:.2f} | {c.target_verify_s * 1e3:.2f} | "
                f"{c.drafter_step_s * 1e3:.2f} | {c.cost_ratio:.3f} | {c.verify_ratio:.2f} |"
            )
    return "\n".join(lines)
