"""`StepProgram`: the one wrapper of Keras's steps under a strategy.

Keras's JAX trainer compiles its steps with `jit(step, donate_argnums=0,
...)`, or calls them as they are (`run_eagerly=True`, `jit_compile=False`).
Under a keras_dist strategy the seams hand every step to `StepProgram`
(`_seams/_trainer.py`), which prepares it here, in one place and in
this order, for every execution mode:

1. **gather**: a device-resident batch (`data/resident/_resident_batch`) becomes its
   rows, gathered on the devices (inside the compiled step: one program);
2. **rows**: `data/_replica_rows.current()` says, for the step's duration,
   which replica each real row came from (per-replica BatchNormalization);
3. **cut**: a padded batch is cut back to its real rows
   (`data/_partial_batch.unpad`), so the model sees only real rows;
4. **outputs**: `predict`'s outputs are laid out whole on every process;
5. **state**: state kept outside device memory (`state_layout.off_device`,
   CentralStorageStrategy) is moved to device memory first — compiled: as
   the program's first operation, Keras's `out_shardings` writing the new
   state back to host memory (donation keeps working: both in host
   memory); eager: around the call, and the new state moved back.

Then it is compiled as Keras asked, or run eagerly; each call is counted in
the running call's `StepStats` (`ScalingReport`) and paced
(`strategy.pacer`, CPU devices). With `steps_per_execution=N`, `FusedSteps`
compiles the same prepared step in a `lax.scan` of N steps (`group`).
"""

import functools
import time
from collections.abc import Callable
from typing import Any

import jax

from keras_dist.data import _call, _partial_batch
from keras_dist.data._replica_rows import layout_of, replica_rows
from keras_dist.data.resident._resident_batch import ResidentTuple, gathered
from keras_dist.strategies._base import Strategy
from keras_dist.training._step_cost import abstract

__all__ = ["StepProgram", "TimedStep"]


class StepProgram:
    """A Keras step `step(state, data) -> (outputs, state)` under `strategy`.

    Args:
        step: Keras's step function (`train_step`, `test_step`,
            `predict_step`), or its eager loop's step.
        strategy: the strategy the step runs under.
        predict: whether the step is a `predict_step` (outputs whole on every
            process).
        jit: compiles a function as Keras compiles its step (its `jit` with
            Keras's arguments: donated state, output shardings); None: the
            step runs eagerly.
    """

    def __init__(
        self,
        step: Callable,
        strategy: Strategy,
        *,
        predict: bool,
        jit: Callable[[Callable], Callable] | None,
    ):
        self.strategy = strategy
        self.step = _prepared(step, strategy, predict=predict)
        self._jit = jit
        program = self.compile(self.step) if jit else _eager(self.step, strategy)
        self._program = program
        self._call = _timed(program, steps=1, pacer=strategy.pacer)
        functools.update_wrapper(self, step)

    @property
    def compiled(self) -> bool:
        return self._jit is not None

    def compile(self, program: Callable) -> Callable:
        """`program(state, ...)` compiled as Keras compiles its step.

        With the state kept outside device memory, moving it in is the
        program's first operation.
        """
        if self._jit is None:  # Only a compiled step compiles.
            raise RuntimeError("An eager step (`run_eagerly=True`) is not compiled.")
        if self.strategy.state_layout.off_device:
            program = _state_moved_in(program, self.strategy)
        return self._jit(program)

    def group(self, steps: int) -> Callable[[Callable], Callable]:
        """Compiles a program of `steps` steps (`FusedSteps`), timed and paced."""
        return lambda program: _timed(
            self.compile(program), steps=steps, pacer=self.strategy.pacer
        )

    def __call__(self, *args, **kwargs):
        # A `ResidentTuple` (what Keras's loop unpacks) goes in as the
        # `ResidentBatch` it stands for: JAX flattens that without Python.
        if args and type(args[-1]) is ResidentTuple:
            args = (*args[:-1], args[-1][0].batch)
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._program, name)  # e.g. a compiled step's `lower`.


