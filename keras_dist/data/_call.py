"""`CallState`: what one `fit`/`evaluate`/`predict` call shares, and its owner.

A Keras call runs many parts of keras_dist: the entry-point seam, the input
pipeline of every pass, the step seams and the callbacks. What they share
lives here, in one declared object per call, instead of in attributes written
on a strategy or a model for another module to read:

- the strategy the call runs under, and the call's `initial_epoch`;
- the global batch size seen on the first batch (`LearningRateWarmup`), and
  the host time of its input and of its step calls (`ScalingReport`);
- a pending resume (`BackupAndRestore` restores, the first training pass
  replays up to the backed-up step);
- what must be undone when the call ends, however it ends (prefetch threads,
  signal handlers): `on_close`.

Calls nest (`fit` runs `evaluate` for validation); a nested call shares the
outermost call's closers, so a pass that outlives one validation
(`validation_steps` keeps Keras's iterator across epochs) lives as long as the
`fit`. Timings are each call's own: a `fit`'s are those of its training
steps, validation left out.
"""

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from keras_dist.cluster import _heartbeat

_PROGRESS = _heartbeat.PROGRESS

__all__ = ["CallState", "InputStats", "ResumePlan", "StepStats", "active", "enter"]


@dataclasses.dataclass
class InputStats:
    """Batches produced and host seconds spent on them (read, pad, shard).

    Filled by the `fit`/`evaluate`/`predict` input path of a strategy
    (`_pipeline.InputPass`, `_resident.ResidentPass`). Two clocks:

    - producing (`batches`, `seconds`): the work of making a batch, on
      whichever thread does it (a prefetch thread overlaps it with the
      steps); the first batch of each pass is kept apart (it includes
      starting the pass);
    - waiting (`taken`, `waited`): the time the step loop spent in `next()`
      for each batch it took, on its own thread: the input's share of the
      step time (`ScalingReport`'s breakdown).

    Attributes:
        batches: batches produced, after each pass's first.
        seconds: host seconds producing them.
        first_seconds: host seconds producing the first batch of each pass.
        taken: batches the step loop took (all of them).
        waited: host seconds the step loop waited for them.
    """

    batches: int = 0
    seconds: float = 0.0
    first_seconds: float = 0.0
    taken: int = 0
    waited: float = 0.0

    def record(self, seconds: float, first: bool, batches: int = 1) -> None:
        """`batches` batches were produced in `seconds` (a pass's first: apart)."""
        if first:
            self.first_seconds += seconds
        else:
            self.batches += batches
            self.seconds += seconds

    def record_wait(self, seconds: float, batches: int = 1) -> None:
        """The step loop waited `seconds` for its next `batches` batches."""
        self.taken += batches
        self.waited += seconds
        if not _PROGRESS.evaluating:  # Training's input waits (goodput).
            _PROGRESS.input_s += seconds

    def reset(self) -> None:
        self.batches, self.seconds, self.first_seconds = 0, 0.0, 0.0
        self.taken, self.waited = 0, 0.0

    @property
    def seconds_per_batch(self) -> float | None:
        return self.seconds / self.batches if self.batches else None


@dataclasses.dataclass
class StepStats:
    """Steps run, programs dispatched for them, and the host time of the calls.

    Filled by the one step wrapper (`training/_step.py`) around each call of
    a step program: one step, or the N steps of a fused
    `steps_per_execution` group (`training/_fused_steps.py`). The time is
    the host's, in the call: Keras's step wrapper and JAX's dispatch, which
    returns before the devices finish (JAX runs asynchronously) — and, when
    the devices are behind by several steps, waits for them. Nothing waits
    for a result to measure it.

    Counters, added to in place by the step wrapper.

    Attributes:
        steps: steps run.
        dispatches: programs called for them (`steps` / N with fused groups).
        seconds: host seconds inside those calls.
        program: the first compiled program called, as `(program, abstract
            arguments, steps per call)`, for its `StepCost`
            (`training/_step_cost.py`); None before one runs, or eager.
        cost: that `StepCost`, once read.
    """

    steps: int = 0
    dispatches: int = 0
    seconds: float = 0.0
    program: Any = None
    cost: Any = None


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """Where the input of a resumed `fit` must start.

    Attributes:
        epochs: epochs of this `fit` already trained before the backup, each
            replayed through Keras's own epoch iterator (read, not trained) so
            the iterator reaches the state it had: every shuffle repeats, and
            with `steps_per_epoch` the one iterator Keras keeps across epochs
            is where it was.
        steps: batches of the resumed epoch already trained on.
    """

    epochs: int
    steps: int


