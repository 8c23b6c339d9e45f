"""The one module where keras_dist reaches into private Keras code.

Everything else plugs into public Keras API: strategies subclass
`keras.distribution.DataParallel`, so Keras itself creates variables
replicated on the mesh and lays batches out over it. Three things the public
API cannot express are done here, on Keras's JAX trainer
(`keras.src.backend.jax.trainer`), checked against Keras `CHECKED_KERAS`:

1. **Partial batches.** Keras turns each host batch into a global array with
   the module function `_distribute_data` (per pass in
   `JAXEpochIterator._get_distributed_iterator`); on a batch that does not
   split evenly over the replicas it raises (keras#21167). keras_dist
   replaces both, while one of its strategies is current, with
   `Strategy._distribute_batch` (pad + record the real size; batches of one
   pass must keep their structure, rank and dtype), and wraps the module's
   `jit` so every compiled step first cuts a `PaddedBatch` back to its real
   rows.
2. **A model remembers its strategy.** `fit`, `evaluate`, `predict` and the
   `*_on_batch` methods enter the scope of the strategy the model was built
   under when no scope is open (the tf.distribute tutorials call `fit`
   outside the scope). Before a step is compiled (`make_*_function`),
   variables created outside any scope (model, optimizer or metric objects)
   are moved onto the strategy, and variables of another strategy are
   refused with an error that says how to fix the script.
3. **A failed call leaves the model usable.** Keras detaches ("purges") the
   variables' values while a loop runs and reattaches them at the end; when a
   step raises, they stay `None` and every later call fails with
   `TypeError: 'NoneType' object is not callable`. keras_dist reattaches them.

`install()` is idempotent and is called by the first `Strategy`. With no
keras_dist strategy involved, every wrapped function behaves as Keras's own.
`tests/test_keras_compat.py` fails loudly when a Keras release moves a seam.
"""

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import keras
import numpy as np

from keras_dist.data._batch_checks import BatchSignature
from keras_dist.data._partial_batch import batch_size_of, unpadding
from keras_dist.errors import StrategyMismatchError

CHECKED_KERAS = "3.15"
ENTRY_POINTS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)
STEP_BUILDERS = ("make_train_function", "make_test_function", "make_predict_function")
_BATCH_ARGS = ("batch_size", "validation_batch_size")
_SCOPE_FIX = (
    "Create and compile the model inside `strategy.scope()`:\n\n"
    "    with strategy.scope():\n"
    "        model = make_model()\n"
    "        model.compile(...)\n"
    "    model.fit(...)"
)

_originals: dict[str, Any] = {}


def _trainer_module():
    from keras.src.backend.jax import trainer

    return trainer


def seams() -> dict[str, Any]:
    """The private Keras objects keras_dist relies on, by name.

    Raises:
        ImportError: if a Keras release moved or removed one of them.
    """
    module = _trainer_module()
    found = {
        "trainer.jit": getattr(module, "jit", None),
        "trainer._distribute_data": getattr(module, "_distribute_data", None),
        "trainer.JAXTrainer": getattr(module, "JAXTrainer", None),
        "trainer.JAXEpochIterator._get_distributed_iterator": getattr(
            getattr(module, "JAXEpochIterator", None), "_get_distributed_iterator", None
        ),
    }
    trainer_cls = found["trainer.JAXTrainer"]
    for name in (*ENTRY_POINTS, *STEP_BUILDERS, "jax_state_sync"):
        found[f"JAXTrainer.{name}"] = getattr(trainer_cls, name, None)
    missing = [name for name, obj in found.items() if obj is None]
    if missing:
        raise ImportError(
            f"keras_dist {_version()} was checked against Keras {CHECKED_KERAS}.x; "
            f"Keras {keras.__version__} no longer has {missing}. Install "
            f"`keras>={CHECKED_KERAS},<3.16` or upgrade keras_dist."
        )
    return found


def _version() -> str:
    from keras_dist import __version__

    return __version__


def install() -> None:
    """Installs the three seams described in the module docstring (idempotent)."""
    if _originals:
        return
    seams()
    module = _trainer_module()
    _originals["jit"] = module.jit
    _originals["_distribute_data"] = module._distribute_data
    module.jit = _jit
    module._distribute_data = _distribute_data
    iterator_cls = module.JAXEpochIterator
    _originals["_get_distributed_iterator"] = iterator_cls._get_distributed_iterator
    iterator_cls._get_distributed_iterator = _get_distributed_iterator
    for name in ENTRY_POINTS:
        method = getattr(module.JAXTrainer, name)
        _originals[f"JAXTrainer.{name}"] = method
        setattr(module.JAXTrainer, name, _entry_point(method))
    for name in STEP_BUILDERS:
        method = getattr(module.JAXTrainer, name)
        _originals[f"JAXTrainer.{name}"] = method
        setattr(module.JAXTrainer, name, _step_builder(method))


def _current_strategy():
    from keras_dist.strategies._base import Strategy

    current = keras.distribution.distribution()
    return current if isinstance(current, Strategy) else None


def _jit(fun: Callable, *args, **kwargs):
    return _originals["jit"](unpadding(fun), *args, **kwargs)


def _distribute_data(data, layouts=None):
    strategy = _current_strategy()
    if strategy is None:
        return _originals["_distribute_data"](data, layouts)
    return strategy._distribute_batch(data)


