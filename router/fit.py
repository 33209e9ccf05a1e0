"""Fit the router on collected labels and report on held-out prompts: `python router/fit.py`
(see conf/fit_router.yaml), or the smoke run: `python router/fit.py --config-name fit_router_smoke`."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.core.config import from_dict
from specdecode.routing.config import FitRouterConfig
from specdecode.routing.fit import run_fit


@hydra.main(version_base="1.3", config_path="../conf", config_name="fit_router")
def main(cfg: DictConfig) -> None:
    run_fit(from_dict(FitRouterConfig, OmegaConf.to_container(cfg, resolve=True)))


if __name__ == "__main__":
    main()
