"""Decode benchmark on the embedded default: `python eval/benchmark.py [overrides]` (run by `make demo`)."""

from specdecode.pipeline.cli import run_hydra_app

if __name__ == "__main__":
    run_hydra_app("benchmark")
