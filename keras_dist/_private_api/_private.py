"""Every private name of Keras, JAX and TensorFlow keras_dist uses, by kind.

The functions keras_dist wraps or reads by name are `_SEAMS`
(`keras_dist/_seams/_install.py`), the private JAX names of the cluster layer
`JAX_PRIVATE` (`_jax_seams.py`).
This module lists the rest, so that the fence is whole:

- `PRIVATE_IMPORTS`: names imported from private modules (`keras.src`,
  `jax._src`, `tensorflow.python`), as `(module, name)`.
- `PRIVATE_ATTRIBUTES`: private attributes of other packages' objects that
  keras_dist reads, writes or calls on an instance (or through `self` in a
  subclass), as `(module, "Class", attributes)`: an instance attribute is
  found in the source of the class or one of its bases.
- `TF_PRIVATE_ATTRIBUTES`: the same for tf.data's classes. Checked when
  TensorFlow is already imported (keras_dist never imports it itself at
  import time); `data/_tf_data.py` treats a missing one as "unknown".
- `SIGNATURES`: the parameters each wrapped function was written for.

`check()` fails loudly (an `ImportError` naming the missing names) when a
release moves one: at `import keras_dist` for Keras and JAX; Orbax's names
at Orbax's first use (`_checkpoint/orbax_store.py`: keras_dist imports
Orbax only to checkpoint); `tests/test_fence.py` reads every private name the code
of `keras_dist/` uses from its syntax tree and compares it with these tables.
"""

import functools
import inspect
import re
import sys
from typing import Any

from keras_dist._private_api import _releases

__all__ = [
    "PRIVATE_ATTRIBUTES",
    "PRIVATE_IMPORTS",
    "SIGNATURES",
    "TF_PRIVATE_ATTRIBUTES",
    "check",
    "check_signatures",
]

_OPTIMIZER = "keras.src.optimizers.base_optimizer"

# Each with the reason no public route exists in Keras 3.15.1 and the nightly.
PRIVATE_IMPORTS: tuple = (
    # _adapters: Keras's own conversion of in-memory arrays for JAX, so that
    # device-resident data holds exactly what Keras's batches would.
    ("keras.src.trainers.data_adapters.array_slicing", "convert_to_sliceable"),
    # _loop: whether a callback overrides a hook (Keras marks its no-op
    # defaults with `@default`, and exports no test for the mark).
    ("keras.src.utils.python_utils", "is_default"),
    # _variables: initializers' seeds as Keras draws them (split variables
    # made in parts give Keras's values); no public seed drawing.
    ("keras.src.initializers.random_initializers", "RandomInitializer"),
    ("keras.src.random.seed_generator", "draw_seed"),
    # _access.global_seed: whether `keras.utils.set_random_seed` was called
    # (processes then need not agree on one); no public getter.
    ("keras.src.utils.rng_utils", "get_random_seed"),
    # _access.set_random_seed: the lazy TensorFlow module Keras's
    # `set_random_seed` imports TensorFlow through (to seed tf.data), stood
    # in for while keras_dist seeds a program that has not imported it.
    ("keras.src.utils", "rng_utils"),
    # _variables: the class whose operators read a variable's value into a
    # computation (`keras.Variable` is its backend subclass).
    ("keras.src.backend.common.variables", "Variable"),
    # _jax_private: JAX's cluster detection, coordination client and backend
    # state, read before any device starts; no public API.
    ("jax._src", "clusters"),
    ("jax._src.clusters", "cloud_tpu_cluster"),
    ("jax._src", "distributed"),
    ("jax._src", "xla_bridge"),
    # _tf_private: tf.distribute's file sharding and a pipeline's inputs,
    # which tf.data does not export.
    ("tensorflow.python.data.experimental.ops", "distribute"),
    ("tensorflow.python.data.ops", "dataset_ops"),
    # _keras_saving: Keras's own saving walk and file writer (`H5IOStore`, h5py),
    # split so the file is written from a host snapshot on a background
    # thread: the public `save_weights` / `save` read the live variables
    # while they write, on the training thread.
    *(
        ("keras.src.saving.saving_lib", name)
        for name in (
            "_save_state",
            "_serialize_model_as_json",
            "_save_assets_to_dict",
            "_write_to_zip_recursively",
            "_ASSETS_DIRNAME",
            "_CONFIG_FILENAME",
            "_METADATA_FILENAME",
            "_VARS_FNAME_H5",
            "H5IOStore",
            "DiskIOStore",
        )
    ),
)

