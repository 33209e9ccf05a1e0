"""The main job on the embedded default (`make demo`): benchmark, distill, route, evaluate."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.core.config import from_dict
from specdecode.pipeline.demo import DemoConfig, run_demo


@hydra.main(version_base="1.3", config_path="../conf", config_name="demo")
def main(cfg: DictConfig) -> None:
    root = run_demo(from_dict(DemoConfig, OmegaConf.to_container(cfg, resolve=True)))
    print((root / "report.md").read_text())


if __name__ == "__main__":
    main()
