"""Label prompts for the router: `python router/collect.py` (see conf/collect.yaml), or in seconds on
tiny in-process models: `python router/collect.py --config-name collect_smoke`."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.core.config import from_dict
from specdecode.routing.collect import run_collect
from specdecode.routing.config import CollectConfig


@hydra.main(version_base="1.3", config_path="../conf", config_name="collect")
def main(cfg: DictConfig) -> None:
    run_collect(from_dict(CollectConfig, OmegaConf.to_container(cfg, resolve=True)))


if __name__ == "__main__":
    main()
