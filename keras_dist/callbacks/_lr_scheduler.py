"""`LearningRateScheduler`: per-epoch or per-step schedules, no recompiles."""

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_dist._private_api._access import sync_state
from keras_dist.callbacks._chief import is_chief
from keras_dist.callbacks._lr_control import (
    check_rate,
    controlled,
    current_learning_rate,
    is_traceable,
    release,
)

__all__ = ["LearningRateScheduler"]

# Steps of a compiled per-step schedule checked on the host per evaluation.
_CHUNK = 10_000


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

    A rate that is not a number, NaN or negative raises, naming the epoch
    or step, before that epoch or step trains. A traceable per-step schedule
    runs inside the compiled step, so at each epoch's start it is evaluated
    on the host (`jax.vmap` over the steps, 10,000 a call; one call per step
    if it cannot be vmapped) for every step the epoch will run: a bad rate
    stops `fit` before the epoch trains at all. When the epoch's length is
    unknown (a generator), it is evaluated 10,000 steps ahead and raises at
    the batch that would run the first bad step.

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

    def __init__(
        self, schedule: "Callable[..., Any]", *, per: str = "epoch", verbose: int = 0
    ):
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
        self._epoch_start = 0
        # Checked below this step (unknown epoch length).
        self._checked_to: int | None = None
        self._bad: tuple[int, Any] | None = None  # The first bad (step, rate) ahead.

    def on_train_begin(self, logs: dict | None = None) -> None:
        control = controlled(self.model)
        if self._in_step:
            check_rate(self.schedule(0), what="`schedule` at step 0")
            control.step_fn = lambda step: jnp.asarray(self.schedule(step), "float32")
            self.model.make_train_function(force=True)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.per == "epoch":
            self._set(epoch, f"epoch {epoch}")
        elif self._in_step:
            self._check_epoch_steps()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._in_step:
            if self._checked_to is not None:  # Unknown epoch length.
                # `batch` counts steps: this batch runs steps_per_execution.
                runs = max(int(getattr(self.model, "steps_per_execution", 1) or 1), 1)
                self._check_through(self._epoch_start + batch + runs - 1)
        elif self.per == "step":
            sync_state(self.model)
            step = int(np.asarray(self.model.optimizer.iterations))
            self._set(step, f"step {step}")

    def _check_epoch_steps(self) -> None:
        """Checks the compiled schedule at the steps the coming epoch runs.

        The steps are the optimizer's iteration count now and on, one per
        batch (also with `steps_per_execution`). With a known epoch length
        all are checked here, before the epoch trains; otherwise they are
        checked `_CHUNK` ahead, as the batches come.
        """
        sync_state(self.model)
        start = int(np.asarray(self.model.optimizer.iterations))
        self._epoch_start = start
        self._bad = None
        steps = (self.params or {}).get("steps")
        if steps:
            self._checked_to = None
            for low in range(start, start + steps, _CHUNK):
                bad = _first_bad(self.schedule, low, min(low + _CHUNK, start + steps))
                if bad is not None:
                    _raise_bad(*bad)
        else:
            self._checked_to = start
            self._check_through(start)

    def _check_through(self, last: int) -> None:
        """Raises if a step up to `last` has a bad rate (evaluating ahead)."""
        low = self._checked_to
        if low is None:  # Set with an unknown epoch length, the only caller's.
            raise RuntimeError("LearningRateScheduler: no step checked yet.")
        while self._bad is None and low <= last:
            self._bad = _first_bad(self.schedule, low, low + _CHUNK)
            low = self._checked_to = low + _CHUNK
        if self._bad is not None and self._bad[0] <= last:
            _raise_bad(*self._bad)

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

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = current_learning_rate(self.model.optimizer)

    def on_train_end(self, logs: dict | None = None) -> None:
        release(self.model)  # The last rate stays, as a plain variable.


def _first_bad(
    schedule: Callable[..., Any], start: int, stop: int
) -> tuple[int, Any] | None:
    """`(step, rate)` of the first NaN or negative rate in [start, stop), or None.

    Evaluates as the compiled step does (float32 step in, float32 rate out):
    one `jax.vmap` call over the steps, or one call per step for a schedule
    that cannot be vmapped.
    """
    steps = jnp.arange(start, stop, dtype="float32")
    try:
        rates = np.asarray(
            jax.vmap(lambda s: jnp.asarray(schedule(s), "float32"))(steps)
        )
        if rates.shape != steps.shape:
            raise ValueError(rates.shape)
    except Exception:  # Not vmappable: one host call per step.
        rates = np.array(
            [
                np.asarray(schedule(jnp.float32(s)), "float32")
                for s in range(start, stop)
            ],
            dtype="float32",
        )
    bad = np.flatnonzero(~(rates >= 0))  # NaN or negative.
    if not bad.size:
        return None
    return start + int(bad[0]), rates[bad[0]]


def _raise_bad(step: int, rate: Any) -> None:
    # The float32 rate, printed as short as it round-trips (-0.1, not -0.100000001).
    check_rate(float(str(np.float32(rate))), what=f"`schedule` at step {step}")


def _takes_lr(schedule: Callable[..., Any]) -> bool:
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