PRIVATE_ATTRIBUTES: tuple = (
    # _adapters: the arrays and batching of Keras's array adapter, for data
    # laid out on the devices once (the adapter exposes only its batches).
    (
        "keras.src.trainers.data_adapters.array_data_adapter",
        "ArrayDataAdapter",
        ("_inputs", "_batch_size", "_shuffle", "_num_samples", "_get_iterator"),
    ),
    # _adapters: the dataset Keras's tf.data adapter reads, replaced by this
    # process's share (Keras 3.16 dropped the distribution hook for it).
    (
        "keras.src.trainers.data_adapters.tf_dataset_adapter",
        "TFDatasetAdapter",
        ("_dataset",),
    ),
    # _variables, _access: a variable's stored array, its layout and Keras's
    # layout step (split variables made in parts, host-memory state); a
    # variable exposes only its value, which reading may transfer.
    (
        "keras.src.backend.jax.core",
        "JaxVariable",
        ("_value", "_dtype", "_shape", "_layout", "_initialize_layout"),
    ),
    # _access.sync_state, _loop: the state Keras's loop holds between steps
    # (callbacks must see it written back; no public test of it).
    (
        "keras.src.backend.jax.trainer",
        "JAXTrainer",
        ("_jax_state", "_jax_state_synced"),
    ),
    # _access: the epoch `fit` starts from (Keras's `BackupAndRestore` sets
    # it so), the arguments `compile` was called with (the public
    # `get_compile_config()` serializes them, importing TensorFlow at the
    # first `fit`); _loop: the nightly's build of an unbuilt model from
    # batches.
    (
        "keras.src.trainers.trainer",
        "Trainer",
        ("_initial_epoch", "_compile_config", "_symbolic_build"),
    ),
    # _access: the arguments a loss made from a function passes it (Keras
    # 3.16 keeps `ignore_class` only there; `get_config()` serializes the
    # function too, importing TensorFlow at the first `fit`).
    ("keras.src.losses.losses", "LossFunctionWrapper", ("_fn_kwargs",)),
    # _access: the learning-rate object (the public `learning_rate` is its
    # evaluated value, and its setter untracks the variable and cannot put
    # it back over a schedule), the micro-step counter and accumulators of
    # gradient accumulation, and tracking a new optimizer variable.
    (
        _OPTIMIZER,
        "BaseOptimizer",
        (
            "_learning_rate",
            "_iterations",
            "_track_variable",
            "_accumulated_gradients",
            "_get_variable_index",
            "_trainable_variables",
        ),
    ),
    # _hooks: a training batch's statistics, computed per replica or over all
    # replicas; Keras computes them in this private step of `call`.
    (
        "keras.src.layers.normalization.batch_normalization",
        "BatchNormalization",
        ("_moments", "_reduction_axes"),
    ),
    # _orbax_private: the v1 Checkpointer's v0 manager, whose preemption
    # queries (at every save, and from its commit thread with the saved
    # step) have no public switch; they break the agreement on a step.
    (
        "orbax.checkpoint.experimental.v1._src.training.checkpointer",
        "Checkpointer",
        ("_manager",),
    ),
    # _hooks.ModelCheckpointHooks: the save Keras's `ModelCheckpoint` decides
    # on, made in the background; Keras's file name and save decision.
    (
        "keras.src.callbacks.model_checkpoint",
        "ModelCheckpoint",
        ("_save_model", "_get_file_path", "_should_save_model", "_current_epoch"),
    ),
)

TF_PRIVATE_ATTRIBUTES: tuple = (
    (
        "tensorflow.python.data.ops.dataset_ops",
        "DatasetV2",
        ("_inputs",),
    ),
    (
        "tensorflow.python.data.ops.dataset_ops",
        "UnaryDataset",
        ("_input_dataset",),
    ),
    (
        "tensorflow.python.data.ops.dataset_ops",
        "DatasetV1Adapter",
        ("_dataset",),
    ),
    ("tensorflow.python.data.ops.dataset_ops", "UnaryUnchangedStructureDataset", ()),
    (
        "tensorflow.python.data.experimental.ops.distribute",
        "_AutoShardDataset",
        (),
    ),
)

