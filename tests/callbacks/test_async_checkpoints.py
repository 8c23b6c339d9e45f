"""ModelCheckpoint's asynchronous saves, its sharded (Orbax) format, keep policies."""

import os

import keras
import numpy as np
import pytest

import keras_dist as kd
from tests._helpers import (
    assert_weights_close,
    build_in_scope,
    compile_model,
    initial_weights,
    make_data,
    make_model,
)

X, Y, _ = make_data(64)
WEIGHTS = initial_weights()


def _fsdp():
    return kd.MirroredStrategy(shard_variables=True)


class _Record(keras.callbacks.Callback):
    """The model's weights after each training step (global step -> weights)."""

    def __init__(self):
        super().__init__()
        self.after = {}

    def on_train_batch_end(self, batch, logs=None):
        step = int(np.asarray(self.model.optimizer.iterations))
        self.after[step] = [np.array(w) for w in self.model.get_weights()]


def _fit(model, *callbacks, epochs=2):
    record = _Record()
    model.fit(
        X,
        Y,
        batch_size=16,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=[*callbacks, record],
    )
    return record.after


@pytest.mark.parametrize("weights_only", [True, False])
def test_async_files_hold_the_weights_of_their_step(tmp_path, weights_only):
    suffix = ".weights.h5" if weights_only else ".keras"
    model = build_in_scope(_fsdp(), WEIGHTS)
    ckpt = kd.callbacks.ModelCheckpoint(
        str(tmp_path / ("ckpt_{epoch}_{batch}" + suffix)),
        save_weights_only=weights_only,
        save_freq=3,
    )
    assert ckpt.async_save  # The default.
    after = _fit(model, ckpt)
    # 4 steps an epoch: saves after global steps 3 (epoch 1, batch 3) and 6.
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt"))
    assert names == ["ckpt_1_3" + suffix, "ckpt_2_2" + suffix]
    for name, step in (("ckpt_1_3", 3), ("ckpt_2_2", 6)):
        path = str(tmp_path / (name + suffix))
        if weights_only:
            loaded = make_model()
            loaded.load_weights(path)
        else:  # Keras alone reads it: no strategy, no keras_dist.
            loaded = keras.models.load_model(path)
            assert int(np.asarray(loaded.optimizer.iterations)) == step
        assert_weights_close(after[step], loaded.get_weights(), rtol=0, atol=0)


def test_async_and_sync_write_the_same_file(tmp_path):
    files = {}
    for async_save in (True, False):
        model = build_in_scope(_fsdp(), WEIGHTS)
        path = tmp_path / f"{async_save}.weights.h5"
        _fit(
            model,
            kd.callbacks.ModelCheckpoint(
                str(path), save_weights_only=True, async_save=async_save
            ),
        )
        files[async_save] = make_model()
        files[async_save].load_weights(str(path))
    assert_weights_close(
        files[False].get_weights(), files[True].get_weights(), rtol=0, atol=0
    )


