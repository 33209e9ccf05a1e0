"""Decode benchmark on the embedded default: `python eval/benchmark.py [overrides]` (run by `make demo`)."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.core.config import from_dict
from specdecode.evaluation.benchmark import report_markdown, run_benchmark
from specdecode.evaluation.config import BenchmarkConfig


@hydra.main(version_base="1.3", config_path="../conf", config_name="benchmark")
def main(cfg: DictConfig) -> None:
    results = run_benchmark(from_dict(BenchmarkConfig, OmegaConf.to_container(cfg, resolve=True)))
    print(report_markdown(results))


if __name__ == "__main__":
    main()
