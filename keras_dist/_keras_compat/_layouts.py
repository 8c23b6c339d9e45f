"""Seam on Keras's JAX `distribute_tensor`: a layout fitted to the tensor.

Keras lays a layer's output out with `distribution.get_tensor_layout(path)`
and `keras.distribution.distribute_tensor(outputs, layout)`; libraries do the
same with their own tensors (keras-hub's `generate`). The hook is handed a
path, not a shape, so a `layout_map` rule for outputs (`"dense/output":
("batch", None)`) meets tensors of every size: inside a compiled function JAX
pads an uneven split, but eagerly (`run_eagerly=True`, `model(x)`) Keras's
`jax.device_put` raises on a dimension the mesh axes do not divide. While a
keras_dist strategy is current, the backend's `distribute_tensor` (which the
public function and variables call) gets the layout fitted to the tensor's
shape first (`strategies/devices/_any_shape.py`); otherwise it is Keras's own.
"""

from typing import Any

import keras
import numpy as np

from keras_dist._keras_compat._state import originals as _originals
from keras_dist._keras_compat._wrapped import marked
from keras_dist.strategies._base import Strategy
from keras_dist.strategies.devices._any_shape import fit_layout

__all__ = ["distribute_tensor"]


def _distribute_tensor(tensor: Any, layout: Any) -> Any:
    original = _originals["distribute_tensor"]
    if isinstance(layout, keras.distribution.TensorLayout) and isinstance(
        keras.distribution.distribution(), Strategy
    ):
        layout = fit_layout(layout, np.shape(tensor))
    return original(tensor, layout)


def distribute_tensor(original: Any) -> Any:
    """The wrapper installed in place of Keras's `distribute_tensor`."""
    return marked(_distribute_tensor, original)