def test_a_failed_background_write_raises_on_the_training_thread(tmp_path):
    class Block(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:  # The next epoch's directory becomes a file.
                (tmp_path / "2").write_text("in the way")

    model = build_in_scope(_fsdp(), WEIGHTS)
    ckpt = kd.callbacks.ModelCheckpoint(
        str(tmp_path / "{epoch}" / "ckpt.weights.h5"), save_weights_only=True
    )
    with pytest.raises(kd.errors.CheckpointWriteError) as info:
        _fit(model, ckpt, Block(), epochs=3)
    message = str(info.value)
    assert str(tmp_path / "2" / "ckpt.weights.h5") in message
    assert "FileExistsError" in message or "NotADirectoryError" in message
    assert "previous checkpoint is intact" in message
    intact = make_model()
    intact.load_weights(str(tmp_path / "1" / "ckpt.weights.h5"))


def test_a_save_in_flight_finishes_when_fit_raises(tmp_path):
    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                raise RuntimeError("user stop")

    model = build_in_scope(_fsdp(), WEIGHTS)
    path = tmp_path / "ckpt.weights.h5"
    ckpt = kd.callbacks.ModelCheckpoint(str(path), save_weights_only=True, save_freq=3)
    with pytest.raises(RuntimeError, match="user stop"):
        _fit(model, ckpt, Stop())
    assert not ckpt._saves.pending
    assert path.exists()
    make_model().load_weights(str(path))


def test_keep_period_and_max_to_keep(tmp_path):
    model = build_in_scope(_fsdp(), WEIGHTS)
    ckpt = kd.callbacks.ModelCheckpoint(
        str(tmp_path / "ckpt_{epoch}_{batch}.weights.h5"),
        save_weights_only=True,
        save_freq=1,
        max_to_keep=2,
        keep_period=4,
    )
    _fit(model, ckpt, epochs=3)  # Saves after global steps 1..12.
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt"))
    # Orbax's policy, as for sharded checkpoints (below): steps 4, 8 and 12
    # (keep_period), 11 and 12 (the newest two).
    assert names == [
        "ckpt_1_4.weights.h5",
        "ckpt_2_4.weights.h5",
        "ckpt_3_3.weights.h5",
        "ckpt_3_4.weights.h5",
    ]
    assert kd.callbacks.latest_checkpoint(tmp_path).endswith("ckpt_3_4.weights.h5")


def test_save_interval_seconds_saves_at_step_ends(tmp_path):
    model = build_in_scope(_fsdp(), WEIGHTS)
    ckpt = kd.callbacks.ModelCheckpoint(
        str(tmp_path / "ckpt_{epoch}_{batch}.weights.h5"),
        save_weights_only=True,
        save_interval_seconds=1e-6,  # Due at every step end.
        save_freq=1000,  # No other save.
    )
    _fit(model, ckpt, epochs=1)
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt"))
    assert names == [f"ckpt_1_{b}.weights.h5" for b in range(1, 5)]


def _fresh(strategy, weights):
    """A model built as a new process builds it: Keras's Orbax loaders match
    the saved state by model and layer names ("sequential/dense/kernel")."""
    keras.backend.clear_session()
    return build_in_scope(strategy, weights)


def test_sharded_checkpoints_load_with_keras_alone(tmp_path):
    model = _fresh(_fsdp(), WEIGHTS)
    directory = tmp_path / "sharded"
    ckpt = kd.callbacks.ModelCheckpoint(
        str(directory), sharded=True, save_freq=2, max_to_keep=2, keep_period=4
    )
    after = _fit(model, ckpt)
    # Steps 2, 4, 6, 8 saved; 4 and 8 kept by keep_period, 6 the newest other.
    steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    assert steps == [4, 6, 8]
    assert kd.callbacks.latest_checkpoint(directory) == str(directory)
    keras.backend.clear_session()
    # Keras's own loader, no strategy: the weights and the optimizer's state.
    # (`keras.models.load_model` of an Orbax directory rebuilds the model but
    # in Keras 3.15/3.16 matches no saved weight, Keras's own
    # OrbaxCheckpoint's neither: its layer paths lose the model's name.)
    plain = make_model()
    compile_model(plain)
    plain.load_weights(str(directory))
    assert_weights_close(after[8], plain.get_weights(), rtol=0, atol=0)
    assert int(np.asarray(plain.optimizer.iterations)) == 8
    # Onto another mesh: 4 devices, the weights split there too.
    four = kd.MirroredStrategy([f"cpu:{i}" for i in range(4)], shard_variables=True)
    onto = _fresh(four, initial_weights())
    onto.load_weights(kd.callbacks.latest_checkpoint(directory))
    assert_weights_close(after[8], onto.get_weights(), rtol=0, atol=0)
    assert onto.weights[0].value.sharding.num_devices == 4


@pytest.mark.parametrize("devices", [8, 4, 1])
def test_load_checkpoint_restores_onto_any_mesh_whatever_the_names(tmp_path, devices):
    model = build_in_scope(_fsdp(), WEIGHTS)
    directory = tmp_path / "sharded"
    after = _fit(model, kd.callbacks.ModelCheckpoint(str(directory), sharded=True))
    saved_slots = [np.array(v) for v in model.optimizer.variables]
    # Built later in this process: other layer names than the saving model's.
    if devices == 1:
        strategy = kd.OneDeviceStrategy("cpu:0")
    else:
        strategy = kd.MirroredStrategy(
            [f"cpu:{i}" for i in range(devices)], shard_variables=True
        )
    onto = build_in_scope(strategy, initial_weights())
    if devices != 1:  # (On one device load_checkpoint builds the optimizer.)
        onto.optimizer.build(onto.trainable_variables)
    assert onto.weights[0].path != model.weights[0].path
    kd.callbacks.load_checkpoint(onto, kd.callbacks.latest_checkpoint(directory))
    assert_weights_close(after[8], onto.get_weights(), rtol=0, atol=0)
    assert_weights_close(
        saved_slots, [np.array(v) for v in onto.optimizer.variables], rtol=0, atol=0
    )
    assert int(np.asarray(onto.optimizer.iterations)) == 8
    assert onto.weights[0].value.sharding.num_devices == devices
    # Training goes on from there exactly as the saving model would.
    x, y = X[:16], Y[:16]
    model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    onto.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    assert_weights_close(model.get_weights(), onto.get_weights(), rtol=1e-5)


def test_a_relative_path_saves_and_loads(tmp_path, monkeypatch):
    """As a user writes them: `ModelCheckpoint("ckpts", sharded=True)` and
    `load_checkpoint(model, "ckpts")` from the working directory."""
    monkeypatch.chdir(tmp_path)
    model = build_in_scope(_fsdp(), WEIGHTS)
    after = _fit(model, kd.callbacks.ModelCheckpoint("ckpts", sharded=True))
    onto = build_in_scope(_fsdp(), initial_weights())
    onto.optimizer.build(onto.trainable_variables)
    kd.callbacks.load_checkpoint(onto, "ckpts")
    assert_weights_close(after[8], onto.get_weights(), rtol=0, atol=0)
    assert int(np.asarray(onto.optimizer.iterations)) == 8


def test_load_checkpoint_refuses_another_model(tmp_path):
    model = build_in_scope(_fsdp(), WEIGHTS)
    directory = tmp_path / "sharded"
    _fit(model, kd.callbacks.ModelCheckpoint(str(directory), sharded=True))
    other = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    compile_model(other)
    with pytest.raises(ValueError, match="does not fit this model"):
        kd.callbacks.load_checkpoint(other, directory)
    with pytest.raises(FileNotFoundError, match="path="):
        kd.callbacks.load_checkpoint(other, tmp_path / "missing")


def test_keras_orbax_checkpoints_and_ours_read_each_other(tmp_path):
    model = _fresh(_fsdp(), WEIGHTS)
    directory = tmp_path / "keras_orbax"
    keras_ckpt = keras.callbacks.OrbaxCheckpoint(str(directory), save_freq="epoch")
    after = _fit(model, keras_ckpt)
    keras_ckpt.wait_until_finished()
    latest = kd.callbacks.latest_checkpoint(directory)
    assert latest == str(directory)
    loaded = _fresh(_fsdp(), initial_weights())
    loaded.load_weights(latest)
    assert_weights_close(after[8], loaded.get_weights(), rtol=0, atol=0)


def test_sharded_weights_only_reload_into_a_model(tmp_path):
    model = _fresh(_fsdp(), WEIGHTS)
    directory = tmp_path / "w"
    after = _fit(
        model,
        kd.callbacks.ModelCheckpoint(
            str(directory), sharded=True, save_weights_only=True, async_save=False
        ),
    )
    assert sorted(os.listdir(directory)) == ["4", "8"]
    keras.backend.clear_session()
    fresh = make_model()
    compile_model(fresh)
    fresh.load_weights(kd.callbacks.latest_checkpoint(directory))
    assert_weights_close(after[8], fresh.get_weights(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"filepath": "c/{epoch}", "sharded": True},
            ValueError,
            r"sharded=True, `filepath` is the directory.*filepath='c/\{epoch\}'",
        ),
        (
            {"filepath": "c.keras", "save_interval_seconds": 0},
            ValueError,
            r"`save_interval_seconds` must be a positive.*Received: "
            r"save_interval_seconds=0",
        ),
        (
            {"filepath": "c.keras", "async_save": "yes"},
            TypeError,
            r"`async_save` must be True or False. Received: async_save='yes'",
        ),
        (
            {"filepath": "c.keras", "keep_period": 0},
            ValueError,
            r"keep_period",
        ),
    ],
)
def test_bad_arguments_name_the_argument(tmp_path, kwargs, error, match):
    kwargs = {**kwargs, "filepath": str(tmp_path / kwargs["filepath"])}
    with pytest.raises(
        error, match=match.replace("c/", ".*c/").replace("c.k", ".*c.k")
    ):
        kd.callbacks.ModelCheckpoint(**kwargs)


