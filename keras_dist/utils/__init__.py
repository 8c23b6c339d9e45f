"""Utilities: measuring a distributed `fit`."""

from keras_dist.utils._scaling_report import ScalingReport

__all__ = ["ScalingReport"]
