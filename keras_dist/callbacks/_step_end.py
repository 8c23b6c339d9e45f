"""A training step's end, seen by a callback without making `fit` wait for it.

Keras's `CallbackList` (JAX backend) runs `on_train_batch_end` hooks on a
background thread, so the training loop dispatches the next step while the
devices still run this one — unless a callback defines that hook without
declaring `async_safe`. Then every step's hooks run on the training thread
after the step's logs are turned into Python floats: the loop waits for each
step. Keras's own `ModelCheckpoint` and `BackupAndRestore` define the hook,
so they make every step wait even when they save once an epoch (measured on
one H200: a 0.5 ms step became 1.6 ms; `benchmarks/README.md`).

A checkpoint callback needs the training thread (it freezes the model's
state between two steps) but not the step's logs, unless it formats them
into a file name or compares a monitored value. `StepEnd` hands it the end
of each execution (`steps_per_execution` steps) at the next execution's
`on_train_batch_begin`, or at `on_epoch_end` for the epoch's last one: the
model's state is the same there, nothing trains in between. The end index
comes from the epoch loop (`CallState.last_end_step`).
"""

from keras_dist.data import _call

__all__ = ["StepEnd"]


class StepEnd:
    """The last step index of each finished training execution, on the training thread.

    Call `begin(batch)` from `on_train_batch_begin` and `epoch_end()` from
    `on_epoch_end`; each returns the last step index (in the epoch) of the
    execution that finished since the previous call, or None. Call `reset()`
    from `on_epoch_begin`.

    It also counts the steps this `fit` ran, on the host, from the step
    number `start` is given (`step`): a save numbered by them need not read
    the optimizer's step counter, which would wait for every step
    dispatched so far. Keras's epoch loop gives an
    execution's planned end (`steps_per_execution` steps); an epoch's short
    last execution is counted to the epoch's end where the number of steps
    is known, and as planned where it is not (as Keras's own callbacks
    count batches).
    """

    def __init__(self) -> None:
        self._running: int | None = None  # The running execution's last step.
        self._first: int | None = None  # The epoch's first step in this fit.
        self._last: int | None = None  # The epoch's latest execution's last step.
        self._before = 0  # Steps of this fit's earlier epochs.
        self._steps: int | None = None  # Steps per epoch, if known.
        self._base = 0  # The step number `fit` began at.

    def start(self, steps_per_epoch: int | None, first_step: int) -> None:
        """A new `fit` (call from `on_train_begin`, with `params["steps"]`
        and the step number it begins at): counts from there."""
        self._running = self._first = self._last = None
        self._before = 0
        self._steps = steps_per_epoch
        self._base = first_step

    def reset(self) -> None:
        if self._first is not None and self._last is not None:
            self._before += self._clipped(self._last) + 1 - self._first
        self._running = self._first = self._last = None

    def begin(self, batch: int) -> int | None:
        """The execution before the one starting at `batch` ended: its last step."""
        if self._first is None:
            self._first = batch
        finished, self._running = self._running, _end_of_execution(batch)
        self._last = self._running
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
        before this epoch): `start`'s number plus the steps this `fit` ran
        (a resumed epoch counts from its first step)."""
        if through is None or self._first is None:
            return self._base + self._before
        return self._base + self._before + self._clipped(through) + 1 - self._first

    def _clipped(self, index: int) -> int:
        return min(index, self._steps - 1) if self._steps else index


def _end_of_execution(begin: int) -> int:
    call = _call.active()
    end = call.last_end_step if call is not None else None
    return end if end is not None and end >= begin else begin
