"""Strategies: what the mesh is and where variables live."""

from keras_dist.strategies._base import Strategy
from keras_dist.strategies._mirrored import MirroredStrategy
from keras_dist.strategies._one_device import OneDeviceStrategy

__all__ = ["MirroredStrategy", "OneDeviceStrategy", "Strategy"]
