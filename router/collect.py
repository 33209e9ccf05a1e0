"""Label prompts for the router: `python router/collect.py` (see conf/collect.yaml), or in seconds on
tiny in-process models: `python router/collect.py --config-name collect_smoke`."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.pipeline.schemas import register_schemas
from specdecode.routing.collect import run_collect

# conf/*.yaml list their schema (the dataclass) first; Hydra finds it in the ConfigStore.
register_schemas()


@hydra.main(version_base="1.3", config_path="../conf", config_name="collect")
def main(cfg: DictConfig) -> None:
    run_collect(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