@keras.saving.register_keras_serializable(package="kd_tests")
class _WithAsset(keras.layers.Layer):
    """A pass-through layer with an asset file (as a vocabulary layer has)."""

    def __init__(self, words=("a", "b"), **kwargs):
        super().__init__(**kwargs)
        self.words = list(words)

    def call(self, x):
        return x

    def get_config(self):
        return {**super().get_config(), "words": self.words}

    def save_assets(self, dir_path):
        with open(os.path.join(dir_path, "vocab.txt"), "w") as f:
            f.write("\n".join(self.words))


def test_sharded_checkpoints_hold_the_model_json_and_assets(tmp_path):
    """Made once when `fit` begins (making them waits for the dispatched
    steps), and written with every checkpoint as Keras's OrbaxCheckpoint
    writes them."""
    import orbax.checkpoint as ocp

    from keras_dist._private_api._keras_saving import model_files

    with _fsdp().scope():
        model = keras.Sequential(
            [keras.Input((6,)), _WithAsset(["x", "y", "z"]), keras.layers.Dense(3)]
        )
        compile_model(model)
    directory = tmp_path / "sharded"
    _fit(model, kd.callbacks.ModelCheckpoint(str(directory), sharded=True))
    expected = model_files(model)
    steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    assert steps == [4, 8]
    for step in steps:
        saved = ocp.v1.load_checkpointables(
            directory / str(step), {"model_config": None, "assets": None}
        )
        assert saved["model_config"] == expected["model_config"]
        (layer,) = saved["assets"]["layers"].values()
        vocab = bytes(np.asarray(layer["vocab.txt"], dtype=np.uint8))
        assert vocab == b"x\ny\nz"


