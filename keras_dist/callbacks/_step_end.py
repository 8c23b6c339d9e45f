"""`StepEnd`: the checkpoint callbacks learn where each execution ended."""

from typing import Any

__all__ = ["StepEnd"]


class StepEnd:
    """The last step index of each finished training execution.

    Keras's `CallbackList` (JAX backend) runs `on_train_batch_end` hooks on a
    background thread unless a callback defines that hook without declaring
    `async_safe`: then every step waits for its logs. A checkpoint callback
    needs the training thread, not the logs: `begin(batch)` (from
    `on_train_batch_begin`) and `epoch_end()` return the last step index of
    the execution that finished since, or None; `reset()` at each epoch's
    begin. The model's state there is the one that execution left.

    It counts the steps this `fit` ran on the host from `start`'s number
    (`step`), so a save need not read the optimizer's counter (which waits
    for every step dispatched), counting an epoch's short last execution to
    the epoch's end as Keras's callbacks do.
    """

    def __init__(self) -> None:
        self._running: int | None = None  # The running execution's last step.
        self._first: int | None = None  # The epoch's first step in this fit.
        self._last: int | None = None  # The epoch's latest execution's last step.
        self._before = 0  # Steps of this fit's earlier epochs.
        self._steps: int | None = None  # Steps per epoch, if known.
        self._base = 0  # The step number `fit` began at.
        self._call: Any = None  # The running call's `CallState`.

    def start(self, steps_per_epoch: int | None, first_step: int, call=None) -> None:
        """A new `fit` (from `on_train_begin`, with `params["steps"]`, the step
        number it begins at and its `CallState`): counts from there."""
        self._running = self._first = self._last = None
        self._before = 0
        self._steps = steps_per_epoch
        self._base = first_step
        self._call = call

    def reset(self) -> None:
        if self._first is not None and self._last is not None:
            self._before += self._clipped(self._last) + 1 - self._first
        self._running = self._first = self._last = None

    def begin(self, batch: int) -> int | None:
        """The execution before the one starting at `batch` ended: its last step."""
        if self._first is None:
            self._first = batch
        end = None if self._call is None else self._call.last_end_step
        finished = self._running
        self._running = self._last = end if end is not None and end >= batch else batch
        return finished

    def epoch_end(self) -> int | None:
        """The epoch's last execution ended (if one ran since `begin`)."""
        finished, self._running = self._running, None
        return finished

    @property
    def last(self) -> int | None:
        """The last step index of the epoch's latest execution (None: none ran)."""
        return self._last

    def step(self, through: int | None) -> int:
        """The step number after step index `through` of this epoch (None:
        before this epoch)."""
        if through is None or self._first is None:
            return self._base + self._before
        return self._base + self._before + self._clipped(through) + 1 - self._first

    def _clipped(self, index: int) -> int:
        return min(index, self._steps - 1) if self._steps else index
