"""Seam 1: Keras's JAX trainer loop — its batches, its steps, its per-step hooks.

Thin: the work is in `keras_dist/data/` (`_pipeline.InputPass`, the resume
replay of `_call.ResumePlan`) and `keras_dist/training/_step.py`. These
functions only connect Keras's JAX trainer to them:

- `_get_distributed_iterator`: each pass of `fit/evaluate/predict` is an
  `InputPass` over the data adapter's batches, or, for in-memory arrays the
  strategy's `input_options` put on the mesh, a `ResidentPass` over the
  indices of Keras's batches (`_adapters.py`).
- `_distribute_data`: the single batch of `*_on_batch`.
- `_jit` and `_make_function`: every step — compiled or eager, one batch or
  `steps_per_execution` of them — is a `StepProgram`, the one step wrapper
  (`training/_step.py`: gather a device-resident batch, record its replica
  rows, cut a padded batch to its real rows, outputs whole on every process,
  host-memory state moved in; timed and paced). With `steps_per_execution
  > 1` and a compiled step, `_make_function` runs each group of batches as
  one program (`training/_fused_steps.py`), compiled as the step is.
- `_enumerate_iterator`: a resumed `fit` replays its finished epochs and
  steps through Keras's own epoch iterator before the first real step.

Between two steps, Keras's loops (`fit`, `evaluate`, `predict`) also do two
things a small model pays for and that change nothing:

1. `self._jax_state = {...}` (the state between steps) goes through
   `Layer.__setattr__`, which wraps the dict and each of its lists in Keras's
   tracking proxies and tests every array against the tracked types: work
   that grows with the number of variables, for a dict that never holds a
   variable. Under a keras_dist strategy the dict is stored as it is
   (`_layer_setattr`). Keras reads it back with `.get` either way.
2. `callbacks.on_*_batch_begin/end(step, logs)` runs (or, for `end`, submits
   to a thread pool) a call that turns every log into a Python number,
   waiting for the step, and then calls each callback's hook. When no
   callback overrides the hook (`keras.callbacks.Callback`'s are no-ops,
   marked `@default`), keras_dist skips the call (`_batch_hook`): nothing
   would have read the logs. A callback that overrides it, `ProgbarLogger`
   when `verbose` is not 0, or an object that is not a Keras `Callback`
   gets Keras's own call.

With no keras_dist strategy current, everything here behaves exactly as
Keras's.
"""

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import keras
from keras.src.utils.python_utils import is_default

from keras_dist._private_api._state import originals as _originals
from keras_dist._seams._adapters import (
    ARRAY_ADAPTER,
    adapter_dataset,
    resident_pass,
)
from keras_dist.cluster import _heartbeat
from keras_dist.data import _call
from keras_dist.data.host._auto_shard import is_per_process
from keras_dist.data.host._pipeline import InputPass, keras_batch
from keras_dist.errors import IncompatibleBackupError
from keras_dist.strategies._base import Strategy
from keras_dist.training._fused_steps import FusedSteps, batch_by_batch
from keras_dist.training._step import StepProgram, TimedStep