# What each wrapped function (`_SEAMS`) was written for: its parameters, in
# order (a prefix for JAX's `jit`, whose later options keras_dist passes on).
SIGNATURES: dict[str, tuple] = {
    "jit": ("fun",),
    # The save functions (`_save_calls`) bind their arguments by name.
    "Model.save": ("self", "filepath", "overwrite", "zipped", "kwargs"),
    "Model.save_weights": ("self", "filepath", "overwrite", "max_shard_size"),
    "save_model": ("model", "filepath", "overwrite", "zipped", "kwargs"),
    "save_weights": ("model", "filepath", "overwrite", "max_shard_size", "kwargs"),
    "Model.load_weights": ("self", "filepath", "skip_mismatch", "kwargs"),
    "load_weights": ("model", "filepath", "skip_mismatch", "kwargs"),
    "load_model": ("filepath", "custom_objects", "compile", "safe_mode"),
    # Not a function: the lazy stand-in for TensorFlow's gfile module that
    # Keras's file functions send a URL to (its class and module name).
    "gfile": ("LazyModule", "tensorflow.io.gfile"),
    "device_scope": ("device_name",),
    # Keras 3.15, then the nightly (its super-batches of `steps_per_execution`).
    "_distribute_data": (("data", "layouts"), ("data", "layouts", "is_super_batch")),
    # The nightly's `_get_iterator` (`_releases.MOVED`) takes no distribution.
    "JAXEpochIterator._get_distributed_iterator": (("self", "distribution"), ("self",)),
    "JAXEpochIterator._enumerate_iterator": ("self",),
    "JAXTrainer._symbolic_build": ("self", "iterator", "data_batch"),
    "JAXTrainer._make_function": (
        ("self", "step_function", "concatenate_outputs"),
        ("self", "step_function", "out_shardings", "concatenate_outputs"),
    ),
    "Model.fit": (
        "self",
        "x",
        "y",
        "batch_size",
        "epochs",
        "verbose",
        "callbacks",
        "validation_split",
        "validation_data",
        "shuffle",
        "class_weight",
        "sample_weight",
        "initial_epoch",
        "steps_per_epoch",
        "validation_steps",
        "validation_batch_size",
        "validation_freq",
    ),
    "Model.evaluate": (
        "self",
        "x",
        "y",
        "batch_size",
        "verbose",
        "sample_weight",
        "steps",
        "callbacks",
        "return_dict",
        "kwargs",
    ),
    "Model.predict": ("self", "x", "batch_size", "verbose", "steps", "callbacks"),
    "Model.train_on_batch": (
        "self",
        "x",
        "y",
        "sample_weight",
        "class_weight",
        "return_dict",
    ),
    "Model.test_on_batch": ("self", "x", "y", "sample_weight", "return_dict"),
    "Model.predict_on_batch": ("self", "x"),
    "Model.make_train_function": ("self", "force"),
    "Model.make_test_function": ("self", "force"),
    "Model.make_predict_function": ("self", "force"),
    "Optimizer.add_variable_from_reference": (
        "self",
        "reference_variable",
        "name",
        "initializer",
    ),
    "Optimizer.stateless_apply": (
        "self",
        "optimizer_variables",
        "grads",
        "trainable_variables",
    ),
    "BaseOptimizer._get_current_learning_rate": ("self",),
    "Optimizer.iterations": ("self",),
    "JaxOptimizer._backend_apply_gradients": ("self", "grads", "trainable_variables"),
    "LossScaleOptimizer.check_finite": ("self", "grads"),
    "JaxVariable._initialize_with_initializer": ("self", "initializer"),
    "Variable.assign": ("self", "value"),
    "JaxVariable._direct_assign": ("self", "value"),
    "Variable.value": ("self",),
    "Variable.__array__": ("self", "dtype"),
    "TFDatasetAdapter.__init__": ("self", "dataset", "class_weight", "distribution"),
    "Layer.__setattr__": ("self", "name", "value"),
    "distribute_tensor": ("tensor", "layout"),
    **{
        f"CallbackList.on_{mode}_batch_{end}": ("self", "batch", "logs")
        for mode in ("train", "test", "predict")
        for end in ("begin", "end")
    },
}


