"""The decode-core benchmark (eval/benchmark_gpu.py) on a tiny random target, its eager and static
cores only (compiling takes minutes on a CPU; `make benchmark-gpu` runs it all on a GPU)."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import LlamaForCausalLM

import specdecode.evaluation.benchmark_methods
from specdecode.decoding.stats import GenerationResult, StepCounters
from specdecode.evaluation.benchmark import run_core_benchmark
from specdecode.evaluation.benchmark_methods import (
    CORES,
    DEFAULT_METHODS,
    agreement,
    drafters_of,
    exact_match,
    method_names,
    methods,
    reference_of,
    time_group,
)
from specdecode.evaluation.benchmark_report import benchmark_results, report_markdown
from specdecode.evaluation.benchmark_targets import llama_1b_shape
from specdecode.evaluation.profiling import host_profile
from tests.models_for_tests import tiny_llama


def timed(rows: list[list[int]], seconds: float) -> GenerationResult:
    """A decode's result of `rows` in `seconds`, with no counts."""
    return GenerationResult.build(rows, StepCounters(0, torch.device("cpu")), seconds)


def test_the_benchmark_runs_every_method_and_reports_exact_rows() -> None:
    rows = run_core_benchmark(
        "tiny",
        "cpu",
        dtypes=("float32",),
        batch_sizes=(1, 3),
        gamma=2,
        new_tokens=4,
        prompts_at_batch_1=1,
        rounds=1,
        writer_batch=4,
        writer_tokens=3,
        only=("eager", "static", "transformers"),
        progress=lambda line: None,
    )
    methods = {(r.batch_size, r.method) for r in rows}
    for core in ("eager", "static"):
        assert {
            (1, f"target alone, {core}"),
            (3, f"ours (slice), {core}"),
            (3, f"ours (feature), {core}"),
            (4, f"data writer, {core}"),
        } <= methods
    assert (1, "transformers assisted (slice)") in methods and (3, "transformers assisted (slice)") not in methods
    assert all(r.tokens_per_s > 0 and r.exact_match == 1.0 and r.agreement == 1.0 for r in rows)
    assert "| tiny | float32 | 3 | ours (slice), static |" in report_markdown(benchmark_results(rows, "cpu"))


def test_profile_prints_where_each_method_spends_its_time() -> None:
    lines: list[str] = []
    run_core_benchmark(
        "tiny",
        "cpu",
        ("float32",),
        (1,),
        2,
        4,
        1,
        1,
        writer_batch=2,
        writer_tokens=3,
        only=("target alone, static", "data writer, static"),
        progress=lines.append,
        profile=True,
    )
    profiles = [line for line in lines if line.lstrip().startswith("profile of")]
    # the data writer's group first (one compiled shape), then the decode groups
    assert [line.split(":")[0].strip() for line in profiles] == [
        "profile of data writer, static",
        "profile of target alone, static",
    ]
    assert all("kernels busy" in line and "per token" in line for line in profiles)
    hosts = [line for line in lines if line.lstrip().startswith("host of")]
    assert len(hosts) == 2 and all("ms per token under cProfile; own time per token: " in line for line in hosts)
    # each group's rows are printed before its profiles, which may fail or run out of time
    for row, profile in (("2 | data writer, static", profiles[0]), ("1 | target alone, static", profiles[1])):
        printed = next(i for i, line in enumerate(lines) if line.startswith(f"| tiny | float32 | {row} |"))
        assert printed < lines.index(profile)


def test_agreement_is_the_share_before_the_first_difference() -> None:
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    rows = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]]
    assert exact_match(rows, reference) == 1 / 3
    assert agreement(rows, reference) == (1 + 0.5 + 0) / 3
    assert agreement([[1, 2]], [[1, 2, 3, 4]]) == 0.5  # a row that stops early agrees up to its end


