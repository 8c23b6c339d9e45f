"""Seam 1: batches — Keras's iterators feed the input pipeline; steps see real rows.

Thin: the work is in `keras_dist/data/` (`_pipeline.InputPass`, the resume
replay of `_call.ResumePlan`). These functions only connect Keras's JAX
trainer to it:

- `_get_distributed_iterator`: each pass of `fit/evaluate/predict` is an
  `InputPass` over the data adapter's batches, or, for in-memory arrays the
  strategy's `input_options` put on the mesh, a `ResidentPass` over the
  indices of Keras's batches (`_array_input.py`).
- `_distribute_data`: the single batch of `*_on_batch`.
- `_jit` and `_make_function`: every step — compiled or eager, one batch or
  `steps_per_execution` of them — first gathers a device-resident batch
  (`ResidentBatch`) and cuts a `PaddedBatch` back to its real rows. Inside
  `jit` the cut is a static slice of the sharded arrays; without `jit`
  (`run_eagerly=True`, `jit_compile=False`) it is an eager slice. Under a
  strategy that keeps its state in host memory, both also bring the state
  to device memory (`_state_memory.py`). With `steps_per_execution > 1`
  and a compiled step, `_make_function` runs each group of batches as one
  program (`training/_fused_steps.py`), compiled as `_jit` compiled the step.
  Each call of a step program adds its host time to the running call's
  `StepStats` (`ScalingReport`).
- `_enumerate_iterator`: a resumed `fit` replays its finished epochs and
  steps through Keras's own epoch iterator before the first real step.
"""

import functools
import time
from collections.abc import Callable
from typing import Any

import keras

from keras_dist._keras_compat import _state_memory
from keras_dist._keras_compat._array_input import resident_pass
from keras_dist._keras_compat._processes import gathered_outputs
from keras_dist._keras_compat._state import originals as _originals
from keras_dist._keras_compat._tf_dataset import adapter_dataset
from keras_dist.data import _call
from keras_dist.data._auto_shard import is_per_process
from keras_dist.data._partial_batch import unpadding
from keras_dist.data._pipeline import InputPass, keras_batch
from keras_dist.data._replica_rows import tracking
from keras_dist.data._resident_batch import gathering
from keras_dist.errors import IncompatibleBackupError
from keras_dist.strategies._base import Strategy
from keras_dist.strategies._pacing import Pacer
from keras_dist.training._fused_steps import FusedSteps

__all__ = [
    "_distribute_data",
    "_enumerate_iterator",
    "_get_distributed_iterator",
    "_jit",
    "_make_function",
    "current_strategy",
]

# Keras's adapters whose passes cannot be read again from the start: the
# batches a read-ahead takes from them are lost to the next pass.
_ONE_SHOT_ADAPTERS = ("GeneratorDataAdapter",)
# Keras's adapters whose reading is bound to the epoch: a `PyDataset` is read
# by workers that `on_epoch_end` stops (and then reshuffles it) and
# `on_epoch_begin` restarts. When Keras keeps one iterator across epochs
# (`steps_per_epoch`), a read-ahead would read between the two — Keras's
# "Iterator called after `on_epoch_end`" — or take a batch of the next
# epoch from this epoch's order.
_EPOCH_BOUND_ADAPTERS = ("PyDatasetAdapter",)


def current_strategy() -> Strategy | None:
    current = keras.distribution.distribution()
    return current if isinstance(current, Strategy) else None


def _replicas() -> int | None:
    strategy = current_strategy()
    return None if strategy is None else strategy.num_replicas_in_sync


def _take_rows() -> Callable | None:
    strategy = current_strategy()
    return None if strategy is None else strategy.take_rows


def _jit(fun: Callable, *args, **kwargs):
    step = gathering(tracking(unpadding(fun), _replicas), _take_rows)
    if getattr(fun, "__name__", "") == "predict_step":
        step = gathered_outputs(step)
    strategy = current_strategy()
    if (
        _is_state_step(kwargs)
        and strategy is not None
        and strategy.state_layout.off_device
    ):

        def compile_(program):
            return _originals["jit"](
                _state_memory.compiled_step(program, strategy), *args, **kwargs
            )
    else:

        def compile_(program):
            return _originals["jit"](program, *args, **kwargs)

    steps = 1 if _is_state_step(kwargs) else 0  # (Keras also jits `concatenate`.)
    pacer = None if strategy is None else strategy.pacer
    return _Unpadding(compile_(step), step, compile_, steps=steps, pacer=pacer)


def _is_state_step(jit_kwargs: dict) -> bool:
    """Keras jits its steps `(state, data)` with the state donated (argument 0)."""
    return jit_kwargs.get("donate_argnums") == 0


class _Unpadding:
    """A compiled step that cuts padded batches itself (inside `jit`).

    Keeps the step before compilation and how it was compiled, so that
    `steps_per_execution` groups compile a program of several steps the same
    way (`training/_fused_steps.py`). Each call counts `steps` steps in the
    running call's `StepStats` (0: not a step) and is paced by `pacer`.
    """

    def __init__(
        self,
        compiled: Callable,
        step: Callable,
        compile_: Callable,
        *,
        steps: int,
        pacer: Pacer | None,
    ):
        self._compiled = compiled
        self._call_step = (
            _timed(compiled, steps=steps, pacer=pacer) if steps else compiled
        )
        self.step = step
        self.compile = compile_
        functools.update_wrapper(self, compiled)

    def __call__(self, *args, **kwargs):
        return self._call_step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._compiled, name)