def test_keras_files_saved_in_one_fit_each_hold_their_step(tmp_path):
    """`.keras` saves reuse Keras's saving walk of the `fit` (recorded when it
    begins): each file still loads with Keras alone, with the weights and
    the learning rate of its epoch, the assets, and its own save date; the
    walk's temporary asset copy is gone after `fit`."""
    import glob
    import tempfile
    import zipfile

    leftovers = set(
        glob.glob(os.path.join(tempfile.gettempdir(), "keras_dist-assets-*"))
    )
    with _fsdp().scope():
        model = keras.Sequential(
            [keras.Input((6,)), _WithAsset(["x", "y"]), keras.layers.Dense(3)]
        )
        compile_model(model)
    after = _fit(
        model,
        kd.callbacks.ModelCheckpoint(str(tmp_path / "ckpt_{epoch}.keras")),
        keras.callbacks.LearningRateScheduler(lambda epoch: 0.1 / (epoch + 1)),
        epochs=3,
    )
    for epoch in (1, 2, 3):
        path = str(tmp_path / f"ckpt_{epoch}.keras")
        loaded = keras.models.load_model(
            path, custom_objects={"_WithAsset": _WithAsset}
        )
        assert int(np.asarray(loaded.optimizer.iterations)) == 4 * epoch
        assert float(np.asarray(loaded.optimizer.learning_rate)) == pytest.approx(
            0.1 / epoch
        )
        assert_weights_close(after[4 * epoch], loaded.get_weights(), rtol=0, atol=0)
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            assert any(n.endswith("vocab.txt") for n in names), names
            assert "metadata.json" in names and "config.json" in names
    assert (
        set(glob.glob(os.path.join(tempfile.gettempdir(), "keras_dist-assets-*")))
        == leftovers
    )


def test_a_replicated_value_is_frozen_once_and_a_split_one_stays_split():
    """A save freezes one replica of a mirrored value (8 copies cost 8 times
    the device memory and copying), and each device's part of a split one."""
    import jax

    from keras_dist._checkpoint.freeze import freeze

    with kd.MirroredStrategy().scope():
        mirrored = keras.Variable(np.arange(32.0).reshape(4, 8))
    with _fsdp().scope():
        split = keras.Variable(np.arange(64.0).reshape(8, 8))
    assert len(mirrored.value.sharding.device_set) == 8
    assert not split.value.sharding.is_fully_replicated
    frozen_mirrored, frozen_split = freeze([mirrored, split])
    assert frozen_mirrored.sharding.device_set == {jax.devices()[0]}
    assert frozen_split.sharding == split.value.sharding
    mirrored.assign(np.zeros((4, 8)))  # The frozen copies are copies.
    split.assign(np.zeros((8, 8)))
    np.testing.assert_array_equal(frozen_mirrored, np.arange(32.0).reshape(4, 8))
    np.testing.assert_array_equal(frozen_split, np.arange(64.0).reshape(8, 8))
    (on_host,) = freeze([mirrored])
    np.testing.assert_array_equal(np.asarray(on_host), np.zeros((4, 8)))


