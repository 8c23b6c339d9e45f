"""The private Keras seams of `keras_dist/_seams/` are still there.

If this file fails after a Keras upgrade, re-read
`keras/src/backend/jax/trainer.py` of the new release, adapt
`keras_dist/_seams/`, then bump `CHECKED_KERAS` and the pin in pyproject.toml.
"""

import inspect

import keras
import numpy as np

import keras_dist as kd
from keras_dist import _seams
from keras_dist._private_api._releases import find
from keras_dist.data import _partial_batch
from tests._helpers import build_in_scope, initial_weights, make_data, mirrored


def test_checked_against_the_installed_keras():
    assert _seams.CHECKED_KERAS == ("3.15", "3.16")
    minor = ".".join(keras.__version__.split(".")[:2])
    assert minor in _seams.CHECKED_KERAS, (
        f"keras_dist's seams were checked against Keras {_seams.CHECKED_KERAS} "
        f"but Keras {keras.__version__} is installed"
    )
    assert _seams._KERAS_PIN == "keras>=3.15,<3.17"


def test_every_seam_exists_with_the_expected_signature():
    _seams.install()
    found = _seams.seams()
    assert all(obj is not None for obj in found.values())
    params = inspect.signature(_seams._originals["_distribute_data"]).parameters
    # The nightly also takes `is_super_batch` (steps_per_execution's stacks).
    assert list(params) in (["data", "layouts"], ["data", "layouts", "is_super_batch"])
    for name in _seams.STEP_BUILDERS:
        original = _seams._originals[f"Model.{name}"]
        assert list(inspect.signature(original).parameters) == ["self", "force"]


def test_seams_are_installed_once_by_the_first_strategy():
    kd.OneDeviceStrategy("cpu:0")
    from keras.src.backend.jax import trainer

    assert trainer.jit is _seams._jit
    assert trainer._distribute_data is _seams._distribute_data
    assert (
        find("keras.src.backend.jax.trainer.JAXEpochIterator._get_distributed_iterator")
        is _seams._get_distributed_iterator
    )
    for name in (*_seams.ENTRY_POINTS, *_seams.STEP_BUILDERS):
        wrapped = getattr(keras.Model, name)  # The trainer's, by a public name.
        assert wrapped._keras_dist_wrapped is _seams._originals[f"Model.{name}"]
    _seams.install()  # Idempotent: no double wrapping.
    assert not hasattr(keras.Model.fit._keras_dist_wrapped, "_keras_dist_wrapped")


def test_keras_compiles_steps_through_the_wrapped_jit(monkeypatch):
    """A partial batch reaches a compiled step as a PaddedBatch and is cut there."""
    seen = []
    original_unpad = _partial_batch.unpad

    def spy(data):
        if isinstance(data, _partial_batch.PaddedBatch):
            seen.append(data.num_real)
        return original_unpad(data)

    monkeypatch.setattr(_partial_batch, "unpad", spy)
    x, y, _ = make_data(13)
    model = build_in_scope(mirrored(8), initial_weights())
    model.fit(x, y, batch_size=13, epochs=1, verbose=0)
    assert 13 in seen
    assert model.predict(x, verbose=0).shape == (13, 3)


def test_plain_keras_distribution_still_fails_on_a_partial_batch():
    """Why the seam exists: Keras's own DataParallel cannot lay out 13 rows."""
    x, _, _ = make_data(13)
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")
    )
    with distribution.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
        try:
            model.fit(x, np.zeros((13, 3), "float32"), batch_size=13, verbose=0)
        except ValueError as error:
            assert "divisible" in str(error) or "evenly" in str(error), error
        else:
            raise AssertionError(
                "Keras now handles partial batches itself: revisit the padding seam"
            )


def test_callback_seams_exist():
    """Callbacks rely on these private names of Keras 3.15 (and the nightly)."""
    from keras.src.trainers import epoch_iterator

    jax_trainer = find("keras.src.backend.jax.trainer.JAXTrainer")

    checkpoint = keras.callbacks.ModelCheckpoint
    for name, params in {
        "_save_model": ["self", "epoch", "batch", "logs"],
        "_get_file_path": ["self", "epoch", "batch", "logs"],
        "_should_save_model": ["self", "epoch", "batch", "logs", "filepath"],
    }.items():
        assert list(inspect.signature(getattr(checkpoint, name)).parameters) == params
    assert "jax_state_sync" in vars(jax_trainer)
    source = inspect.getsource(jax_trainer.fit)
    for attribute in ("_jax_state_synced", "_jax_state", "_initial_epoch"):
        assert attribute in source, attribute
    assert "_steps_seen" in inspect.getsource(epoch_iterator.EpochIterator)
    optimizer = keras.optimizers.Adam(0.1)
    assert isinstance(optimizer._learning_rate, keras.Variable)
    assert hasattr(optimizer, "_track_variable")


def test_a_moved_name_is_found_where_the_installed_keras_has_it():
    """`_releases.where`: the name itself, else where the nightly moved it
    (the longest moved prefix first: a moved method before its moved class)."""
    from keras_dist._private_api._releases import MOVED, where

    trainer = "keras.src.backend.jax.trainer"
    build = where(f"{trainer}.JAXTrainer._symbolic_build")
    assert build in (
        f"{trainer}.JAXTrainer._symbolic_build",  # Keras 3.15
        f"{trainer}.Trainer._maybe_symbolic_build",  # The nightly.
    )
    for name in (  # Keras 3.15's names of what the nightly moved.
        "keras.src.backend.jax.core",
        "keras.src.backend.jax.core.JaxVariable",
        f"{trainer}.JAXTrainer",
        f"{trainer}.JAXEpochIterator._get_distributed_iterator",
        "keras.src.trainers.trainer.Trainer",
    ):
        assert name in MOVED or name.startswith("keras.src.backend.jax.core")
        assert find(name) is not None, name
    assert where("keras.src.no_such_module.Name") == "keras.src.no_such_module.Name"