__all__ = [
    "BATCH_HOOKS",
    "_batch_hook",
    "_distribute_data",
    "_enumerate_iterator",
    "_get_distributed_iterator",
    "_jit",
    "_layer_setattr",
    "_make_function",
    "_maybe_symbolic_build",
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


def _jit(fun: Callable, *args, **kwargs):
    """Keras's `jit`: a step under a strategy becomes a compiled `StepProgram`.

    Keras jits its steps `(state, data)` with the state donated (argument 0);
    anything else it jits (`concatenate`) is compiled as it asks.
    """
    strategy = current_strategy()
    if kwargs.get("donate_argnums") != 0:
        return _originals["jit"](fun, *args, **kwargs)
    if strategy is None:  # Plain Keras: only timed (`ScalingReport`).
        return TimedStep(_originals["jit"](fun, *args, **kwargs))
    return StepProgram(
        fun,
        strategy,
        predict=getattr(fun, "__name__", "") == "predict_step",
        jit=lambda program: _originals["jit"](program, *args, **kwargs),
    )


def _make_function(self, step_function, out_shardings=None, concatenate_outputs=False):
    """Keras's step loop over a `StepProgram` (an eager step becomes one).

    A compiled step with `steps_per_execution > 1` runs its groups of batches
    as one program each (`FusedSteps`) while the strategy's
    `input_options.fuse_steps` is on (read at each group: Keras keeps the
    step functions it made across calls).

    Keras 3.15 compiles the step before this call; the nightly compiles it
    here (`out_shardings`) and runs `steps_per_execution` batches stacked
    into a super-batch, which keras_dist's pipeline does not make: under a
    strategy, its step is compiled as 3.15's, and its groups are batches.
    """
    original = _originals["JAXTrainer._make_function"]
    compiles_here = _compiles_its_step(original)
    strategy = current_strategy()
    if strategy is None:
        if compiles_here:
            return original(self, step_function, out_shardings, concatenate_outputs)
        if not isinstance(step_function, TimedStep):
            step_function = TimedStep(step_function)  # Plain Keras's eager step.
        return original(self, step_function, concatenate_outputs)
    if compiles_here and not self.run_eagerly and self.jit_compile:
        step_function = _jit(
            step_function, donate_argnums=0, out_shardings=out_shardings
        )
    if not isinstance(step_function, StepProgram):
        step_function = StepProgram(
            step_function, strategy, predict=concatenate_outputs, jit=None
        )
    steps = self.steps_per_execution
    if compiles_here:
        keras_loop = batch_by_batch(step_function, steps, concatenate_outputs)
    else:
        keras_loop = original(self, step_function, concatenate_outputs)
    if step_function.compiled and steps > 1:
        program = step_function  # Its strategy: the one it was made under.
        return FusedSteps(
            step_function.step,
            step_function.group(steps),
            steps=steps,
            concatenate=concatenate_outputs,
            keras_loop=keras_loop,
            enabled=lambda: program.strategy.input_options.fuse_steps,
        )
    return keras_loop


@functools.cache
def _compiles_its_step(make_function: Callable) -> bool:
    """Whether Keras's `_make_function` compiles the step itself (the nightly)."""
    return "out_shardings" in inspect.signature(make_function).parameters


def _distribute_data(data, layouts=None, *args, **kwargs):
    strategy = current_strategy()
    if strategy is None:
        return _originals["_distribute_data"](data, layouts, *args, **kwargs)
    return keras_batch(strategy.placement, data)


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    """The nightly's build of an unbuilt model before `fit`/`evaluate`.

    It reads the adapter's first batch itself, around keras_dist's input
    pipeline (its checks, the call's global batch size that callbacks read
    in `on_train_begin`). Under a strategy the build reads the epoch
    iterator instead, as Keras 3.15 builds (`_symbolic_build(iterator)`).
    On Keras 3.15 this wraps `_symbolic_build` itself (`_releases.MOVED`)
    and passes through.
    """
    original = _originals["JAXTrainer._symbolic_build"]
    if (
        original.__name__ == "_symbolic_build"
        or current_strategy() is None
        or iterator is None
        or data_batch is not None
    ):
        return original(self, iterator=iterator, data_batch=data_batch)
    return self._symbolic_build(iterator=iterator)


def _get_distributed_iterator(self, *distribution: Any):
    """Keras's per-pass batch iterator: one `InputPass` of the pipeline.

    Keras 3.15 passes the distribution; the nightly's `_get_iterator` takes
    none (the current one is the same).
    """
    current = distribution[0] if distribution else keras.distribution.distribution()
    if not isinstance(current, Strategy):
        return _originals["JAXEpochIterator._get_distributed_iterator"](
            self, *distribution
        )
    adapter = self.data_adapter
    name = type(adapter).__name__
    if name == ARRAY_ADAPTER:
        resident = resident_pass(adapter, current.placement)
        if resident is not None:  # In-memory arrays laid out on the mesh once.
            return resident
    return InputPass(
        current.placement,
        adapter.get_jax_iterator(),
        source=f"the {name.removesuffix('Adapter')} input",
        per_process=current.placement.spans_processes
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
    training = call is not None and call.method == "fit"
    if plan is None:
        for begin, end, iterator in original(self):
            if call is not None:
                call.last_end_step = end
            _count(begin, end, training)
            yield begin, end, iterator
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
        if call is not None:
            call.last_end_step = end
        _count(begin, end, training)
        yield begin, end, iterator


_PROGRESS = _heartbeat.PROGRESS


def _count(begin: int, end: int, training: bool) -> None:
    """The launcher's heartbeat counts the steps (`cluster/_heartbeat.py`)."""
    _PROGRESS.progress += end - begin + 1
    if training:
        _PROGRESS.step += end - begin + 1


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


# `CallbackList` method -> the `Callback` hooks it calls (Keras's default
# `on_train_batch_*` also calls the legacy `on_batch_*` alias).
BATCH_HOOKS: dict[str, tuple[str, ...]] = {
    "on_train_batch_begin": ("on_train_batch_begin", "on_batch_begin"),
    "on_train_batch_end": ("on_train_batch_end", "on_batch_end"),
    "on_test_batch_begin": ("on_test_batch_begin",),
    "on_test_batch_end": ("on_test_batch_end",),
    "on_predict_batch_begin": ("on_predict_batch_begin",),
    "on_predict_batch_end": ("on_predict_batch_end",),
}


def _layer_setattr(original: Callable) -> Callable:
    """`Layer.__setattr__`, storing the loop's `_jax_state` untracked."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            name == "_jax_state"
            and current_strategy() is not None
            and not keras.config.is_nnx_enabled()
        ):
            object.__setattr__(self, name, value)
            return
        original(self, name, value)

    return __setattr__


# CallbackList -> {hook name: (what the decision was made for, skip?)}: a
# list's callbacks are asked once a call, not at every step.
_DECISIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _batch_hook(name: str) -> Callable[[Callable], Callable]:
    """A wrapper for `CallbackList.<name>` that skips it when it does nothing."""
    hooks = BATCH_HOOKS[name]

    def wrap(original: Callable) -> Callable:
        def hook(self, batch, logs=None):
            key = (keras.distribution.distribution(), tuple(map(id, self.callbacks)))
            decisions = _DECISIONS.setdefault(self, {})
            known = decisions.get(name)
            if known is None or known[0] != key:
                skip = current_strategy() is not None and not any(
                    _overrides(callback, hooks) for callback in self.callbacks
                )
                known = decisions[name] = (key, skip)
            if known[1]:
                return None
            return original(self, batch, logs)

        hook.__name__ = hook.__qualname__ = name
        return hook

    return wrap


def _overrides(callback: Any, hooks: tuple[str, ...]) -> bool:
    return not all(is_default(getattr(callback, hook, None)) for hook in hooks)
