"""Global-batch loss scaling for custom training loops.

Inside `strategy.run`, each replica sees only its part of the global batch.
To get the gradient of the mean loss over the *global* batch, each replica
divides the sum of its per-example losses by the global batch size, and the
replicas' gradients are then summed (`all_reduce("sum", grads)`).
`compute_average_loss` does the division; `scale_regularization_loss`
divides losses that every replica adds in full (weight decay) by the number
of replicas, so their sum counts once.

Outside `run` (a global view, e.g. a `train_step` of `model.fit` or a jitted
step over the whole batch) there is one "replica" holding the whole batch:
`compute_average_loss` is the plain mean and `scale_regularization_loss`
returns its input — nothing is divided twice.
"""

import jax
import jax.numpy as jnp

from keras_dist.strategies.replica._replica_context import in_replica_context

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(
    per_example_loss: "jax.typing.ArrayLike",
    sample_weight: "jax.typing.ArrayLike | None" = None,
    global_batch_size: int | None = None,
) -> jax.Array:
    """Sum of the replica's per-example losses divided by the global batch size.

    Like `tf.nn.compute_average_loss`. Per-example losses with extra
    dimensions (e.g. one loss per pixel, shape `(batch, H, W)`) are first
    averaged over those dimensions. When the batch given to `strategy.run`
    was a padded partial batch, the padded examples are left out.

    Example:

    ```python
    loss_object = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)
    def compute_loss(labels, logits):
        per_example_loss = loss_object(labels, logits)
        return kd.losses.compute_average_loss(per_example_loss)
    ```

    Args:
        per_example_loss: float array of shape `(batch, ...)`.
        sample_weight: optional weights, a scalar or broadcastable to
            `per_example_loss` (e.g. shape `(batch,)`).
        global_batch_size: the divisor. Defaults to `None`: the number of
            real examples of the global batch (inside `run`: per-replica
            batch x replicas, less any padding) or `per_example_loss`'s
            first dimension (outside `run`).

    Returns:
        A scalar: this replica's share of the global mean loss.

    Raises:
        ValueError: if `per_example_loss` is a scalar or
            `global_batch_size <= 0`.
        TypeError: if `per_example_loss` is not floating point or
            `global_batch_size` is not an int.
    """
    loss = jnp.asarray(per_example_loss)
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            "`per_example_loss` must be a floating point array. Received: "
            f"dtype={loss.dtype}. Cast it, e.g. `loss.astype('float32')`."
        )
    if loss.ndim == 0:
        raise ValueError(
            "`per_example_loss` must have one value per example (shape "
            "`(batch, ...)`), but received a scalar (shape=()). Compute it "
            "with `reduction=None`, e.g. "
            "`keras.losses.SparseCategoricalCrossentropy(reduction=None)`."
        )
    if global_batch_size is not None:
        if isinstance(global_batch_size, bool) or not isinstance(
            global_batch_size, (int, jnp.integer)
        ):
            raise TypeError(
                "`global_batch_size` must be an int. Received: "
                f"global_batch_size={global_batch_size!r}."
            )
        if global_batch_size <= 0:
            raise ValueError(
                "`global_batch_size` must be positive. Received: "
                f"global_batch_size={global_batch_size}."
            )
    if sample_weight is not None:
        weight = jnp.asarray(sample_weight, dtype=loss.dtype)
        if weight.ndim and weight.ndim < loss.ndim:
            weight = weight.reshape(weight.shape + (1,) * (loss.ndim - weight.ndim))
        loss = loss * weight
    if loss.ndim > 1:
        loss = loss.mean(axis=tuple(range(1, loss.ndim)))
    rows = loss.shape[0]
    context = in_replica_context()
    if context is None:
        divisor = rows if global_batch_size is None else global_batch_size
        return loss.sum() / jnp.asarray(divisor, loss.dtype)
    mask = context.example_mask(rows)
    if mask is not None:
        loss = jnp.where(mask, loss, jnp.zeros_like(loss))
    if global_batch_size is None:
        global_batch_size = context.global_batch_size(rows)
    return loss.sum() / jnp.asarray(global_batch_size, loss.dtype)


def scale_regularization_loss(regularization_loss: "jax.typing.ArrayLike") -> jax.Array:
    """Divides a loss every replica adds in full by the number of replicas.

    Like `tf.nn.scale_regularization_loss`: inside `strategy.run`, returns
    `regularization_loss / num_replicas_in_sync`, so that summing the
    replicas' gradients counts it once; outside `run`, returns it unchanged.

    Example:

    ```python
    def loss_fn(trainable):
        logits, _ = model.stateless_call(trainable, non_trainable, x)
        loss = kd.losses.compute_average_loss(loss_object(y, logits))
        l2 = sum(jnp.sum(w**2) for w in trainable) * 1e-4
        return loss + kd.losses.scale_regularization_loss(l2)
    ```

    Args:
        regularization_loss: a float scalar (or array), e.g. `sum(model.losses)`.
    """
    loss = jnp.asarray(regularization_loss)
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            "`regularization_loss` must be floating point. Received: "
            f"dtype={loss.dtype}."
        )
    context = in_replica_context()
    if context is None:
        return loss
    return loss / jnp.asarray(context.num_replicas_in_sync, loss.dtype)