def test_a_save_copy_is_not_run_inline_on_the_training_thread():
    """XLA:CPU runs a program it estimates under 1000 flops inline, on the
    calling thread, when its inputs are ready (`cheap_computation_` in its
    PjRt client). A copy simplified to plain copies costs no flops: a save
    then waited for the whole copy (56 ms of a 96 MB replica). The copy's
    adds must stay in the compiled program, and copy exactly."""
    import jax

    from keras_dist._checkpoint.freeze import _copy

    device = jax.devices()[0]
    group = [
        jax.device_put(np.arange(4096, dtype=np.float32), device),
        jax.device_put(np.arange(-5, 1995, dtype=np.int32), device),
        jax.device_put(np.arange(3000) % 3 == 0, device),
    ]
    flops = _copy.lower(group).compile().cost_analysis().get("flops", 0.0)
    assert flops >= 1000, flops
    copies = _copy(group)
    for copy, value in zip(copies, group, strict=True):
        assert copy.dtype == value.dtype
        assert copy.unsafe_buffer_pointer() != value.unsafe_buffer_pointer()
        np.testing.assert_array_equal(copy, value)


def test_a_save_copies_on_the_devices_only_where_they_have_room():
    """Devices that report a memory limit (GPU, TPU: faked here, this box
    has none) get a save's copy only if each device's parts fit in 90% of
    its free memory; otherwise the save copies to the host. CPU devices
    report no limit: always room."""
    import jax

    from keras_dist._checkpoint.freeze import _room_on_devices

    class Device:
        def __init__(self, limit, in_use):
            self.limit, self.in_use = limit, in_use

        def memory_stats(self):
            return {"bytes_limit": self.limit, "bytes_in_use": self.in_use}

    class Split:  # A (2, n) float32 value split in rows over two devices.
        def __init__(self, devices, shape):
            self.addressable_devices = devices
            self.shape = shape
            self.dtype = np.float32

        def shard_shape(self, shape):
            return (shape[0] // 2, *shape[1:])

    class Value:
        def __init__(self, sharding):
            self.sharding, self.shape, self.dtype = sharding, sharding.shape, "f4"

    roomy, tight = Device(10_000, 0), Device(10_000, 7_000)  # free: 10k, 3k
    small = Value(Split((roomy, tight), (2, 600)))  # 2400 bytes a device
    large = Value(Split((roomy, tight), (2, 800)))  # 3200 bytes a device
    assert _room_on_devices([small])
    assert not _room_on_devices([large])  # 3200 > 0.9 * 3000 on `tight`
    assert not _room_on_devices([small, Value(Split((tight, roomy), (2, 100)))])
    on_cpu = jax.device_put(np.zeros((2, 800), np.float32), jax.devices()[0])
    assert _room_on_devices([on_cpu])


def _h5_contents(path) -> dict:
    """Every dataset of an HDF5 file: name -> (dtype, shape, bytes, attrs)."""
    import h5py

    contents = {}
    with h5py.File(path, "r") as f:

        def visit(name, obj):
            attrs = {k: str(v) for k, v in obj.attrs.items()}
            if isinstance(obj, h5py.Dataset):
                value = obj[()]
                contents[name] = (str(obj.dtype), obj.shape, value.tobytes(), attrs)
            else:
                contents[name] = attrs

        f.visititems(visit)
    return contents


def _keras_h5(path, entries) -> dict:
    """The file Keras's own `H5IOStore` writes of `entries`: its contents."""
    from keras.src.saving.saving_lib import H5IOStore

    store = H5IOStore(str(path), mode="w")
    for entry_path, metadata, group in entries:
        entry = store.make(entry_path, metadata=metadata)
        for key, value in group.items():
            entry[key] = np.asarray(value)
    store.close()
    return _h5_contents(path)


def test_weights_h5_files_hold_what_keras_writes(tmp_path):
    """The background `.weights.h5` writer replays a snapshot into Keras's
    own `H5IOStore`: the file holds what Keras writes from the same values,
    for every layout of the parts and every kind of value (bfloat16,
    integers, scalars, empty, Python numbers, booleans)."""
    import jax
    import ml_dtypes
    from jax.sharding import NamedSharding, PartitionSpec

    from keras_dist._checkpoint import keras_files as _saving

    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices())
    rng = np.random.default_rng(0)

    def on(value, *spec):
        return jax.device_put(value, NamedSharding(mesh, PartitionSpec(*spec)))

    def floats(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def entries(**changes):
        values = {
            "rows": on(floats(8, 6), "a"),  # 4 runs of bytes, each twice.
            "rows_cols": on(floats(8, 6), "a", "b"),  # Not runs: assembled.
            "cols": on(floats(2, 8), None, ("a", "b")),  # Not runs either.
            "one_row_each": on(floats(4, 1, 6), "a"),  # Runs (length-1 axes).
            "replicated": on(floats(3, 5), None),
            "ints": on(rng.integers(0, 9, (8, 4)), "a"),
            "host": floats(7, 3),
            "scalar": np.float32(rng.standard_normal()),
            "step": on(np.int64(rng.integers(100))),
            "empty": np.zeros((0, 4), np.float32),
            "bf16": floats(4, 4).astype(ml_dtypes.bfloat16),
            **changes,
        }
        items = list(values.items())
        return [
            ("layers/dense", {"note": "metadata"}, dict(items[:5])),
            ("optimizer", None, dict(items[5:])),
            ("layers/unused", None, {}),
        ]

    def write(name, written):
        path = str(tmp_path / f"{name}.weights.h5")
        _saving.write_snapshot(_saving.Snapshot(entries=written), path)
        assert _h5_contents(path) == _keras_h5(tmp_path / f"{name}.keras.h5", written)
        return path

    first = write("first", entries())
    assert "layers/dense/vars/rows" in _h5_contents(first)
    write("other", entries(rows=on(floats(16, 6), "a")))  # Another shape.
    write("number", entries(count=7, mask=np.array([True, False])))


@pytest.mark.parametrize("layout", ["fsdp", "mirrored"])
@pytest.mark.parametrize("callback", ["backup", "weights_h5", "keras_file"])
def test_a_save_compiles_nothing_on_the_training_thread(
    tmp_path, monkeypatch, layout, callback
):
    """The copy a background save dispatches is compiled when `fit` begins
    (with the train step's compile), not at the first save: no XLA compile
    runs inside any save (the first one took 1.5 s of the training thread
    at 973 MB on 8 CPU devices). The files are still the step's."""
    import jax

    from keras_dist._checkpoint import pipeline

    strategy = _fsdp() if layout == "fsdp" else kd.MirroredStrategy()
    model = build_in_scope(strategy, WEIGHTS)
    inside, compiled_in_saves, compiled = [False], [], []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)
            if inside[0]:
                compiled_in_saves.append(duration)

    def timed(cls, name):
        method = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            inside[0] = True
            try:
                return method(self, *args, **kwargs)
            finally:
                inside[0] = False

        monkeypatch.setattr(cls, name, wrapper)

    if callback == "backup":
        timed(pipeline.OrbaxSaves, "save")
        cb = kd.callbacks.BackupAndRestore(
            str(tmp_path / "backup"), save_freq=2, delete_checkpoint=False
        )
    else:
        timed(pipeline.KerasFileSaves, "save")
        suffix = ".weights.h5" if callback == "weights_h5" else ".keras"
        cb = kd.callbacks.ModelCheckpoint(
            str(tmp_path / ("ckpt_{epoch}_{batch}" + suffix)),
            save_weights_only=callback == "weights_h5",
            save_freq=2,
        )
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        after = _fit(model, cb)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiled  # The listener hears compiles (the train step's).
    assert compiled_in_saves == []
    if callback == "weights_h5":  # The last save: global step 8.
        loaded = make_model()
        loaded.load_weights(str(tmp_path / "ckpt_2_4.weights.h5"))
        assert_weights_close(after[8], loaded.get_weights(), rtol=0, atol=0)


