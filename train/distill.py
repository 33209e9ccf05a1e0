"""Distil a drafter from the target: `accelerate launch train/distill.py data=code loss=tvd`
(or plain `python train/distill.py experiment=smoke`); see conf/distill.yaml."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.core.config import from_dict
from specdecode.training.config import TrainJobConfig
from specdecode.training.job import run_distill


@hydra.main(version_base="1.3", config_path="../conf", config_name="distill")
def main(cfg: DictConfig) -> None:
    run_distill(from_dict(TrainJobConfig, OmegaConf.to_container(cfg, resolve=True)))


if __name__ == "__main__":
    main()
