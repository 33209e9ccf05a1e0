"""Fine-tune a drafter on domain text: `accelerate launch train/finetune.py data=math`
(or plain `python train/finetune.py experiment=smoke`); see conf/finetune.yaml."""

import hydra
from omegaconf import DictConfig, OmegaConf

from specdecode.pipeline.schemas import register_schemas
from specdecode.training.job import run_finetune

# conf/*.yaml list their schema (the dataclass) first; Hydra finds it in the ConfigStore.
register_schemas()


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune")
def main(cfg: DictConfig) -> None:
    run_finetune(OmegaConf.to_object(cfg))


if __name__ == "__main__":
    main()
