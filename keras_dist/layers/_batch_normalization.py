"""`BatchNormalization`: Keras's layer with per-replica statistics (tf Mirrored)."""

from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_dist._private_api._hooks import BatchNormalizationHooks
from keras_dist.data import _replica_rows
from keras_dist.data._replica_rows import ReplicaRows
from keras_dist.layers._replica_moments import (
    broadcast_mask,
    grouped_moments,
    row_shape,
    weighted_moments,
)
from keras_dist.strategies.replica._replica_context import (
    AXIS,
    ReplicaContext,
    in_replica_context,
)

__all__ = ["BatchNormalization"]


@keras.saving.register_keras_serializable(package="keras_dist")
class BatchNormalization(BatchNormalizationHooks):
    """Keras's `BatchNormalization`, with per-replica statistics under a strategy.

    A drop-in for `keras.layers.BatchNormalization`: the same arguments, the
    same weights (`gamma`, `beta`, `moving_mean`, `moving_variance`) and the
    same config, so checkpoints move between the two. It differs only in
    training mode (`fit`, `training=True`) when a keras_dist strategy of
    several replicas runs the step — in a `fit`/`train_on_batch` step, or
    inside `strategy.run` — where it computes what tf's `MirroredStrategy`
    computes with `tf.keras.layers.BatchNormalization`:

    - each replica normalizes its rows with the mean and variance of its own
      real rows (a partial last batch's padding never counts);
    - `moving_mean` and `moving_variance` move towards the mean over the
      replicas of the replicas' moments:
      `moving_mean = momentum * moving_mean + (1 - momentum) * mean_r(mean_r)`
      and the same for the variance, with `mean_r` and `var_r` replica `r`'s
      batch mean and *biased* variance (divided by its number of values, as
      `tf.nn.moments`; tf's replica-local moving copies are averaged on read,
      which is this average). Every replica weighs the same, whatever its
      number of real rows;
    - a replica with no real row (a small partial last batch) has no moments
      and is left out of the average (tf would average in NaN). A replica
      with one real row has variance 0: that row normalizes to `beta`, and
      its 0 counts in the average, as in tf.

    With a Keras mask, each replica's moments are Keras's masked moments of
    its rows. With no strategy, one replica, or outside a step (e.g.
    `model(x, training=True)` in the cross-replica context) the layer is
    Keras's layer, number for number. `synchronized=True` computes the
    moments of the whole global batch instead, as `SyncBatchNormalization`
    (one device's numbers).

    Per-replica statistics assume the layer's inputs are the step's batch,
    row for row (its first axis is the batch; the channel `axis` is another
    one); `renorm=True` needs `synchronized=True` under a strategy of
    several replicas.

    Example:

    ```python
    strategy = kd.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(32),
            kd.layers.BatchNormalization(),  # tf MirroredStrategy's BN
            keras.layers.Dense(1),
        ])
        model.compile(optimizer="sgd", loss="mse")
    ```

    Args:
        axis: the features axis (normalized over the others). Defaults to -1.
        momentum: momentum of the moving averages. Defaults to 0.99.
        epsilon: added to the variance. Defaults to 1e-3.
        synchronized: whether to compute the statistics over the global batch
            of all replicas (True) or per replica (False). Defaults to False.
        **kwargs: every other argument of `keras.layers.BatchNormalization`
            (`center`, `scale`, initializers, regularizers, constraints,
            `renorm*`) and base layer arguments (`name`, `dtype`).

    Raises:
        TypeError: if `synchronized` is not a bool.
    """

    def __init__(
        self,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        *,
        synchronized: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(synchronized, bool):
            raise TypeError(
                "`synchronized` must be True (statistics of the global batch) "
                "or False (statistics per replica). Received: "
                f"synchronized={synchronized!r} of type "
                f"{type(synchronized).__name__}."
            )
        # Keras refuses synchronized=True off TensorFlow; it is ours to handle.
        super().__init__(axis=axis, momentum=momentum, epsilon=epsilon, **kwargs)
        self.synchronized = synchronized

    def call(self, inputs: Any, training: bool | None = None, mask: Any = None) -> Any:
        if not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        context = in_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            if self.synchronized:  # `batch_moments` sums over the replicas.
                return super().call(inputs, training=training, mask=mask)
            return self._in_replica(inputs, mask, context)
        layout = _replica_rows.current()
        if self.synchronized or layout is None or layout.replicas == 1:
            return super().call(inputs, training=training, mask=mask)
        return self._per_replica(inputs, mask, layout)

    def batch_moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        context = in_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            if mask is None:  # Keras's, whose JAX op refuses `synchronized`.
                return keras.ops.moments(inputs, axes=self.reduction_axes)
            return super().batch_moments(inputs, mask)
        weights = _weights(inputs, mask, context)
        mean, variance, _ = weighted_moments(
            inputs,
            axis=self.axis % inputs.ndim,
            weights=weights,
            keras_mask=mask is not None,
            total=lambda value: jax.lax.psum(value, AXIS),
        )
        return mean, variance

    def _per_replica(self, inputs: Any, mask: Any, layout: ReplicaRows) -> jax.Array:
        """A step of `fit` (one program over the global batch's real rows)."""
        axis = self._checked(inputs, mask)
        if inputs.shape[0] != layout.real_rows:
            raise ValueError(
                "Per-replica BatchNormalization needs the rows of the step's "
                f"batch ({layout.real_rows} real rows over {layout.replicas} "
                f"replicas) to tell each replica's rows. Received: inputs of "
                f"shape {tuple(inputs.shape)} in layer {self.name!r}. Use "
                "`kd.layers.SyncBatchNormalization` (statistics of the global "
                "batch) for a layer applied to other rows."
            )
        # Numbered among the replicas with real rows: the others are left out.
        _, groups = np.unique(layout.replica_ids(), return_inverse=True)
        groups = groups.reshape(-1)
        x = inputs.astype(self._stats_dtype(inputs))
        mean, variance = grouped_moments(x, axis=axis, groups=groups, mask=mask)
        shape = row_shape(x.ndim, axis, x.shape[0], x.shape[axis])
        return self._normalize(
            x,
            mean[groups].reshape(shape),
            variance[groups].reshape(shape),
            jnp.mean(mean, axis=0),
            jnp.mean(variance, axis=0),
        )

    def _in_replica(self, inputs: Any, mask: Any, context: ReplicaContext) -> jax.Array:
        """Inside `strategy.run`: this replica's rows only."""
        axis = self._checked(inputs, mask)
        x = inputs.astype(self._stats_dtype(inputs))
        mean, variance, _ = weighted_moments(
            x,
            axis=axis,
            weights=_weights(x, mask, context),
            keras_mask=mask is not None,
        )
        rows = context.example_mask(x.shape[0])
        real = jnp.asarray(1.0) if rows is None else jnp.max(rows).astype(x.dtype)
        replicas = jax.lax.psum(real, AXIS)  # Replicas with real rows (>= 1).
        shape = [1] * x.ndim
        shape[axis] = x.shape[axis]
        return self._normalize(
            x,
            mean.reshape(shape),
            variance.reshape(shape),
            jax.lax.psum(real * mean, AXIS) / replicas,
            jax.lax.psum(real * variance, AXIS) / replicas,
        )

    def _checked(self, inputs: Any, mask: Any) -> int:
        """The channel axis (positive); Keras's mask check; refuses renorm."""
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "The mask provided should be one dimension less than the "
                f"inputs. Received: mask.shape={mask.shape}, "
                f"inputs.shape={inputs.shape}"
            )
        axis = self.axis % inputs.ndim
        if self.renorm or axis == 0:
            raise ValueError(
                f"Per-replica BatchNormalization (layer {self.name!r}) supports "
                "neither `renorm=True` nor a features axis that is the batch "
                f"axis. Received: renorm={self.renorm}, axis={self.axis}. Pass "
                "`synchronized=True` (statistics of the global batch)."
            )
        return axis

    @staticmethod
    def _stats_dtype(inputs: Any) -> str:
        # As Keras: statistics in float32 at least (bf16/fp16 overflow).
        return keras.backend.result_type(inputs.dtype, "float32")

    def _normalize(
        self,
        x: jax.Array,
        mean: jax.Array,
        variance: jax.Array,
        batch_mean: jax.Array,
        batch_variance: jax.Array,
    ) -> jax.Array:
        """Keras's normalization with per-row moments; moving averages updated."""
        shape = [1] * x.ndim
        shape[self.axis % x.ndim] = x.shape[self.axis]
        inv = jax.lax.rsqrt(variance + self.epsilon)
        if self.scale:
            inv = inv * self.gamma.value.astype(x.dtype).reshape(shape)
        res = -mean * inv
        if self.center:
            res = res + self.beta.value.astype(x.dtype).reshape(shape)
        momentum = self.momentum
        moving_mean = self.moving_mean.value.astype(x.dtype)
        moving_variance = self.moving_variance.value.astype(x.dtype)
        self.moving_mean.assign(moving_mean * momentum + batch_mean * (1.0 - momentum))
        self.moving_variance.assign(
            moving_variance * momentum + batch_variance * (1.0 - momentum)
        )
        return (x * inv + res).astype(self.compute_dtype)


def _weights(inputs: Any, mask: Any, context: ReplicaContext) -> jax.Array | None:
    """Which values of this replica's `inputs` count: real rows, Keras's mask."""
    weights = None if mask is None else broadcast_mask(mask, inputs)
    rows = context.example_mask(inputs.shape[0])
    if rows is None:
        return weights
    rows = rows.reshape((-1,) + (1,) * (inputs.ndim - 1))
    rows = jnp.broadcast_to(rows, inputs.shape)
    return rows if weights is None else weights & rows
