"""The seams: what keras_dist changes in Keras, and the tables of names.

Everything else plugs into public Keras API: strategies subclass
`keras.distribution.DataParallel`, so Keras itself creates variables
replicated on the mesh and lays batches out over it. What the public API
cannot express is done here, on Keras's JAX trainer
(`keras.src.backend.jax.trainer`), checked against the builds
`CHECKED_BUILDS` (Keras 3.15.1 and keras-nightly 3.16.0.dev2026102704; a
name the nightly moved is found where it is, `_releases.py`). A public name
is wrapped wherever one reaches the function (`keras.Model.fit` is the
trainer's `fit`):

1. **Batches** (`_trainer.py`). Keras turns each host batch into a global
   array with the module function `_distribute_data` (per pass in
   `JAXEpochIterator._get_distributed_iterator`, the nightly's
   `_get_iterator`; the nightly also builds an unbuilt model from the
   adapter's first batch, which keras_dist reads through the epoch iterator
   as 3.15 does); on a batch that does not
   split evenly over the replicas it raises (keras#21167). While one of its
   strategies is current, keras_dist hands both to its input pipeline
   (`data/host/_pipeline.py`: check, pad, lay out, prefetch), wraps the module's
   `jit` and `JAXTrainer._make_function` so every step — compiled or eager —
   is a `StepProgram` (`training/_step.py`, the one step wrapper: it cuts a
   `PaddedBatch` back to its real rows first), and wraps
   `JAXEpochIterator._enumerate_iterator` so a resumed `fit` replays its
   input up to the backed-up step; `steps_per_execution` groups run as one
   program each (`training/_fused_steps.py`). In-memory arrays (`ArrayDataAdapter`)
   may instead be laid out on the mesh once, each step gathered on the
   devices from the indices of Keras's own batching (`_adapters.py`).
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

4. **Several processes** (`_processes.py`): each `fit/evaluate/predict` call
   is checked to be the same call on every process (else an error instead
   of a hang), non-chief processes do not print or log, `fit` shares the
   chief's NumPy random state (same shuffling), `predict` outputs are
   gathered on every process, and each of these calls returns on every
   process once every process's callbacks have ended it (`_model.py`: the
   chief's files complete). `keras.device("cpu:0")` (Keras's private
   `device_scope`) opens this process's first CPU, not process 0's.

5. **Optimizer state laid out by the strategy** (`_optimizer.py`): slots
   are created with the strategy's `state_layout.slot_layout` (ZeRO-1 shards them
   the weights stay replicated), and their update gets whole gradients.

6. **Split variables made in parts** (`_variables.py`): under a strategy,
   a variable the strategy splits is initialized by its initializer compiled
   with the variable's sharding as output (each device computes its part;
   Keras does so only from 250 MiB times the mesh size), and a NumPy value
   assigned to it (a loaded checkpoint) goes from the host straight to the
   parts. Same numbers as Keras; an initializer that cannot be traced takes
   Keras's path.

7. **Split variables spanning processes read back whole**
   (`_host_values.py`): `KerasVariable.__array__` (get_weights, saving)
   gathers a value with parts on other processes to every host.

8. **State in host memory** (`_variables.py`): under a strategy that
   keeps variables outside device memory (`CentralStorageStrategy`), the
   steps move their state to device memory first (`training/_step.py`);
   and `JaxVariable.value`, read to
   compute with it — while JAX traces (Keras's `compute_output_spec`, a
   user's `jax.jit(model)`) or eagerly by Keras's ops and the variable's
   operators (`model(x)`, `kernel[0]`, `kernel == x`) — gives a host-memory
   variable through a transfer to device memory. Read directly
   (`variable.value`, saving, Keras's trainer collecting its state), it is
   the stored array.

9. **Gradient accumulation as documented** (`_accumulation.py`): under a
   strategy, `gradient_accumulation_steps=N` computes one update per N
   micro-batches (inside the taken branch of a `lax.cond`) and learning-rate
   schedules see updates, not micro-steps
   (`keras_dist/training/_gradient_accumulation.py`).

10. **Loss scaling in `strategy.run`** (`_optimizer.py`):
    `LossScaleOptimizer.check_finite` refuses gradients that differ by
    replica (each replica would decide alone to skip a step) with the fix,
    `all_reduce("sum", grads)`, instead of a JAX error about manual axes.

11. **Keras's per-step loop without no-op work** (`_trainer.py`): the state
    between steps is stored untracked, and batch callbacks that no callback
    overrides are not dispatched.

12. **Layouts that fit any shape** (`_variables.distribute_tensor`): a layout handed to
    `keras.distribution.distribute_tensor` under a strategy (a `layout_map`
    rule for layer outputs, which `get_tensor_layout` gives by path alone)
    is fitted to the tensor's shape: a dimension its mesh axes do not divide
    stays whole instead of raising eagerly.

13. **A model saved by every process, written once** (`_save_calls.py`):
    `Model.save`, `Model.save_weights`, `keras.saving.save_model` /
    `save_weights` (and `keras.models.save_model`) on a model whose strategy
    spans processes: every process takes part, the chief writes one complete
    file (`_checkpoint/pipeline.save_once`), all return when it is
    complete; a process that is not saving is named at once. The same, and
    the load functions, for a `gs://`/`s3://` path: written and read whole
    through a local file.

`install()` is idempotent and is called when `keras_dist` is imported. With no
keras_dist strategy involved, every wrapped function behaves as Keras's own.
`tests/test_seams_keras.py` fails loudly when a Keras release moves a seam.
"""

