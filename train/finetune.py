"""Fine-tune a drafter on domain text: `accelerate launch train/finetune.py data=math`
(or plain `python train/finetune.py experiment=smoke`); see conf/finetune.yaml."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.core.config import from_dict
from specdecode.training.config import TrainJobConfig
from specdecode.training.job import run_finetune


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune")
def main(cfg: DictConfig) -> None:
    run_finetune(from_dict(TrainJobConfig, OmegaConf.to_container(cfg, resolve=True)))


if __name__ == "__main__":
    main()
