"""Moments of BatchNormalization's inputs per replica, or over all replicas.

Two places a layer runs on a keras_dist strategy, and two ways to see replicas:

- in a step of `fit` (GSPMD: one program over the global batch), the layer
  sees the real rows of the global batch, and `_replica_rows` says which
  replica each came from: `grouped_moments` reduces each replica's rows;
- inside `strategy.run` (`shard_map`), each replica sees its own rows, with
  padding rows marked by the replica context: `weighted_moments` reduces
  them, over the replica alone or, with `total=psum`, over all replicas.

All moments are Keras's: the mean and the biased variance (divided by the
number of values, as `jnp.var` and tf's `tf.nn.moments`). With a Keras mask
the sums of Keras's masked path are used, denominator `weights + epsilon()`,
so one replica gives exactly Keras's numbers.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import keras
import numpy as np

__all__ = ["broadcast_mask", "grouped_moments", "row_shape", "weighted_moments"]

_HIGHEST = jax.lax.Precision.HIGHEST


def row_shape(ndim: int, axis: int, rows: int, channels: int) -> tuple[int, ...]:
    """The shape that lines `(rows, channels)` values up with the inputs."""
    shape = [1] * ndim
    shape[0] = rows
    shape[axis] = channels
    return tuple(shape)


def broadcast_mask(mask, inputs) -> jax.Array:
    """Keras's mask (one dimension less than `inputs`) as booleans like `inputs`."""
    return jnp.broadcast_to(jnp.expand_dims(mask, -1), inputs.shape).astype(bool)


def grouped_moments(
    inputs: jax.Array, *, axis: int, groups: np.ndarray, mask=None
) -> tuple[jax.Array, jax.Array]:
    """Mean and variance of each group of rows: shapes `(groups, channels)`.

    Args:
        inputs: the rows, batch on axis 0, channels on `axis` (> 0).
        axis: the channel axis.
        groups: the group (`0 ... k - 1`, every one used) of each row; static.
        mask: Keras's mask, or None.
    """
    k = int(groups.max()) + 1
    other = tuple(i for i in range(1, inputs.ndim) if i != axis)
    onehot = (groups[None, :] == np.arange(k)[:, None]).astype(inputs.dtype)
    rows, channels = inputs.shape[0], inputs.shape[axis]

    def per_group(values):  # (rows, channels) -> (k, channels)
        return jnp.matmul(onehot, values, precision=_HIGHEST)

    def per_row(values):  # (k, channels) -> broadcastable to inputs
        return values[groups].reshape(row_shape(inputs.ndim, axis, rows, channels))

    if mask is None:
        per_value = int(np.prod([inputs.shape[i] for i in other]))
        count = (onehot.sum(axis=1) * per_value)[:, None]
        mean = per_group(jnp.sum(inputs, axis=other)) / count
        centered = inputs - per_row(mean)
        variance = per_group(jnp.sum(centered * centered, axis=other)) / count
        return mean, variance
    weights = broadcast_mask(mask, inputs)
    count = per_group(jnp.sum(weights.astype(inputs.dtype), axis=other))
    count = count + keras.backend.epsilon()
    mean = per_group(jnp.sum(jnp.where(weights, inputs, 0), axis=other)) / count
    centered = jnp.where(weights, inputs - per_row(mean), 0)
    variance = per_group(jnp.sum(centered * centered, axis=other)) / count
    return mean, variance


def weighted_moments(
    inputs: jax.Array,
    *,
    axis: int,
    weights=None,
    keras_mask: bool = False,
    total: Callable = lambda value: value,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean, variance (shape `(channels,)`) and value count of weighted values.

    Args:
        inputs: the values, channels on `axis`.
        axis: the channel axis.
        weights: booleans like `inputs` (which values count), or None: all.
        keras_mask: the weights include a Keras mask: divide by
            `count + epsilon()` as Keras does; else by the count (0 -> 1, so
            a replica without rows gets zeros, never NaN).
        total: combines the sums of all replicas (`psum`), or not.

    Returns:
        `(mean, variance, count)`, `count` the number of values that counted.
    """
    axes = tuple(i for i in range(inputs.ndim) if i != axis)
    if weights is None:
        count = total(jnp.asarray(inputs.size // inputs.shape[axis], inputs.dtype))
        sums = total(jnp.sum(inputs, axis=axes))
    else:
        count = total(jnp.sum(weights.astype(inputs.dtype), axis=axes))
        sums = total(jnp.sum(jnp.where(weights, inputs, 0), axis=axes))
    denominator = (
        count + keras.backend.epsilon() if keras_mask else jnp.maximum(count, 1)
    )
    mean = sums / denominator
    shape = [1] * inputs.ndim
    shape[axis] = inputs.shape[axis]
    centered = inputs - mean.reshape(shape)
    if weights is not None:
        centered = jnp.where(weights, centered, 0)
    variance = total(jnp.sum(centered * centered, axis=axes)) / denominator
    return mean, variance, count
