"""Fit the router on collected labels and report on held-out prompts: `python router/fit.py`
(see conf/fit_router.yaml), or the smoke run: `python router/fit.py --config-name fit_router_smoke`."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.pipeline.schemas import register_schemas
from specdecode.routing.fit import run_fit

# conf/*.yaml list their schema (the dataclass) first; Hydra finds it in the ConfigStore.
register_schemas()


@hydra.main(version_base="1.3", config_path="../conf", config_name="fit_router")
def main(cfg: DictConfig) -> None:
    run_fit(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