from typing import Any

import jax
import keras

from keras_dist._private_api import _private, _releases
from keras_dist._private_api._access import global_seed as global_seed
from keras_dist._private_api._access import step_counter as step_counter
from keras_dist._private_api._access import sync_state as sync_state
from keras_dist._private_api._jax_seams import CHECKED_JAX, JAX_PRIVATE, KERAS_HOOKS
from keras_dist._private_api._jax_seams import find as _find
from keras_dist._private_api._state import originals as _originals
from keras_dist._seams._accumulation import (
    _backend_apply_gradients,
    _get_current_learning_rate,
    _iterations,
)
from keras_dist._seams._adapters import tf_dataset_adapter_init
from keras_dist._seams._host_values import _array
from keras_dist._seams._model import _entry_point, _step_builder
from keras_dist._seams._optimizer import (
    _add_variable_from_reference,
    _check_finite,
    _stateless_apply,
)
from keras_dist._seams._processes import local_device_scope
from keras_dist._seams._save_calls import bucket_gfile, loaded_locally, saved_once
from keras_dist._seams._trainer import (
    BATCH_HOOKS,
    _batch_hook,
    _distribute_data,
    _enumerate_iterator,
    _get_distributed_iterator,
    _jit,
    _layer_setattr,
    _make_function,
    _maybe_symbolic_build,
)
from keras_dist._seams._variables import (
    _assign,
    _direct_assign,
    _initialize_with_initializer,
    distribute_tensor,
    variable_value,
)
from keras_dist._version import __version__

# The Keras minor releases every seam was checked against (pyproject.toml pins
# `keras>=3.15,<3.17`; `.ci/run` runs the suite on both).
CHECKED_KERAS = ("3.15", "3.16")
# The builds `.ci/run` tests: the release, and the nightly of the next minor
# that `.ci/newest-stack.txt` pins.
CHECKED_BUILDS = ("3.15.1", "keras-nightly 3.16.0.dev2026102704")
ENTRY_POINTS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)
STEP_BUILDERS = ("make_train_function", "make_test_function", "make_predict_function")

# Keras's save functions: (module, name, whether it saves weights only, how
# a message names the call).
SAVE_FUNCTIONS = (
    ("keras", "Model.save", False, "model.save"),
    ("keras", "Model.save_weights", True, "model.save_weights"),
    ("keras.saving", "save_model", False, "keras.saving.save_model"),
    ("keras.models", "save_model", False, "keras.models.save_model"),
    ("keras.saving", "save_weights", True, "keras.saving.save_weights"),
)
# Keras's load functions: (module, name, whether the model comes first).
LOAD_FUNCTIONS = (
    ("keras", "Model.load_weights", True),
    ("keras.saving", "load_weights", True),
    ("keras.saving", "load_model", False),
    ("keras.models", "load_model", False),
)
_TRAINER = "keras.src.backend.jax.trainer"
_CORE = "keras.src.backend.jax.core"
_BASE_OPTIMIZER = "keras.src.optimizers.base_optimizer"
_ARRAYS = "keras.src.trainers.data_adapters"