def _get_distributed_iterator(self, distribution):
    """Keras's per-pass batch iterator, with keras_dist's checks and padding."""
    from keras_dist.strategies._base import Strategy

    if not isinstance(distribution, Strategy):
        yield from _originals["_get_distributed_iterator"](self, distribution)
        return
    name = type(self.data_adapter).__name__.removesuffix("Adapter")
    signature = BatchSignature(f"the {name} input")
    skip = _replay(self, distribution)
    for index, data in enumerate(self.data_adapter.get_jax_iterator()):
        if index < skip:
            continue
        signature.check(data, index)
        if index == 0:
            distribution._observed_batch_size = batch_size_of(data)
        yield distribution._distribute_batch(data)


def _replay(epoch_iterator, strategy) -> int:
    """Carries out a pending `ResumePlan`; returns the batches to skip."""
    plan = getattr(strategy, "_resume_plan", None)
    if plan is None:
        return 0
    strategy._resume_plan = None
    adapter = epoch_iterator.data_adapter
    for _ in range(plan.replay_passes):  # Repeat every random draw of the input.
        for _ in adapter.get_jax_iterator():
            pass
        adapter.on_epoch_end()
        adapter.on_epoch_begin()
    # Keras counts the epoch's steps; the skipped ones are already done.
    epoch_iterator._steps_seen += plan.skip_batches
    return plan.skip_batches


def _entry_point(method: Callable) -> Callable:
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(model, *args, **kwargs):
        strategy = _strategy_for(model)
        if strategy is None:
            return method(model, *args, **kwargs)
        _check_batch_sizes(signature, strategy, model, args, kwargs)
        if method.__name__ == "fit":
            bound = signature.bind_partial(model, *args, **kwargs).arguments
            model._keras_dist_initial_epoch = bound.get("initial_epoch", 0)
        _place_variables(model, strategy, move=False)  # Refuse before building.
        with contextlib.ExitStack() as stack:
            if keras.distribution.distribution() is None:
                stack.enter_context(strategy.scope())
            snapshot = [(v, v._value) for v in _variables(model)]
            try:
                return method(model, *args, **kwargs)
            except BaseException:
                _reattach(model, snapshot)
                raise

    wrapper._keras_dist_wrapped = method
    return wrapper


def _step_builder(method: Callable) -> Callable:
    """Before a step is compiled, every variable must live on the strategy."""

    @functools.wraps(method)
    def wrapper(model, force=False):
        strategy = _current_strategy()
        if strategy is not None and _place_variables(model, strategy):
            force = True  # A cached step carries the old placement.
        return method(model, force=force)

    wrapper._keras_dist_wrapped = method
    return wrapper


def _variables(model) -> list:
    """Every variable a training loop touches: model, optimizer, metrics."""
    groups = [model.trainable_variables, model.non_trainable_variables]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "variables"):
        groups.append(optimizer.variables)
    groups.append(getattr(model, "metrics_variables", []))
    seen, out = set(), []
    for group in groups:
        for v in group:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def _strategy_for(model):
    """The current keras_dist strategy, else the one the model was built under."""
    from keras_dist.strategies._base import strategy_of_variable

    if keras.distribution.distribution() is not None:
        return _current_strategy()
    for v in _variables(model):
        strategy = strategy_of_variable(v)
        if strategy is not None:
            return strategy
    return None


def _check_batch_sizes(signature, strategy, model, args, kwargs) -> None:
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError:
        return  # Keras reports wrong arguments itself.
    for name in _BATCH_ARGS:
        value = bound.arguments.get(name)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, np.integer))
            or value <= 0
        ):
            raise ValueError(
                f"`{name}` must be a positive integer: the global batch, split "
                f"over the {strategy.num_replicas_in_sync} replicas of "
                f"{strategy!r}. Received: {name}={value!r}. For example "
                f"{name}={32 * strategy.num_replicas_in_sync}."
            )


def _place_variables(model, strategy, *, move: bool = True) -> bool:
    """Moves variables built outside any scope onto `strategy`; refuses others.

    Returns whether a variable was moved (never, with `move=False`).
    """
    from keras_dist.strategies._base import strategy_of_variable

    moved = False
    for v in _variables(model):
        if getattr(v, "_value", None) is None:
            continue
        owner = strategy_of_variable(v)
        if owner is not None and owner.devices == strategy.devices:
            continue
        if owner is not None or getattr(v, "_layout", None) is not None:
            where = owner if owner is not None else v._layout
            raise StrategyMismatchError(
                f"Variable {v.path!r} was created under {where!r}, but the model "
                f"is being run under {strategy!r}. A model belongs to the "
                f"strategy it was built in. {_SCOPE_FIX}"
            )
        if not move:
            continue
        v._layout = strategy.get_variable_layout(v)
        v._direct_assign(v._value)
        moved = True
    if moved:  # Compiled steps carry the old placement; rebuild them all.
        model.train_function = model.test_function = model.predict_function = None
    return moved


def _reattach(model, snapshot) -> None:
    """Puts values back on variables that a failed loop left detached."""
    state = getattr(model, "_jax_state", None)
    if state and not getattr(model, "_jax_state_synced", True):
        with contextlib.suppress(Exception):
            model.jax_state_sync()
    model._jax_state = None
    model._jax_state_synced = True
    for v, value in snapshot:
        if v._value is None and value is not None:
            if isinstance(value, jax.Array) and value.is_deleted():
                continue  # Donated to a step that ran; nothing left to restore.
            v._value = value


def sync_state(model) -> None:
    """Writes the state a running `fit` holds back into the Keras variables.

    The JAX trainer keeps the state outside the variables between steps;
    after this, variables can be read or assigned, and the trainer re-reads
    them before its next step.
    """
    if getattr(model, "_jax_state", None) and not getattr(
        model, "_jax_state_synced", True
    ):
        model.jax_state_sync()
