"""Decode benchmark on the embedded default: `python eval/benchmark.py [overrides]` (run by `make demo`)."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.evaluation.benchmark import report_markdown, run_benchmark
from specdecode.pipeline.schemas import register_schemas

# conf/*.yaml list their schema (the dataclass) first; Hydra finds it in the ConfigStore.
register_schemas()


@hydra.main(version_base="1.3", config_path="../conf", config_name="benchmark")
def main(cfg: DictConfig) -> None:
    results = run_benchmark(OmegaConf.to_object(cfg))
    print(report_markdown(results))


if __name__ == "__main__":
    main()
