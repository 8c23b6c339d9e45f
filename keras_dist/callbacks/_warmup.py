"""`LearningRateWarmup`: the linear scaling rule with gradual warmup."""

import math

import keras

from keras_dist._checks import check_int
from keras_dist.callbacks._lr_control import (
    check_rate,
    controlled,
    release,
)
from keras_dist.data import _call
from keras_dist.strategies._base import strategy_of_model

__all__ = ["LearningRateWarmup"]


class LearningRateWarmup(keras.callbacks.Callback):
    """Ramps the learning rate up to the scaled rate, step by step.

    Goyal et al. 2017 ("Accurate, Large Minibatch SGD"): with a global batch
    `k` times the reference batch, use `k x base_lr`, reached by a linear
    ramp from `base_lr` over the first `warmup_epochs` epochs. The ramp is
    computed per step inside the compiled step. After the warmup the rate is
    the target, or whatever a `LearningRateScheduler` sets (they compose).

    Example:

    ```python
    warmup = kd.callbacks.LearningRateWarmup(0.1, warmup_epochs=5, base_batch_size=256)
    model.fit(x, y, batch_size=1024, callbacks=[warmup])   # ramps 0.1 -> 0.4
    ```

    Args:
        base_lr: the rate for the reference batch (`base_batch_size`).
        warmup_epochs: epochs of the ramp; 0 jumps to the target. Defaults to 5.
        scale: `"linear"` (target = base_lr x k), `"sqrt"` (x sqrt(k)) or
            `None` (no scaling, the ramp goes from base_lr to base_lr).
            Defaults to `"linear"`.
        base_batch_size: the reference batch. k = global batch /
            base_batch_size. Defaults to `None`: k = number of replicas.

    Raises:
        ValueError: for a negative `warmup_epochs`, an unknown `scale`, a
            non-positive `base_batch_size` or a bad `base_lr`.
    """

    def __init__(
        self,
        base_lr: float,
        *,
        warmup_epochs: float = 5,
        scale: str | None = "linear",
        base_batch_size: int | None = None,
    ):
        super().__init__()
        self.base_lr = check_rate(base_lr, what="`base_lr`")
        if not isinstance(warmup_epochs, (int, float)) or warmup_epochs < 0:
            raise ValueError(
                "`warmup_epochs` must be a number >= 0. Received: "
                f"warmup_epochs={warmup_epochs!r}."
            )
        if scale not in ("linear", "sqrt", None):
            raise ValueError(
                f'`scale` must be "linear", "sqrt" or None. Received: scale={scale!r}.'
            )
        if base_batch_size is not None:
            base_batch_size = check_int(
                base_batch_size, name="base_batch_size", meaning=" or None"
            )
        self.warmup_epochs = warmup_epochs
        self.scale = scale
        self.base_batch_size = base_batch_size
        self.target_lr: float | None = None

    def _factor(self) -> float:
        if self.scale is None:
            return 1.0
        strategy = strategy_of_model(self.model)
        if self.base_batch_size is None:
            k = strategy.num_replicas_in_sync if strategy is not None else 1
        else:
            call = _call.active()
            batch = call.batch_size if call is not None else None
            if batch is None:
                raise ValueError(
                    "LearningRateWarmup(base_batch_size=...) needs the global "
                    "batch size, which keras_dist sees only under a strategy. "
                    "Build the model in `strategy.scope()`."
                )
            k = batch / self.base_batch_size
        return k if self.scale == "linear" else math.sqrt(k)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.target_lr = self.base_lr * self._factor()
        steps = self.params.get("steps")
        if not steps:
            raise ValueError(
                "LearningRateWarmup needs the number of steps per epoch; this "
                "input has no known length. Pass `steps_per_epoch` to fit."
            )
        control = controlled(self.model)
        control.value.assign(self.target_lr)
        control.warmup = (self.base_lr, self.target_lr, int(self.warmup_epochs * steps))
        self.model.make_train_function(force=True)

    def on_train_end(self, logs: dict | None = None) -> None:
        release(self.model)  # The last rate stays, as a plain variable.