def _make_function(self, step_function, concatenate_outputs=False):
    """Keras's step loop; a step that is not compiled by `_jit` is cut eagerly.

    A compiled step with `steps_per_execution > 1` runs its groups of batches
    as one program each (`FusedSteps`) while the strategy's
    `input_options.fuse_steps` is on (read at each group: Keras keeps the
    step functions it made across calls).
    """
    strategy = current_strategy()
    if not isinstance(step_function, _Unpadding):
        step_function = gathering(
            tracking(unpadding(step_function), _replicas), _take_rows
        )
        if concatenate_outputs:  # predict: whole outputs on every process.
            step_function = gathered_outputs(step_function)
        if strategy is not None and strategy.state_layout.off_device:
            step_function = _state_memory.eager_step(step_function, strategy)
        pacer = None if strategy is None else strategy.pacer
        step_function = _timed(step_function, steps=1, pacer=pacer)
    keras_loop = _originals["JAXTrainer._make_function"](
        self, step_function, concatenate_outputs
    )
    if (
        isinstance(step_function, _Unpadding)
        and self.steps_per_execution > 1
        and strategy is not None
    ):
        steps = self.steps_per_execution
        return FusedSteps(
            step_function.step,
            lambda program: _timed(
                step_function.compile(program), steps=steps, pacer=strategy.pacer
            ),
            steps=steps,
            concatenate=concatenate_outputs,
            keras_loop=keras_loop,
            enabled=lambda: strategy.input_options.fuse_steps,
        )
    return keras_loop


def _timed(program: Callable, *, steps: int, pacer: Pacer | None) -> Callable:
    """`program`, each call counted as `steps` steps in the call's `StepStats`.

    After each call, `pacer` bounds the programs in flight (CPU devices).
    """

    @functools.wraps(program)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        outputs = program(*args, **kwargs)
        _record_dispatch(start, steps)
        if pacer is not None:
            pacer.after(outputs)
        return outputs

    return timed


def _record_dispatch(start: float, steps: int) -> None:
    call = _call.active()
    if call is not None:
        call.step_stats.record(time.perf_counter() - start, steps)


def _distribute_data(data, layouts=None):
    strategy = current_strategy()
    if strategy is None:
        return _originals["_distribute_data"](data, layouts)
    return keras_batch(strategy, data)


def _get_distributed_iterator(self, distribution: Any):
    """Keras's per-pass batch iterator: one `InputPass` of the pipeline."""
    if not isinstance(distribution, Strategy):
        return _originals["JAXEpochIterator._get_distributed_iterator"](
            self, distribution
        )
    adapter = self.data_adapter
    resident = resident_pass(adapter, distribution)
    if resident is not None:  # In-memory arrays laid out on the mesh once.
        return resident
    name = type(adapter).__name__
    return InputPass(
        distribution,
        adapter.get_jax_iterator(),
        source=f"the {name.removesuffix('Adapter')} input",
        per_process=distribution.spans_processes
        and is_per_process(adapter_dataset(adapter)),
        keras=True,
        prefetch=0 if _reads_on_demand(self, name) else 1,
        channel="fit-input",
    )


def _reads_on_demand(epoch_iterator, adapter_name: str) -> bool:
    """Whether a pass must read each batch only when the step asks for it."""
    return adapter_name in _ONE_SHOT_ADAPTERS or (
        adapter_name in _EPOCH_BOUND_ADAPTERS
        and epoch_iterator.steps_per_epoch is not None
    )


def _enumerate_iterator(self):
    """Keras's epoch loop over batches; a resumed `fit` first replays.

    The replay drives Keras's own loop — the same `on_epoch_begin/end` of the
    adapter, the same iterator kept or renewed across epochs — reading each
    step's batches without training on them, so the state of the input is
    exactly the one an uninterrupted run had at the backed-up step.
    """
    original = _originals["JAXEpochIterator._enumerate_iterator"]
    call = _call.active()
    plan = call.take_resume() if call is not None and call.method == "fit" else None
    if plan is None:
        yield from original(self)
        return
    _check_replayable(self, plan)
    for _ in range(plan.epochs):
        with self.catch_stop_iteration():
            for _, _, iterator in original(self):
                _drop_step(iterator, self.steps_per_execution)
    for begin, end, iterator in original(self):
        if begin < plan.steps:
            ran_out = True
            with self.catch_stop_iteration():
                _drop_step(iterator, self.steps_per_execution)
                ran_out = False
            if ran_out:  # As in Keras's loop: the epoch ends there.
                return
            continue
        yield begin, end, iterator


def _drop_step(iterator, count: int) -> None:
    """What one Keras step takes from `iterator`, read and dropped.

    As Keras's step: the first batch must exist, the others may be missing.
    """
    skip = getattr(iterator, "skip", None)
    if skip is not None:
        if skip(count) == 0:
            raise StopIteration
        return
    next(iterator)
    for _ in range(count - 1):
        if next(iterator, None) is None:
            return


def _check_replayable(epoch_iterator, plan) -> None:
    adapter = epoch_iterator.data_adapter
    if (
        type(adapter).__name__ in _ONE_SHOT_ADAPTERS
        and epoch_iterator.steps_per_epoch is None
        and plan.epochs
    ):
        raise IncompatibleBackupError(
            "BackupAndRestore cannot resume this fit: its input is a Python "
            "generator read to its end every epoch, which cannot be read again "
            f"(the backup is at epoch {plan.epochs} of this fit, step "
            f"{plan.steps}). Received: x of type generator, steps_per_epoch=None. "
            "Pass an input that can be iterated again (a `keras.utils.PyDataset`, "
            "a `tf.data.Dataset`, arrays), or make the generator infinite and "
            "pass `steps_per_epoch`: `model.fit(make_generator(), "
            "steps_per_epoch=N, ...)`. The backup is kept."
        )
