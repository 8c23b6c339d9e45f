"""`SyncBatchNormalization`: statistics of the global batch, over all replicas."""

from typing import Any

import keras

from keras_dist.layers._batch_normalization import BatchNormalization

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="keras_dist")
class SyncBatchNormalization(BatchNormalization):
    """BatchNormalization with the mean and variance of the whole global batch.

    As `tf.keras.layers.experimental.SyncBatchNormalization`: in training
    mode every replica normalizes with the moments of the global batch (all
    replicas' real rows together), and the moving mean and variance follow
    those moments — the numbers of one device running the global batch.

    In `fit` under a keras_dist strategy this is what Keras's own
    `BatchNormalization` computes already: the step is one program over the
    global batch, its moments are reduced across the devices by XLA (an
    all-reduce), and a partial last batch's padding is cut before the layer.
    Inside `strategy.run` (each replica on its own rows) the layer sums the
    replicas' sums with `psum` over the batch axis, counting real rows only.
    With no strategy it is Keras's layer. Same as
    `kd.layers.BatchNormalization(synchronized=True)`.

    Example:

    ```python
    with kd.MirroredStrategy().scope():
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(32),
            kd.layers.SyncBatchNormalization(),
            keras.layers.Dense(1),
        ])
    ```

    Args:
        axis: the features axis (normalized over the others). Defaults to -1.
        momentum: momentum of the moving averages. Defaults to 0.99.
        epsilon: added to the variance. Defaults to 1e-3.
        **kwargs: every other argument of `keras.layers.BatchNormalization`
            (`center`, `scale`, initializers, regularizers, constraints,
            `renorm*`) and base layer arguments (`name`, `dtype`).

    Raises:
        ValueError: if `synchronized=False` is passed (use
            `kd.layers.BatchNormalization` for per-replica statistics).
    """

    def __init__(
        self,
        axis: int = -1,
        momentum: float = 0.99,
        epsilon: float = 1e-3,
        **kwargs: Any,
    ) -> None:
        synchronized = kwargs.pop("synchronized", True)
        if synchronized is not True:
            raise ValueError(
                "SyncBatchNormalization always uses the statistics of the "
                f"global batch. Received: synchronized={synchronized!r}. For "
                "statistics per replica use "
                "`kd.layers.BatchNormalization(synchronized=False)`."
            )
        super().__init__(
            axis=axis, momentum=momentum, epsilon=epsilon, synchronized=True, **kwargs
        )

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("synchronized", None)
        return config