def _prepared(step: Callable, strategy: Strategy, *, predict: bool) -> Callable:
    """Steps 1-4 of the module docstring around `step(state, data)`."""
    replicas = strategy.num_replicas_in_sync
    take = strategy.placement.take_rows
    outputs_whole = predict and strategy.spans_processes
    replicated = strategy.state_layout.replicated
    cut = _partial_batch.unpad
    if strategy.model_parallel > 1:
        cut = functools.partial(_cut_whole, constrain=strategy.state_layout)

    @functools.wraps(step)
    def prepared(*args, **kwargs):
        args = tuple(gathered(a, take) for a in args)
        with replica_rows(layout_of(args, replicas)):
            outputs, state = step(*(cut(a) for a in args), **kwargs)
        if outputs_whole:
            outputs = jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, replicated), outputs
            )
        return outputs, state

    return prepared


def _cut_whole(data: Any, *, constrain: Any) -> Any:
    """A padded batch's real rows, laid out whole on every device (2-D meshes).

    Works around an XLA SPMD bug: on a mesh with a model axis, a batch split
    unevenly over `"batch"` (the real rows of a padded batch) gets wrong
    gradients through a row gather of row statistics (per-replica
    BatchNormalization's; `x - (onehot @ x)[groups]`), while its forward pass
    is right. On a 1-D mesh it is right; so is the same program on rows
    laid out whole. Only the partial last batch of a pass pays: its step
    computes on every replica. (`tests/strategies/test_model_parallel.py::
    test_xla_still_needs_the_uneven_2d_workaround` fails once XLA is fixed.)
    """
    if not isinstance(data, _partial_batch.PaddedBatch):
        return data
    return jax.tree.map(
        lambda leaf: (
            constrain.replicated_constraint(leaf)
            if isinstance(leaf, jax.Array) and leaf.ndim
            else leaf
        ),
        _partial_batch.unpad(data),
    )


def _state_moved_in(program: Callable, strategy: Strategy) -> Callable:
    """`program(state, ...)` computing on the state moved to device memory."""
    layout = strategy.state_layout

    @functools.wraps(program)
    def on_device(state, *args, **kwargs):
        moved = layout.to_compute(state)
        outputs, new_state = program(moved, *args, **kwargs)
        return outputs, _unchanged_as_stored(new_state, moved, state)

    return on_device


def _eager(step: Callable, strategy: Strategy) -> Callable:
    """`step(state, ...)` run eagerly; host-memory state moved in and back out."""
    layout = strategy.state_layout
    if not layout.off_device:
        return step

    @functools.wraps(step)
    def on_device(state, *args, **kwargs):
        moved = layout.to_compute(state)
        outputs, new_state = step(moved, *args, **kwargs)
        new_state = _unchanged_as_stored(new_state, moved, state)
        stored = {id(leaf) for leaf in jax.tree.leaves(state)}
        return outputs, jax.tree.map(
            lambda x: x if id(x) in stored else layout.to_storage(x), new_state
        )

    return on_device


def _unchanged_as_stored(new_state, moved, stored):
    """`new_state` with each value the step did not change given back as stored.

    Weights an evaluate or predict step returns untouched then cost no copy
    back to host memory (compiled, the output aliases the donated input).
    """
    back = dict(
        zip(map(id, jax.tree.leaves(moved)), jax.tree.leaves(stored), strict=True)
    )
    return jax.tree.map(lambda x: back.get(id(x), x), new_state)


class TimedStep:
    """A step of plain Keras (no strategy), counted in the call's `StepStats`.

    So `kd.utils.ScalingReport` reads dispatch times without a strategy too.
    """

    def __init__(self, program: Callable):
        self._program = program
        self._call = _timed(program, steps=1, pacer=None)
        functools.update_wrapper(self, program)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._program, name)


def _timed(program: Callable, *, steps: int, pacer) -> Callable:
    """`program`, each call counted as `steps` steps in the call's `StepStats`.

    After each call, `pacer` (if any) bounds the programs in flight (CPU
    devices).
    """

    lowers = hasattr(program, "lower")  # Compiled: its cost can be read.

    @functools.wraps(program)
    def timed(*args, **kwargs):
        call = _call.current
        if lowers and call is not None and call.step_stats.program is None:
            call.step_stats.program = (program, abstract((args, kwargs)), steps)
        start = time.perf_counter()
        outputs = program(*args, **kwargs)
        if call is not None:
            stats = call.step_stats
            stats.steps += steps
            stats.dispatches += 1
            stats.seconds += time.perf_counter() - start
        if pacer is not None:
            pacer.after(outputs)
        return outputs

    return timed
