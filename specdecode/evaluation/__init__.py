"""Evaluation: the decode benchmark, the suite over domains, drafters and settings, and their reports."""

from specdecode.evaluation.benchmark import run_benchmark
from specdecode.evaluation.config import BenchmarkConfig, EvalConfig
from specdecode.evaluation.report import merge_results, write_report
from specdecode.evaluation.suite import run_eval

__all__ = ["BenchmarkConfig", "EvalConfig", "merge_results", "run_benchmark", "run_eval", "write_report"]