def _class(module: str, name: str) -> Any:
    return _releases.find(f"{module}.{name}")


def _class_source(klass: type) -> str:
    """The source of `klass`'s top-level block, read from its file.

    Sliced from the file's text without tokenizing it (`inspect.getsource`
    tokenizes the whole module, for each of this table's classes, at every
    `import keras_dist`).
    """
    try:
        path = inspect.getsourcefile(klass)
    except TypeError:
        return ""
    if path is None:
        return ""
    text = _file_text(path)
    start = re.search(rf"^class {re.escape(klass.__name__)}\b", text, re.MULTILINE)
    if start is None:
        return ""
    end = re.compile(r"^[^\s#)]", re.MULTILINE).search(text, start.end())
    return text[start.start() : end.start() if end else len(text)]


@functools.cache
def _file_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except OSError:
        return ""


def _has(cls: type, attribute: str) -> bool:
    """Whether instances of `cls` have `attribute`: a class member or set in source."""
    if hasattr(cls, attribute):
        return True
    pattern = re.compile(rf"\bself\.{re.escape(attribute)}\s*(:[^=]*)?=[^=]")
    return any(pattern.search(_class_source(klass)) for klass in cls.__mro__)


# Packages keras_dist imports only when used (TensorFlow for tf.data, Orbax
# for checkpoints): their names are checked once they are imported
# (`check(package)`), not at `import keras_dist` (Orbax's import alone is
# slow).
_LAZY = ("tensorflow", "orbax")


def _loaded(module: str, lazy: bool) -> bool:
    """Whether `module`'s names are checked now: not those of a lazily
    imported package not yet imported (with `lazy`)."""
    package = module.split(".")[0]
    return not lazy or package not in _LAZY or sys.modules.get(package) is not None


def _missing_attributes(table: tuple, lazy: bool = True) -> list[str]:
    missing = []
    for module, name, attributes in table:
        if not _loaded(module, lazy):
            continue
        cls = _class(module, name)
        if cls is None:
            missing.append(f"{module}.{name}")
            continue
        missing += [f"{module}.{name}.{a}" for a in attributes if not _has(cls, a)]
    return missing


def _missing_imports(table: tuple, lazy: bool = True) -> list[str]:
    missing = []
    for module, name in table:
        if not _loaded(module, lazy):
            continue
        if _releases.find(f"{module}.{name}") is None:
            missing.append(f"{module}.{name}")
    return missing


def check(package: str | None = None) -> list[str]:
    """The listed private names a Keras, JAX, TF or Orbax release no longer has.

    Those of TensorFlow and Orbax only once imported; `package` ("orbax"):
    that package's names only, importing it.
    """
    if package is None:
        missing = _missing_imports(PRIVATE_IMPORTS) + _missing_attributes(
            PRIVATE_ATTRIBUTES
        )
        return missing + _missing_attributes(TF_PRIVATE_ATTRIBUTES)
    imports = tuple(e for e in PRIVATE_IMPORTS if e[0].split(".")[0] == package)
    tables = (PRIVATE_ATTRIBUTES, TF_PRIVATE_ATTRIBUTES)
    attributes = tuple(e for t in tables for e in t if e[0].split(".")[0] == package)
    return _missing_imports(imports, lazy=False) + _missing_attributes(
        attributes, lazy=False
    )


def check_signatures(originals: dict[str, Any]) -> list[str]:
    """`"name: expected (...), found (...)"` for each wrapped function that changed."""
    changed = []
    for path, expected in SIGNATURES.items():
        function = originals.get(path)
        if isinstance(function, property):
            function = function.fget
        if function is None:
            continue  # Reported as missing by `seams()`.
        found: tuple[Any, ...]
        if callable(function):
            found = tuple(inspect.signature(function).parameters)
        else:  # An object standing for a module (gfile): what it is.
            found = (type(function).__name__, getattr(function, "name", None))
        # One signature, or one per checked release (a tuple of them).
        alternatives = expected if isinstance(expected[0], tuple) else (expected,)
        if not any(
            found[: len(one)] == one and (path == "jit" or len(found) == len(one))
            for one in alternatives
        ):
            written = " or ".join(map(str, alternatives))
            changed.append(f"{path}: written for {written}, found {found}")
    return changed
