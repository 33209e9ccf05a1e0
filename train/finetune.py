"""Fine-tune a drafter on domain text: `accelerate launch train/finetune.py data=math`
(or plain `python train/finetune.py experiment=smoke`); see conf/finetune.yaml."""

from specdecode.pipeline.cli import run_hydra_app

if __name__ == "__main__":
    run_hydra_app("finetune")
