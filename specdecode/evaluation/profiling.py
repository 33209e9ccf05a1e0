"""Where a decode call's time goes: one call under `torch.profiler` (the device) and one under
`cProfile` (the host), printed per method by `run_core_benchmark --profile`."""

from __future__ import annotations

import cProfile
import functools
import math
import pstats
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from specdecode.decoding.stats import GenerationResult

# One decode call.
Run = Callable[[], GenerationResult]


def profile_call(run: Run) -> str:
    """One call of `run` under `torch.profiler`: kernels busy, kernels and replays per token, top kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        result = run()
    tokens, seconds = max(result.stats.generated_tokens, 1), result.stats.wall_time_s
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    launches = sum(e.count for e in kernels)
    replays = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:3]
    named = "; ".join(f"{e.key[:48]} {e.self_device_time_total / 1e3:.1f} ms x{e.count}" for e in top)
    return (
        f"{seconds:.3f} s, kernels busy {busy / seconds:.0%}, {launches / tokens:.0f} kernels and "
        f"{replays / tokens:.2f} graph replays per token; top: {named or 'none (no CUDA)'}"
    )


def host_profile(run: Run, top: int = 5) -> str:
    """One call of `run` under `cProfile`: the host's time per token and the functions that spent most of it."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        result = run()
    finally:  # a failed call must not leave every later one profiled
        profiler.disable()
    tokens, seconds = max(result.stats.generated_tokens, 1), result.stats.wall_time_s
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # pstats has no public table; {(file, line, function): (calls, _, own seconds, cumulative, _)}
    ranked = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    named = "; ".join(
        f"{Path(file).name}:{line}({function}) {own / tokens * 1e3:.3f} ms"
        for (file, line, function), (_, _, own, _, _) in ranked
    )
    return f"{seconds / tokens * 1e3:.3f} ms per token under cProfile; own time per token: {named}"


def profile_group(
    methods: Mapping[str, Callable[[list[list[int]]], GenerationResult]],
    batch: list[list[int]],
    progress: Callable[[str], None],
    deadline: float = math.inf,
) -> None:
    """`profile_call` and `host_profile` of each of `methods` on `batch`, printed, until `deadline`."""
    for name, method in methods.items():
        if time.perf_counter() > deadline:
            progress(f"  profile of {name}: not run, past the time limit")
            continue
        try:
            progress(f"  profile of {name}: {profile_call(functools.partial(method, batch))}")
            progress(f"  host of {name}: {host_profile(functools.partial(method, batch))}")
        except Exception as error:  # a diagnostic: its failure must not end the benchmark
            progress(f"  profile of {name} failed: {error!r}")