# What keras_dist wraps or reads, as (module, "Owner.name" or "name", wrap):
# `install()` replaces it with `wrap(original)` and keeps the original in
# `_originals` under the same key; `wrap=None`: only read. Public Keras names
# where a public route reaches the same function (`keras.Model.fit` is the
# trainer's `fit`); a private name only where none does, with the reason.
_SEAMS: tuple = (
    # The trainer's loop: Keras compiles its steps with the module's `jit`
    # and lays batches out in module functions no public API reaches; the
    # per-pass iterator, the epoch loop, the step loop and the nightly's
    # build of an unbuilt model are private methods Keras calls itself.
    (_TRAINER, "jit", lambda original: _jit),
    (_TRAINER, "_distribute_data", lambda original: _distribute_data),
    (
        _TRAINER,
        "JAXEpochIterator._get_distributed_iterator",
        lambda original: _get_distributed_iterator,
    ),
    # Inherited from EpochIterator: set on the JAX subclass only.
    (
        _TRAINER,
        "JAXEpochIterator._enumerate_iterator",
        lambda original: _enumerate_iterator,
    ),
    (_TRAINER, "JAXTrainer._make_function", lambda original: _make_function),
    (
        _TRAINER,
        "JAXTrainer._symbolic_build",
        lambda original: _maybe_symbolic_build,
    ),
    # Public: a model's entry points and step builders, and the state sync.
    *(("keras", f"Model.{name}", _entry_point) for name in ENTRY_POINTS),
    *(("keras", f"Model.{name}", _step_builder) for name in STEP_BUILDERS),
    ("keras", "Model.jax_state_sync", None),
    # Public: the optimizer's slots, update and counter.
    (
        "keras.optimizers",
        "Optimizer.add_variable_from_reference",
        _add_variable_from_reference,
    ),
    ("keras.optimizers", "Optimizer.stateless_apply", _stateless_apply),
    ("keras.optimizers", "Optimizer.iterations", _iterations),
    ("keras.optimizers", "LossScaleOptimizer.check_finite", _check_finite),
    # Private: the rate a schedule gives at a step and the update of one
    # step, which Keras calls itself (gradient accumulation as documented).
    (
        _BASE_OPTIMIZER,
        "BaseOptimizer._get_current_learning_rate",
        _get_current_learning_rate,
    ),
    (
        "keras.src.backend.jax.optimizer",
        "JaxOptimizer._backend_apply_gradients",
        _backend_apply_gradients,
    ),
    # Private: how a new variable gets its value and how an assignment is
    # stored, which Keras calls itself (split variables made in parts).
    (_CORE, "JaxVariable._initialize_with_initializer", _initialize_with_initializer),
    (_CORE, "JaxVariable._direct_assign", _direct_assign),
    # Private: the conversion through which a variable's value joins a
    # computation (`_variables.joining_functions`).
    (_CORE, "convert_to_tensor", None),
    # Public: a variable's assignment, value and host copy.
    ("keras", "Variable.assign", _assign),
    ("keras", "Variable.value", variable_value),
    ("keras", "Variable.__array__", _array),
    # Private: the dataset Keras's tf.data adapter reads (per process).
    (
        f"{_ARRAYS}.tf_dataset_adapter",
        "TFDatasetAdapter.__init__",
        tf_dataset_adapter_init,
    ),
    # Public: the loop's state between steps, and its per-step callbacks.
    ("keras.layers", "Layer.__setattr__", _layer_setattr),
    *(
        ("keras.callbacks", f"CallbackList.{name}", _batch_hook(name))
        for name in BATCH_HOOKS
    ),
    # Private: the function Keras and libraries lay tensors out with (the
    # public `keras.distribution.distribute_tensor` calls it by module).
    ("keras.src.backend.jax.distribution_lib", "distribute_tensor", distribute_tensor),
    # Public: saving a model or its weights (written once with several processes).
    *(
        (module, name, saved_once(weights_only=weights_only, method=method))
        for module, name, weights_only, method in SAVE_FUNCTIONS
    ),
    # Public: loading a bucket's file (from a local copy, under a strategy).
    *(
        (module, name, loaded_locally(takes_model=takes_model))
        for module, name, takes_model in LOAD_FUNCTIONS
    ),
    # Private: the gfile Keras's file functions (its callbacks') send a URL to.
    ("keras.src.utils.file_utils", "gfile", bucket_gfile),
    # Private: the device scope `keras.device` opens (a process's own device).
    ("keras.src.backend", "device_scope", local_device_scope),
)

