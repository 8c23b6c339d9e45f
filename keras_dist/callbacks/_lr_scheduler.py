"""`LearningRateScheduler`: per-epoch or per-step schedules, no recompiles."""

import inspect

import jax.numpy as jnp
import keras
import numpy as np

from keras_dist.callbacks._chief import is_chief
from keras_dist.callbacks._lr_control import (
    check_rate,
    controlled,
    current_learning_rate,
    is_traceable,
    release,
)

__all__ = ["LearningRateScheduler"]


class LearningRateScheduler(keras.callbacks.Callback):
    """Sets the learning rate from a schedule, each epoch or each step.

    Like `keras.callbacks.LearningRateScheduler`, plus: per-step schedules,
    Keras `LearningRateSchedule` objects and optax schedules, and optimizers
    built with a `LearningRateSchedule` (Keras raises `TypeError` there). The
    rate lives in a variable of the compiled step, or is computed inside it,
    so a change never recompiles.

    Example:

    ```python
    def decay(epoch):
        return 1e-3 if epoch < 3 else 1e-4 if epoch < 7 else 1e-5
    model.fit(x, y, epochs=10, callbacks=[kd.callbacks.LearningRateScheduler(decay)])
    # Per step, any optax schedule:
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000)
    kd.callbacks.LearningRateScheduler(sched, per="step")
    ```

    Args:
        schedule: `f(epoch)`, `f(epoch, lr)`, a
            `keras.optimizers.schedules.LearningRateSchedule`, or an optax
            schedule. With `per="step"` it gets the global step (the
            optimizer's iteration count) instead of the epoch.
        per: `"epoch"` or `"step"`. Defaults to `"epoch"`.
        verbose: 1 prints each change (chief only). Defaults to 0.

    Raises:
        TypeError: if `schedule` is not callable.
        ValueError: if `per` is not "epoch" or "step".
    """

    def __init__(self, schedule, *, per: str = "epoch", verbose: int = 0):
        super().__init__()
        if not callable(schedule):
            raise TypeError(
                "`schedule` must be a function f(epoch) or f(epoch, lr), a "
                "LearningRateSchedule or an optax schedule. Received: "
                f"schedule={schedule!r}."
            )
        if per not in ("epoch", "step"):
            raise ValueError(f'`per` must be "epoch" or "step". Received: per={per!r}.')
        self.schedule = schedule
        self.per = per
        self.verbose = verbose
        self._takes_lr = _takes_lr(schedule)
        self._in_step = per == "step" and not self._takes_lr and is_traceable(schedule)

    def on_train_begin(self, logs=None):
        control = controlled(self.model)
        if self._in_step:
            check_rate(self.schedule(0), what="`schedule` at step 0")
            control.step_fn = lambda step: jnp.asarray(self.schedule(step), "float32")
            self.model.make_train_function(force=True)

    def on_epoch_begin(self, epoch, logs=None):
        if self.per == "epoch":
            self._set(epoch, f"epoch {epoch}")

    def on_train_batch_begin(self, batch, logs=None):
        if self.per == "step" and not self._in_step:
            from keras_dist._keras_compat import sync_state

            sync_state(self.model)
            step = int(np.asarray(self.model.optimizer.iterations.value))
            self._set(step, f"step {step}")

    def _set(self, when: int, label: str) -> None:
        control = controlled(self.model)
        if self._takes_lr:
            current = float(np.asarray(control.value.value))
            value = self.schedule(when, current)
        else:
            value = self.schedule(when)
        rate = check_rate(value, what=f"`schedule` at {label}")
        control.value.assign(rate)
        if self.verbose and is_chief():
            print(
                f"\n{label.capitalize()}: LearningRateScheduler setting learning "
                f"rate to {np.float32(rate)}."
            )

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = current_learning_rate(self.model.optimizer)

    def on_train_end(self, logs=None):
        release(self.model)  # The last rate stays, as a plain variable.


def _takes_lr(schedule) -> bool:
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return False
    try:
        params = [
            p
            for p in inspect.signature(schedule).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2