def test_the_lease_methods_are_methods_the_benchmark_has() -> None:
    target = tiny_llama(2, seed=0)
    names = set(methods(target, gamma=2, new_tokens=4, batch_size=1, drafters=drafters_of(target))) | {
        f"data writer, {core}" for core in CORES
    }
    assert set(DEFAULT_METHODS) <= names
    assert set(method_names()) == names


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(only=["target alone", "compild"]), "'compild' is in no method's name"),
        (dict(dtypes=["fp8"]), "fp8"),
        (dict(time_limit_s=0), "time_limit_s must be positive, got 0"),
        (dict(time_limit_s=float("nan")), "time_limit_s must be positive, got nan"),
    ],
)
def test_bad_methods_and_dtypes_are_named_before_any_work(kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        run_core_benchmark("tiny", "cpu", progress=lambda line: pytest.fail(f"work started: {line}"), **kwargs)


def test_past_the_time_limit_no_method_or_round_starts_and_what_was_timed_is_reported(monkeypatch) -> None:
    """A lease ends at a fixed time: the methods timed by then are reported, from one round at least.
    Each call takes 0.05 s of a fake clock; the limit is at 0.07 s."""
    clock, calls = [0.0], []
    monkeypatch.setattr(specdecode.evaluation.benchmark_methods.time, "perf_counter", lambda: clock[0])

    def slow(name: str):
        def method(batch):
            calls.append(name)
            clock[0] += 0.05
            return timed([[1, 2, 3]], 0.05)

        return method

    found = {name: slow(name) for name in ("target alone, eager", "ours (slice), eager", "target alone, static")}
    lines: list[str] = []
    measured = time_group(found, [[1]], 1, rounds=3, progress=lines.append, deadline=0.07)
    assert list(measured) == ["target alone, eager", "ours (slice), eager"]
    assert calls == ["target alone, eager", "ours (slice), eager"] * 2
    assert (
        measured["ours (slice), eager"]["exact_match"] == 1.0 and measured["ours (slice), eager"]["tokens_per_s"] == 60
    )
    assert "  target alone, static: not timed, past the time limit" in lines
    assert "  1 of 3 rounds: past the time limit" in lines


def test_a_failed_host_profile_leaves_no_profiler_running() -> None:
    def failing():
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        host_profile(failing)
    assert sys.getprofile() is None  # later timings would run under cProfile


def test_past_the_time_limit_no_target_is_built() -> None:
    lines: list[str] = []
    rows = run_core_benchmark("tiny", "cpu", ("float32", "bfloat16"), time_limit_s=1e-9, progress=lines.append)
    assert rows == [] and lines == [f"tiny in {d}: not timed, past the time limit" for d in ("float32", "bfloat16")]


def test_a_method_whose_reference_was_not_timed_reports_no_match() -> None:
    found = {"ours (slice), compiled": lambda batch: timed([[1, 2]], 1.0)}
    measured = time_group(found, [[1]], 1, rounds=1)["ours (slice), compiled"]
    assert measured["exact_match"] is None and measured["agreement"] is None


def test_exact_match_compares_like_with_like() -> None:
    assert reference_of("ours (feature), compiled") == "target alone, compiled"
    assert reference_of("target alone, compiled") == "target alone, eager"
    assert reference_of("transformers assisted (slice)") == "target alone, eager"
    assert reference_of("data writer, static") == "data writer, eager"


def test_the_timing_model_has_llama_3_2_1b_shape() -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_1b_shape())
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 1.24  # tied embeddings counted once


def test_the_static_cores_decode_every_prompt_of_a_group_at_one_capacity(monkeypatch) -> None:
    """Prompts of other lengths share one cache capacity, so a compiled method compiles one shape."""
    seen = []

    def spying(real):
        def run(*args, **kwargs):
            seen.append((kwargs.get("static", False), kwargs.get("capacity")))
            return real(*args, **kwargs)

        return run

    module = specdecode.evaluation.benchmark_methods
    for name in ("autoregressive_generate", "speculative_generate"):
        monkeypatch.setattr(module, name, spying(getattr(module, name)))
    run_core_benchmark(
        "tiny", "cpu", dtypes=("float32",), batch_sizes=(1,), gamma=2, new_tokens=4, prompts_at_batch_1=3,
        rounds=1, writer_batch=0, only=("eager", "static"), progress=lambda line: None,
    )  # fmt: skip
    assert {capacity for static, capacity in seen if static} == {128}  # up to 96 + 4 + 2 + 2 slots
    assert {capacity for static, capacity in seen if not static} == {None}


def test_with_no_rounds_the_first_call_is_timed_and_speedup_is_over_the_reference() -> None:
    found = {
        "target alone, eager": lambda batch: timed([[1, 2]], 1.0),
        "ours (slice), eager": lambda batch: timed([[1, 2]], 0.5),
    }
    measured = time_group(found, [[1], [2]], 1, rounds=0)
    assert measured["target alone, eager"]["tokens_per_s"] == 2.0 and measured["target alone, eager"]["speedup"] == 1.0
    assert measured["ours (slice), eager"]["speedup"] == 2.0 and measured["ours (slice), eager"]["first_call_s"] == 1.0