PRIVATE_MODULES = ("keras.src", "jax._src", "tensorflow.python", "orbax")


def private_seams() -> tuple:
    """The entries of `_SEAMS` that name a private module's function."""
    return tuple(entry for entry in _SEAMS if entry[0].startswith(PRIVATE_MODULES))


def _lookup(module_name: str, path: str) -> tuple[Any, str, Any]:
    """(owner, attribute, value) of `module.path`, wherever the installed
    Keras has it (`_releases.MOVED`); value None if missing."""
    return _releases.locate(module_name, path)


def seams() -> dict[str, Any]:
    """The private Keras and JAX objects keras_dist relies on, by name.

    Also the public Keras hooks the strategies override (`KERAS_HOOKS`) and
    the private JAX names of the cluster layer (`JAX_PRIVATE`), as
    `"module.Owner.name"`.

    Raises:
        ImportError: if a Keras or JAX release moved or removed one of them.
    """
    found = {path: _lookup(module, path)[2] for module, path, _ in _SEAMS}
    missing = [name for name, obj in found.items() if obj is None]
    hooks, missing_hooks = _find(KERAS_HOOKS)
    missing += missing_hooks + _private.check()
    originals = {path: _originals.get(path, obj) for path, obj in found.items()}
    changed = _private.check_signatures(originals)
    if missing or changed:
        raise ImportError(
            f"keras_dist {_version()} was checked against Keras "
            f"{' and '.join(CHECKED_BUILDS)}; Keras {keras.__version__} no longer "
            f"has {missing}{_changed(changed)}. {_pin_advice(keras.__version__)}"
        )
    private_jax, missing_jax = _find(JAX_PRIVATE)
    if missing_jax:
        raise ImportError(
            f"keras_dist {_version()} was checked against JAX {CHECKED_JAX}.x to "
            "0.12.x; "
            f"JAX {jax.__version__} no longer has {missing_jax}. Install "
            f"`jax>={CHECKED_JAX},<0.13` or upgrade keras_dist."
        )
    return {**found, **hooks, **private_jax}


_KERAS_PIN = f"keras>={CHECKED_KERAS[0]},<3.{int(CHECKED_KERAS[-1][2:]) + 1}"


def _pin_advice(installed: str) -> str:
    """What to install instead of the Keras `installed`."""
    if ".dev" in installed:
        return (
            f"This is a Keras nightly; the one checked is {CHECKED_BUILDS[-1]}: "
            f"`pip install --no-deps {CHECKED_BUILDS[-1].replace(' ', '==')}`. "
            f"Install `{_KERAS_PIN}` for the release, or upgrade keras_dist."
        )
    return f"Install `{_KERAS_PIN}` or upgrade keras_dist."


def _changed(changed: list[str]) -> str:
    return f", and changed the signatures of {changed}" if changed else ""


def _version() -> str:
    return __version__


def install() -> None:
    """Installs the seams described in the module docstring (idempotent)."""
    if _originals:
        return
    seams()
    for module, path, wrap in _SEAMS:
        if wrap is None:
            continue
        owner, attribute, original = _lookup(module, path)
        _originals[path] = original
        setattr(owner, attribute, wrap(original))
