"""tf's variable partitioners: how many shards a variable asks for.

The three classes keep `tf.distribute.experimental.partitioners`' signatures
and numbers (`tensorflow/python/distribute/sharded_variable.py`): calling one
with a shape and a dtype returns the number of partitions per axis, only
`axis` (0 by default) above 1. A strategy turns that request into a layout on
its mesh (`_sharding.py`): JAX splits a dimension over a whole mesh axis, so
the count says *whether* to shard, not into how many parts.
"""

import abc
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from keras_dist._checks import check_int

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
]


class Partitioner(abc.ABC):
    """Base class: `partitioner(shape, dtype, axis=0)` -> partitions per axis.

    Example:

    ```python
    class TwoShards(kd.partitioners.Partitioner):
        def __call__(self, shape, dtype, axis=0):
            partitions = [1] * len(shape)
            partitions[axis] = 2 if shape[axis] >= 1024 else 1
            return partitions

    strategy = kd.ParameterServerStrategy(variable_partitioner=TwoShards())
    ```
    """

    @abc.abstractmethod
    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        """The number of partitions along each axis of a variable."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k.lstrip('_')}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class FixedShardsPartitioner(Partitioner):
    """Asks for a fixed number of shards (fewer when axis 0 is shorter).

    Example:

    ```python
    kd.partitioners.FixedShardsPartitioner(num_shards=2)((10, 3), "float32")
    # [2, 1]
    ```

    Args:
        num_shards: number of shards, >= 1.

    Raises:
        ValueError: if `num_shards` is not a positive integer.
    """

    def __init__(self, num_shards: int):
        self._num_shards = _positive_int(num_shards, "num_shards")

    @property
    def num_shards(self) -> int:
        return self._num_shards

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        shape = _check_shape(shape, axis)
        result = [1] * len(shape)
        result[axis] = min(self._num_shards, shape[axis])
        return result


class MinSizePartitioner(Partitioner):
    """Asks for as many shards as keep each one at least `min_shard_bytes`.

    Example:

    ```python
    partitioner = kd.partitioners.MinSizePartitioner(min_shard_bytes=4, max_shards=2)
    partitioner((6, 1), "float32")  # [2, 1]
    ```

    Args:
        min_shard_bytes: the smallest shard, in bytes. Defaults to 256 KiB.
        max_shards: the most shards. Defaults to 1.
        bytes_per_string: the size assumed for a string element. Defaults to 16.

    Raises:
        ValueError: if an argument is not a positive integer.
    """

    def __init__(
        self,
        min_shard_bytes: int = 256 << 10,
        max_shards: int = 1,
        bytes_per_string: int = 16,
    ):
        self._min_shard_bytes = _positive_int(min_shard_bytes, "min_shard_bytes")
        self._max_shards = _positive_int(max_shards, "max_shards")
        self._bytes_per_string = _positive_int(bytes_per_string, "bytes_per_string")

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        shape = _check_shape(shape, axis)
        total = math.prod(shape) * _element_bytes(dtype, self._bytes_per_string)
        result = [1] * len(shape)
        result[axis] = max(
            1,
            min(
                shape[axis],
                self._max_shards,
                math.ceil(total / self._min_shard_bytes),
            ),
        )
        return result


class MaxSizePartitioner(Partitioner):
    """Asks for as few shards as keep each one at most `max_shard_bytes`.

    Example:

    ```python
    kd.partitioners.MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32")
    # [6, 1]
    ```

    Args:
        max_shard_bytes: the largest shard, in bytes.
        max_shards: the most shards; takes precedence over `max_shard_bytes`.
            Defaults to `None`: no limit.
        bytes_per_string: the size assumed for a string element. Defaults to 16.

    Raises:
        ValueError: if an argument is not a positive integer.
    """

    def __init__(
        self,
        max_shard_bytes: int,
        max_shards: int | None = None,
        bytes_per_string: int = 16,
    ):
        self._max_shard_bytes = _positive_int(max_shard_bytes, "max_shard_bytes")
        self._max_shards = (
            None if max_shards is None else _positive_int(max_shards, "max_shards")
        )
        self._bytes_per_string = _positive_int(bytes_per_string, "bytes_per_string")

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        shape = _check_shape(shape, axis)
        element = _element_bytes(dtype, self._bytes_per_string)
        bytes_per_slice = math.prod(shape) / shape[axis] * element
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice))
        shards = math.ceil(shape[axis] / slices_per_shard)
        if self._max_shards:
            shards = min(self._max_shards, shards)
        result = [1] * len(shape)
        result[axis] = shards
        return result


def _positive_int(value: Any, name: str) -> int:
    return check_int(value, name=name)


def _check_shape(shape: Sequence[Any], axis: int) -> tuple[int, ...]:
    dims = tuple(shape)
    if any(d is None for d in dims):
        raise ValueError(f"The shape must be fully defined. Received: shape={shape!r}.")
    dims = tuple(int(d) for d in dims)
    if not 0 <= axis < len(dims):
        raise ValueError(
            f"Cannot partition a variable of shape {dims} along axis {axis}. "
            f"Received: axis={axis!r}."
        )
    return dims


def _element_bytes(dtype: Any, bytes_per_string: int) -> int:
    name = getattr(dtype, "name", dtype)
    if name in ("string", "str", str, object):
        return bytes_per_string
    return np.dtype(name).itemsize
