"""Callbacks that are right under distribution."""

from keras_dist.callbacks._backup_and_restore import BackupAndRestore
from keras_dist.callbacks._lookup import latest_checkpoint, load_checkpoint
from keras_dist.callbacks._lr_scheduler import LearningRateScheduler
from keras_dist.callbacks._model_checkpoint import ModelCheckpoint
from keras_dist.callbacks._print_lr import PrintLR
from keras_dist.callbacks._sidecar_evaluator import SidecarEvaluator
from keras_dist.callbacks._warmup import LearningRateWarmup

__all__ = [
    "BackupAndRestore",
    "LearningRateScheduler",
    "LearningRateWarmup",
    "ModelCheckpoint",
    "PrintLR",
    "SidecarEvaluator",
    "latest_checkpoint",
    "load_checkpoint",
]