class _OwnSaving(keras.optimizers.SGD):
    """An optimizer that saves its state its own way (a user's subclass)."""

    def save_own_variables(self, store):
        super().save_own_variables(store)
        store["note"] = np.array([1.0, 2.0])


@pytest.mark.parametrize("optimizer", ["adam", "loss_scale", "own_saving"])
def test_the_saving_walk_copies_no_optimizer_state_to_the_host(
    tmp_path, monkeypatch, optimizer
):
    """Keras's optimizer saves `variable.numpy()`, a host copy of its whole
    state waiting for the step computing it; ModelCheckpoint's walk records
    the variables instead (to freeze them on their devices), for Keras's
    optimizers and a wrapped inner one, and leaves nothing on them. An
    optimizer with its own `save_own_variables` is called as it is. The
    file is the one `save_weights` writes."""
    from keras_dist._checkpoint import keras_files as _saving

    chosen = {
        "adam": lambda: keras.optimizers.Adam(),
        "loss_scale": lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam()
        ),
        "own_saving": lambda: _OwnSaving(momentum=0.9),
    }[optimizer]
    with _fsdp().scope():
        model = make_model()
        model.set_weights(WEIGHTS)
        compile_model(model, chosen())
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    opt = model.optimizer
    copied = []
    numpy = keras.Variable.numpy

    def counted(variable):
        copied.append(variable.path)
        return numpy(variable)

    monkeypatch.setattr(keras.Variable, "numpy", counted)
    recorded = _saving.record(model, with_config=False)
    monkeypatch.setattr(keras.Variable, "numpy", numpy)
    optimizers = [opt, getattr(opt, "inner_optimizer", None)]
    assert all("save_own_variables" not in vars(o) for o in optimizers if o is not None)
    stored = [
        v
        for path, _, group in recorded.entries
        if path.startswith("optimizer")
        for v in group.values()
    ]
    if optimizer == "own_saving":
        assert len(copied) == len(opt.variables)  # Its own way, as before.
        assert not _saving.reusable(recorded)  # The note is no variable.
    else:
        assert copied == []
        assert len(stored) >= len(opt.variables) and _saving.reusable(recorded)
        assert {id(v) for v in stored} <= {id(v) for v in opt.variables}
    path = str(tmp_path / "walk.weights.h5")
    _saving.write_snapshot(
        _saving.snapshot(model, with_config=False, recorded=recorded), path
    )
    model.save_weights(str(tmp_path / "keras.weights.h5"))
    assert _h5_contents(path) == _h5_contents(tmp_path / "keras.weights.h5")


