"""The main job on the embedded default (`make demo`): benchmark, distill, route, evaluate."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.pipeline.demo import run_demo
from specdecode.pipeline.schemas import register_schemas

# conf/*.yaml list their schema (the dataclass) first; Hydra finds it in the ConfigStore.
register_schemas()


@hydra.main(version_base="1.3", config_path="../conf", config_name="demo")
def main(cfg: DictConfig) -> None:
    root = run_demo(OmegaConf.to_object(cfg))
    print((root / "report.md").read_text())


if __name__ == "__main__":
    main()
