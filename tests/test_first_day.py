"""The first mistakes of a new user: each gets a message naming the fix.

The launcher's own (`keras-dist-run` with no arguments, `--version`, a bad
port): tests/cluster/test_launch.py.
"""

import os
import subprocess
import sys
import warnings

import pytest


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=environ, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["tensorflow", "torch", "numpy"])
def test_keras_backend_set_to_another_backend_names_the_variable(backend):
    """Before Keras imports that backend: no ModuleNotFoundError of torch."""
    result = _python("import keras_dist", KERAS_BACKEND=backend)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: keras_dist runs Keras on the JAX backend")
    assert f"the environment sets KERAS_BACKEND={backend!r}" in last
    assert "Unset it or set it to jax" in last
    assert "ModuleNotFoundError" not in result.stderr


def test_keras_imported_first_with_another_backend_says_so():
    code = (
        "import os; os.environ['KERAS_BACKEND'] = 'numpy'; import keras; "
        "del os.environ['KERAS_BACKEND']; import keras_dist"
    )
    result = _python(code)
    last = result.stderr.strip().splitlines()[-1]
    assert "Keras was imported before keras_dist with backend='numpy'" in last
    assert "Import keras_dist before keras, or set KERAS_BACKEND=jax" in last


def test_the_jax_backend_or_none_imports(tmp_path):
    # A ~/.keras/keras.json naming another backend is overridden too.
    (tmp_path / "keras.json").write_text('{"backend": "tensorflow"}')
    for env in ({}, {"KERAS_BACKEND": "jax"}, {"KERAS_HOME": str(tmp_path)}):
        result = _python(
            "import keras_dist, keras; print(keras.backend.backend())", **env
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == "jax"


def _unbatched_cases():
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.RandomState(0)
    x, y = rng.rand(24, 6).astype("float32"), rng.randint(0, 3, 24)
    one_hot = keras.utils.to_categorical(y, 3)
    return (
        x,
        y,
        [
            (tf.data.Dataset.from_tensor_slices((x, y)), "a component is a scalar"),
            (
                tf.data.Dataset.from_tensor_slices((x, one_hot)).shuffle(24),
                "its components' first dimensions differ (3, 6)",
            ),
        ],
    )


@pytest.mark.parametrize("under_strategy", [True, False], ids=["strategy", "keras"])
def test_an_unbatched_tf_dataset_is_named_as_such(under_strategy):
    """Not Keras's shape error for one example (padded to 8 under a strategy)."""
    import contextlib

    import keras
    import tensorflow as tf

    import keras_dist as kd

    scope = (
        kd.MirroredStrategy().scope() if under_strategy else contextlib.nullcontext()
    )
    with scope:
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile("adam", "sparse_categorical_crossentropy")
    x, y, cases = _unbatched_cases()
    for dataset, reason in cases:
        for call in (
            lambda d: model.fit(d, epochs=1, verbose=0),
            lambda d: model.evaluate(d, verbose=0),
            lambda d: model.predict(d, verbose=0),  # (x, y): y is ignored.
            lambda d: model.fit(x, y, validation_data=d, epochs=1, verbose=0),
        ):
            with pytest.raises(ValueError, match="looks unbatched") as raised:
                call(dataset)
            message = str(raised.value)
            assert reason in message
            assert "Batch it: `dataset.batch(GLOBAL_BATCH_SIZE)`" in message
    # Batched, and a from_tensor_slices of arrays of batches: accepted.
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), verbose=0)
    pre_batched = tf.data.Dataset.from_tensor_slices(
        (x.reshape(3, 8, 6), y.reshape(3, 8))
    )
    model.fit(pre_batched, verbose=0)


def test_fit_on_arrays_imports_tensorflow_no_more_than_keras(tmp_path):
    """Plain Keras's `fit` on NumPy arrays does not import TensorFlow (~3 s
    and its threads); under a strategy, with the label checks that read the
    compiled metrics and a backup, neither."""
    code = f"""
import sys
import warnings
import keras_dist as kd
import keras, numpy as np

def fit(scope, backup=None):
    with scope:
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(
            "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["sparse_categorical_accuracy"],
        )
    x = np.random.RandomState(0).randn(61, 6).astype("float32")
    y = np.arange(61) % 3
    callbacks = [backup] if backup else []
    model.fit(x, y, batch_size=8, epochs=1, callbacks=callbacks, verbose=0)
    return model

import contextlib
fit(contextlib.nullcontext())
print("keras", "tensorflow" in sys.modules)
strategy = kd.MirroredStrategy()
backup = kd.callbacks.BackupAndRestore({str(tmp_path / "backup")!r}, save_freq=2)
fit(strategy.scope(), backup).save_weights({str(tmp_path / "w.weights.h5")!r})
print("keras_dist", "tensorflow" in sys.modules)
"""
    result = _python(code, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-3:] == ["keras False", "keras_dist False", ""]


def test_xla_flags_set_after_jax_started_is_named(monkeypatch):
    """A notebook cell setting XLA_FLAGS after JAX started (cells run out of
    order): `MirroredStrategy()` would train on the devices JAX has, with a
    warning saying why and how to get the devices asked for."""
    import jax

    import keras_dist as kd

    found = jax.local_device_count()
    monkeypatch.setenv(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={found * 2}"
    )
    with pytest.warns(
        UserWarning,
        match=rf"XLA_FLAGS asks for {found * 2} CPU devices .*but JAX has {found}: "
        r"it started before XLA_FLAGS was set.*restart the kernel",
    ):
        strategy = kd.MirroredStrategy()
    assert strategy.num_replicas_in_sync == found
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count={found}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kd.MirroredStrategy()  # As asked: nothing to say.