def test_backups_and_sharded_checkpoints_are_written_uncompressed(tmp_path):
    """They hold the state's raw bytes, as `.weights.h5` does: zstd saves
    ~9% of a trained float state's bytes and more than doubles a write's
    CPU time, which the host shares with training (measured once; in the
    git history of benchmarks/README.md).
    A kernel of zeros would compress to a few KB."""
    with kd.MirroredStrategy().scope():
        model = keras.Sequential(
            [keras.Input((512,)), keras.layers.Dense(512, kernel_initializer="zeros")]
        )
        model.compile(keras.optimizers.SGD(0.0), "mse")
    x = np.ones((16, 512), "float32")
    model.fit(
        x,
        x,
        batch_size=8,
        verbose=0,
        callbacks=[
            kd.callbacks.BackupAndRestore(
                str(tmp_path / "backup"), save_freq=2, delete_checkpoint=False
            ),
            kd.callbacks.ModelCheckpoint(
                str(tmp_path / "sharded"), sharded=True, save_freq=2
            ),
        ],
    )
    kernel_bytes = 512 * 512 * 4
    for name in ("backup", "sharded"):
        files = [f for f in (tmp_path / name).rglob("*") if f.is_file()]
        assert sum(f.stat().st_size for f in files) >= kernel_bytes, name


def test_a_collector_the_program_turned_off_stays_off(tmp_path):
    import gc

    gc.disable()
    try:
        model = build_in_scope(_fsdp(), WEIGHTS)
        _fit(
            model,
            kd.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=2),
            epochs=1,
        )
        assert not gc.isenabled()
    finally:
        gc.enable()