@dataclasses.dataclass(eq=False)
class CallState:
    """The state one `fit`/`evaluate`/`predict`/`*_on_batch` call shares.

    Attributes:
        method: the Keras method (`"fit"`, `"evaluate"`, ...).
        strategy: the keras_dist strategy the call runs under (None: plain
            Keras, where keras_dist callbacks still share this state).
        initial_epoch: `fit`'s `initial_epoch` argument.
        parent: the enclosing call (validation inside `fit`), or None.
        batch_size: the global batch size of the first batch read, if any.
        input_stats: host time spent producing batches and waiting for them.
        step_stats: steps run, programs dispatched, host time in the calls.
        resume: a pending `ResumePlan`, taken by the first training pass.
        check_batch: called with each host batch the input pipeline reads and
            its index in the pass, before it is laid out (the targets checks
            of `training/_call_checks.py`); None: no check.
        validates: whether the call validates (`fit` with `validation_data`
            or `validation_split`); None if unknown.
        resident: device-resident datasets laid out during the call, by the
            id of the Keras data adapter they came from (kept with it), so
            every pass over one adapter reuses one layout
            (`_resident.py`); shared with nested calls through `root`.
        last_end_step: the last step index (in the epoch) of the newest
            execution Keras's epoch loop was handed (`steps_per_execution`
            steps end there), set before its `on_train_batch_begin`; None
            before the first. Checkpoint callbacks read it to act at a
            step's end without a per-step hook (`callbacks/_step_end.StepEnd`).
    """

    method: str
    strategy: Any
    initial_epoch: int = 0
    parent: "CallState | None" = None
    batch_size: int | None = None
    input_stats: InputStats = dataclasses.field(default_factory=InputStats)
    step_stats: StepStats = dataclasses.field(default_factory=StepStats)
    resume: ResumePlan | None = None
    check_batch: Callable[[Any, int], None] | None = None
    validates: bool | None = None
    resident: dict = dataclasses.field(default_factory=dict)
    last_end_step: int | None = None
    _closers: list = dataclasses.field(default_factory=list)

    @property
    def root(self) -> "CallState":
        state = self
        while state.parent is not None:
            state = state.parent
        return state

    def on_close(self, closer: Callable[[], None]) -> None:
        """Runs `closer()` when the outermost call ends (normally or not)."""
        if self.parent is not None:
            self.root.on_close(closer)
        else:
            self._closers.append(closer)

    def observe_batch_size(self, size: int | None) -> None:
        if size is not None:
            for state in (self, self.root):
                if state.batch_size is None:
                    state.batch_size = size

    def take_resume(self) -> ResumePlan | None:
        plan, self.resume = self.resume, None
        return plan

    def close(self) -> None:
        """Runs the closers registered with `on_close`, newest first."""
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception as error:  # Close the rest; never mask the call's.
                warnings.warn(
                    f"keras_dist could not clean up after the call ({closer!r}): "
                    f"{error!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )


_STACK: list[CallState] = []
# The innermost running call, or None: what `active()` returns, also read as
# an attribute by the step wrapper after each step (no call on its road).
current: CallState | None = None


def active() -> CallState | None:
    """The innermost running call, or None outside any keras_dist call."""
    return current


@contextlib.contextmanager
def enter(method: str, strategy: Any, *, initial_epoch: int = 0) -> Iterator[CallState]:
    """Runs a call: its `CallState` is active inside; closed at the end."""
    parent = active()
    state = CallState(
        method=method,
        strategy=strategy,
        initial_epoch=initial_epoch,
        parent=parent,
    )
    global current
    _STACK.append(state)
    current = state
    try:
        yield state
    finally:
        _STACK.remove(state)
        current = _STACK[-1] if _STACK else None
        if parent is None:
            state.close()
