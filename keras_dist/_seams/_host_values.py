"""Seam 7: a variable split over several processes reads back whole.

`KerasVariable.__array__` (behind `get_weights`, `numpy()`, `save_weights`,
`.keras` files) asks the jax.Array for its value, which JAX refuses when the
array has parts on another process's devices (FSDP or a partitioner under
`MultiWorkerMirroredStrategy` / `ParameterServerStrategy`). For such a value
every process gathers the parts to the host (`process_allgather`: a
collective, so every process reads the same variables in the same order, as
SPMD programs and keras_dist's `ModelCheckpoint` do).
"""

import functools
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from keras_dist._private_api._wrapped import marked

__all__ = ["_array"]


def _array(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(variable, dtype=None, *args, **kwargs):
        value = variable.value
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            whole = multihost_utils.process_allgather(value, tiled=True)
            return np.asarray(whole, dtype=dtype)
        return method(variable, dtype, *args, **kwargs)

    marked(wrapper, method)
    return wrapper
