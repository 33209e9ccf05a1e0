"""Distil a drafter from the target: `accelerate launch train/distill.py data=code loss=tvd`
(or plain `python train/distill.py experiment=smoke`); see conf/distill.yaml."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.pipeline.schemas import register_schemas
from specdecode.training.job import run_distill

# conf/*.yaml list their schema (the dataclass) first; Hydra finds it in the ConfigStore.
register_schemas()


@hydra.main(version_base="1.3", config_path="../conf", config_name="distill")
def main(cfg: DictConfig) -> None:
    run_distill(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
