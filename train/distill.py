"""Distil a drafter from the target: `accelerate launch train/distill.py data=code loss=tvd`
(or plain `python train/distill.py experiment=smoke`); see conf/distill.yaml."""

from specdecode.pipeline.cli import run_hydra_app

if __name__ == "__main__":
    run_hydra_app("train")
