"""Drafter training (train/distill.py, train/finetune.py): distillation losses, the training
sequences and the teacher store of the target's outputs on them (or the target scoring them in the
step), the accelerate loop, checkpoints, and the jobs that tie them together."""

from specdecode.training.config import LossConfig, TrainConfig, TrainJobConfig
from specdecode.training.job import run_distill, run_finetune
from specdecode.training.losses import LOSSES, expected_acceptance, get_loss
from specdecode.training.sequences import TrainSequence
from specdecode.training.store import TeacherStore, read_store
from specdecode.training.teacher import TeacherCache, load_cache, save_cache

__all__ = [
    "LOSSES",
    "LossConfig",
    "TeacherCache",
    "TeacherStore",
    "TrainConfig",
    "TrainJobConfig",
    "TrainSequence",
    "expected_acceptance",
    "get_loss",
    "load_cache",
    "read_store",
    "run_distill",
    "run_finetune",
    "save_cache",
]
