"""Device-resident input: in-memory arrays laid out on the mesh once.

With `kd.InputOptions(device_resident=True)` each step's batch is gathered on
the devices from Keras's row indices; the numbers must be those of the host
path (`device_resident=False`) and of plain Keras, for every shuffle mode,
partial batches (37 rows, 8 replicas: batch 8, whose full batches are laid
out as one table a pass, or, read in order, as blocks over the replicas;
and batch 10, every batch padded), sample weights, validation_split,
steps_per_execution, eager steps and a resumed fit.
"""

import unittest.mock

import jax
import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist._keras_compat import _array_input
from keras_dist.data import _call
from keras_dist.data._resident import ResidentPass
from keras_dist.data._resident_data import (
    BLOCKS,
    ROWS,
    lay_out_resident,
    resident_layout,
)
from keras_dist.strategies import _resident_placement
from keras_dist.strategies._exchange import plan_exchange
from keras_dist.training._fused_steps import has_primitive
from tests._helpers import (
    InterruptAt,
    assert_history_close,
    assert_weights_close,
    build_in_scope,
    compile_model,
    initial_weights,
    make_data,
    make_model,
    mirrored,
)
from tests._strategies import STRATEGIES

X, Y, SW = make_data(37)
WEIGHTS = initial_weights()
# Always on the devices; no copy fits a budget of 0 bytes: data `fit`
# shuffles is split over the replicas by rows (`ROWS`), not copied.
SPLIT = kd.InputOptions(device_resident=True, device_resident_budget=0)


def _options(resident) -> kd.InputOptions:
    """`"split"`: `SPLIT`; otherwise `device_resident=resident`."""
    if resident == "split":
        return SPLIT
    return kd.InputOptions(device_resident=resident)


class _Resident(keras.callbacks.Callback):
    """Counts the datasets laid out on the mesh in the running call."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def _record(self, name):
        self.counts[name] = len(_call.active().root.resident)

    def on_train_end(self, logs=None):
        self._record("fit")

    def on_test_end(self, logs=None):
        self._record("evaluate")

    def on_predict_end(self, logs=None):
        self._record("predict")


def _model(resident, **compile_kwargs):
    if resident is None:
        model = compile_model(make_model())
        model.set_weights(WEIGHTS)
    else:
        strategy = mirrored(8)
        strategy.input_options = _options(resident)
        model = build_in_scope(strategy, WEIGHTS)
    if compile_kwargs:
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            **compile_kwargs,
        )
    return model


def _run(resident, shuffle, spy=None, batch_size=8, **compile_kwargs):
    """fit (3 epochs, validation_split), evaluate and predict: all results."""
    keras.utils.set_random_seed(7)
    model = _model(resident, **compile_kwargs)
    callbacks = [spy] if spy else []
    history = model.fit(
        X,
        Y,
        sample_weight=SW,
        batch_size=batch_size,
        epochs=3,
        shuffle=shuffle,
        validation_split=0.2,
        callbacks=callbacks,
        verbose=0,
    ).history
    scores = model.evaluate(X, Y, batch_size=batch_size, callbacks=callbacks, verbose=0)
    outputs = model.predict(X, batch_size=batch_size, callbacks=callbacks, verbose=0)
    return history, scores, outputs, model.get_weights()


def _assert_same(expected, actual):
    assert_history_close(expected[0], actual[0])
    np.testing.assert_allclose(actual[1], expected[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(actual[2], expected[2], rtol=1e-5, atol=1e-6)
    assert_weights_close(expected[3], actual[3])


@pytest.mark.parametrize(
    "resident, shuffle, batch_size",
    [
        (True, False, 8),  # Blocks.
        (True, True, 8),  # Copied.
        ("split", True, 8),  # Split by rows.
        (True, "batch", 8),  # Copied.
        (True, True, 10),  # Copied: 10 rows do not split over 8 replicas.
        ("split", True, 10),
    ],
)
def test_resident_equals_host_path_and_keras(resident, shuffle, batch_size):
    spy = _Resident()
    resident = _run(resident, shuffle, spy, batch_size)
    # The training and the validation split, then one dataset per call.
    assert spy.counts == {"fit": 2, "evaluate": 1, "predict": 1}
    host = _run(False, shuffle, batch_size=batch_size)
    for got, want in zip(resident, host, strict=True):  # Bit-identical.
        np.testing.assert_equal(got, want)
    _assert_same(_run(None, shuffle, batch_size=batch_size), resident)


class _Transfers:
    """Counts a strategy's index transfers: one batch (`shard`) or many.

    And its pass layouts from rows split over the replicas (`exchange_rows`).
    """

    def __init__(self, strategy):
        self.counts = {"shard": 0, "shard_steps": 0, "exchange_rows": 0}
        for name in self.counts:
            setattr(strategy, name, self._counting(name, getattr(strategy, name)))

    def _counting(self, name, method):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return method(*args, **kwargs)

        return counted


@pytest.mark.parametrize(
    "resident, shuffle, want",
    [
        # A pass: its full batches in one table; the partial batch alone.
        # (Before the first epoch, Keras reads one batch of a pass of its
        # own to build the model's metrics: one more pass.)
        (True, True, {"shard": 3, "shard_steps": 4, "exchange_rows": 0}),
        # Split by rows: a pass lays all its batches out from the rows at
        # once; no indices to transfer.
        ("split", True, {"shard": 0, "shard_steps": 0, "exchange_rows": 4}),
        # In the dataset's order: no table; a step number names a block.
        (True, False, {"shard": 3, "shard_steps": 0, "exchange_rows": 0}),
        # Keras draws each batch's order as it reads it: one by one.
        (True, "batch", {"shard": 16, "shard_steps": 0, "exchange_rows": 0}),
    ],
)
def test_a_pass_lays_out_its_indices_once(resident, shuffle, want):
    strategy = mirrored(8)
    strategy.input_options = _options(resident)
    model = build_in_scope(strategy, WEIGHTS)
    transfers = _Transfers(strategy)
    model.fit(X, Y, batch_size=8, epochs=3, shuffle=shuffle, verbose=0)
    assert transfers.counts == want  # 37 rows: 4 batches of 8 and 1 of 5.
    # One step number a full batch of a table, made once and kept.
    assert len(strategy._step_numbers) == (0 if shuffle == "batch" else 4)


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_blocks_hold_each_replicas_rows_and_take_a_batch_as_indices_would(devices):
    strategy = mirrored(devices)
    data = [
        np.arange(70 * 3, dtype=np.float32).reshape(70, 3),
        np.arange(70, dtype=np.int32) * 10,
    ]
    blocks, tail = strategy.place_blocks(data, 16)  # 4 batches of 16, 6 rows.
    for block, rows in zip(blocks, data, strict=True):
        assert block.shape == (4, 16, *rows.shape[1:])
        for shard in block.addressable_shards:  # Its rows of every batch.
            assert shard.data.shape[:2] == (4, 16 // devices)
    for part, rows in zip(tail, data, strict=True):
        np.testing.assert_array_equal(part, rows[64:])
        assert part.sharding.is_fully_replicated
    step = strategy.step_numbers(3)[2]  # Batch 2: rows 32-47.
    taken = strategy.take_rows(blocks, step, blocked=True)
    placed = strategy.place_dataset(data)
    gathered = strategy.take_rows(placed, strategy.shard(np.arange(32, 48)))
    for got, want, rows in zip(taken, gathered, data, strict=True):
        np.testing.assert_array_equal(got, rows[32:48])
        np.testing.assert_array_equal(got, want)
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    # Each device indexes its own block: no gather, no collective (indices:
    # a gather).
    jaxpr = jax.make_jaxpr(lambda s: strategy.take_rows(blocks, s, blocked=True))
    for primitive in ("gather", "all_gather", "psum", "all_to_all", "ppermute"):
        assert not has_primitive(jaxpr(step).jaxpr, primitive)
    by_index = jax.make_jaxpr(lambda i: strategy.take_rows(placed, i))
    assert has_primitive(by_index(np.arange(16, dtype=np.int32)).jaxpr, "gather")
    with pytest.raises(ValueError, match="batch_rows=12 for 8 replicas"):
        mirrored(8).place_blocks(data, 12)


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_split_rows_lay_a_shuffled_pass_out_as_blocks(devices):
    strategy = mirrored(devices)
    data = [
        np.arange(70 * 3, dtype=np.float32).reshape(70, 3) + 1,
        np.arange(70, dtype=np.int32) * 10 + 1,
    ]
    split, replica_rows = strategy.place_rows(data)
    assert replica_rows == -(-70 // devices)
    for array, rows in zip(split, data, strict=True):  # Padded with zeros.
        assert array.shape == (replica_rows * devices, *rows.shape[1:])
        for shard in array.addressable_shards:
            assert shard.data.shape[0] == replica_rows
        np.testing.assert_array_equal(array[:70], rows)
        assert not np.asarray(array[70:]).any()
    order = np.random.RandomState(devices).permutation(70).astype(np.int32)
    full = order[:64].reshape(4, 16)  # 4 batches of 16; then 6 rows, padded.
    partial = np.concatenate([order[64:], np.full(2, -1, np.int32)])[None]
    blocks, last = strategy.exchange_rows(split, replica_rows, [full, partial])
    for block, rows in zip(blocks, data, strict=True):
        np.testing.assert_array_equal(block, rows[full])
        for shard in block.addressable_shards:  # Its rows of every batch.
            assert shard.data.shape[:2] == (4, 16 // devices)
    for block, rows in zip(last, data, strict=True):
        np.testing.assert_array_equal(block[0, :6], rows[order[64:]])
        assert not np.asarray(block[0, 6:]).any()  # Padding: zero rows.
    # A step takes its block, laid out as `shard` lays out a batch.
    step = strategy.step_numbers(3)[2]
    taken = strategy.take_rows(blocks, step, blocked=True)
    laid_out = strategy.shard(data[0][full[2]])
    np.testing.assert_array_equal(taken[0], laid_out)
    assert taken[0].sharding.is_equivalent_to(laid_out.sharding, 2)


def test_the_passes_of_a_fit_share_one_exchange_program():
    # The chunk a replica sends another is rounded up to a ladder: the
    # shuffled passes of one dataset land on the same shapes (one compile).
    rows, batch = 16384, 256
    shapes = set()
    for seed in range(20):
        order = np.random.RandomState(seed).permutation(rows).astype(np.int32)
        batches = [order.reshape(-1, batch)]
        plan = plan_exchange(batches, rows // 8, 8, round_rows=1024)
        shapes.add(plan.send.shape)
        # 2048 rows a replica, in 2 rounds of 1024, each taking about 128
        # rows from each replica: every source, every row once.
        assert plan.receive.shape == (8, 2, 1024)
        chunk = plan.send.shape[-1]
        for replica in range(8):
            received = plan.receive[replica]
            assert sorted(np.unique(received // chunk)) == list(range(8))
            assert len(np.unique(received[0])) == 1024
        assert plan_exchange(batches, rows // 8, 8).receive.shape == (8, 1, 2048)
    assert len(shapes) == 1
    (shape,) = shapes
    assert shape[:3] == (8, 2, 8)
    assert 128 <= shape[3] <= 1.4 * 128  # About rows / 128 a pair and round.
    # Replica d needs only its own rows: a wider chunk, still exact.
    own = np.array([[*range(8), *range(16, 24)], [*range(8, 16), *range(24, 32)]])
    lopsided = plan_exchange([own.astype(np.int32)], 16, 2)
    assert lopsided.send.shape == (2, 1, 2, 16)
    np.testing.assert_array_equal(lopsided.send[:, 0, 0], [np.arange(16), [0] * 16])
    np.testing.assert_array_equal(lopsided.receive[:, 0], [range(16), range(16, 32)])


def test_rounds_lay_out_the_same_batches_as_one(monkeypatch):
    strategy = mirrored(2)
    rows = np.arange(3000 * 2, dtype=np.float32).reshape(3000, 2) + 1
    split, replica_rows = strategy.place_rows([rows])
    order = np.random.RandomState(0).permutation(3000).astype(np.int32)
    full = order[:2944].reshape(23, 128)
    partial = np.concatenate([order[2944:], np.full(8, -1, np.int32)])[None]
    groups = [full, partial]
    # 1504 rows a replica: in rounds of at least 256 (128 a pair), 6 rounds.
    assert plan_exchange(groups, replica_rows, 2).receive.shape == (2, 1, 1504)
    rounds = plan_exchange(groups, replica_rows, 2, round_rows=256)
    assert rounds.receive.shape == (2, 6, 251)
    results = []
    for round_bytes in (2**30, 256 * 8):  # One round; rounds of 256 rows.
        monkeypatch.setattr(_resident_placement, "_ROUND_BYTES", round_bytes)
        results.append(strategy.exchange_rows(split, replica_rows, groups))
    for blocks, last in results:
        np.testing.assert_array_equal(blocks[0], rows[full])
        np.testing.assert_array_equal(last[0][0, :56], rows[order[2944:]])
        assert not np.asarray(last[0][0, 56:]).any()  # Padding: zero rows.


def test_split_rows_need_a_pass_read_ahead():
    strategy = mirrored(8)
    data = lay_out_resident(strategy, (X, Y), ROWS)
    with pytest.raises(RuntimeError, match="needs each pass read ahead"):
        ResidentPass(strategy, data, iter([np.arange(8)]), call=None)


class _Layouts:
    """Records the datasets a strategy lays out: copied, blocks or split rows."""

    def __init__(self, strategy):
        self.copies, self.blocks, self.splits = [], [], []
        place_dataset, place_blocks = strategy.place_dataset, strategy.place_blocks
        place_rows = strategy.place_rows

        def copied(data):
            self.copies.append(place_dataset(data))
            return self.copies[-1]

        def blocked(data, batch_rows):
            self.blocks.append(place_blocks(data, batch_rows))
            return self.blocks[-1]

        def split(data):
            self.splits.append(place_rows(data))
            return self.splits[-1]

        strategy.place_dataset, strategy.place_blocks = copied, blocked
        strategy.place_rows = split

    def rows_on_first_device(self, placed) -> int:
        device = jax.devices()[0]
        leaf = jax.tree.leaves(placed)[0]
        data = next(s.data for s in leaf.addressable_shards if s.device == device)
        return int(np.prod(data.shape[: leaf.ndim - X.ndim + 1]))


def test_data_is_split_over_the_replicas_unless_a_copy_fits():
    strategy = mirrored(8)
    model = build_in_scope(strategy, WEIGHTS)
    layouts = _Layouts(strategy)
    # A device can hold it all (default budget): shuffled data is copied.
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert len(layouts.copies) == 1 and layouts.splits == []
    assert layouts.rows_on_first_device(layouts.copies[0]) == 37
    layouts.copies.clear()
    # No copy fits: shuffled training data is split by rows; its validation
    # split is read in order: blocks.
    strategy.input_options = SPLIT
    model.fit(X, Y, batch_size=8, epochs=2, validation_split=0.2, verbose=0)
    assert layouts.copies == [] and len(layouts.splits) == 1
    assert len(layouts.blocks) == 1
    split, replica_rows = layouts.splits[0]
    assert replica_rows == 4  # 29 rows over 8 replicas, padded to 32.
    assert layouts.rows_on_first_device(split) == 4  # Not 29.
    validation_blocks, validation_tail = layouts.blocks[0]  # 8 rows: 1 batch.
    assert len(jax.tree.leaves(validation_blocks)[0]) == 1
    assert layouts.rows_on_first_device(validation_blocks) == 1  # Not 8.
    assert len(jax.tree.leaves(validation_tail)[0]) == 0
    layouts.copies.clear(), layouts.blocks.clear()
    model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.evaluate(X, Y, batch_size=8, verbose=0)
    model.predict(X, batch_size=8, verbose=0)
    assert layouts.copies == [] and len(layouts.blocks) == 3
    for blocks, tail in layouts.blocks:  # 37 rows: 4 batches of 8, then 5.
        assert layouts.rows_on_first_device(blocks) == 4  # Not 37.
        np.testing.assert_array_equal(jax.tree.leaves(tail)[0], X[32:])
    # Keras draws a `shuffle="batch"` order batch by batch: copied.
    layouts.blocks.clear()
    model.fit(X, Y, batch_size=8, epochs=1, shuffle="batch", verbose=0)
    assert len(layouts.copies) == 1 and len(layouts.splits) == 1
    assert layouts.rows_on_first_device(layouts.copies[0]) == 37


@pytest.mark.parametrize(
    "resident, want",
    [
        (True, {"shard": 3, "shard_steps": 4, "exchange_rows": 0}),
        ("split", {"shard": 0, "shard_steps": 0, "exchange_rows": 4}),
    ],
)
def test_a_fused_group_names_its_table_rows_with_one_kept_vector(resident, want):
    strategy = mirrored(8)
    strategy.input_options = _options(resident)
    with strategy.scope():
        model = make_model()
        model.set_weights(WEIGHTS)
        compile_model(model, steps_per_execution=2)
    transfers = _Transfers(strategy)
    model.fit(X, Y, batch_size=8, epochs=3, shuffle=True, verbose=0)
    # 4 full batches a pass: groups at table rows (or blocks) 0-1 and 2-3,
    # then the partial batch alone. Each group's rows are one argument,
    # made once.
    assert transfers.counts == want
    ranges = strategy._step_ranges
    assert sorted(ranges) == [(0, 2), (2, 2)]
    np.testing.assert_array_equal(np.asarray(ranges[2, 2]), [2, 3])
    assert ranges[2, 2].dtype == np.int32
    assert ranges[2, 2].sharding.is_fully_replicated


@pytest.mark.parametrize(
    "resident, shuffle",
    [(True, True), ("split", True), (True, False), (True, "batch")],
    ids=["copied", "split", "blocks", "batch-copied"],
)
def test_jax_array_inputs_equal_numpy_inputs(resident, shuffle):
    def run(x, y):
        keras.utils.set_random_seed(3)
        model = _model(resident)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=shuffle, verbose=0)
        scores = model.evaluate(x, y, batch_size=8, verbose=0)
        return history.history, scores, model.predict(x, batch_size=8, verbose=0)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("batch",))
    everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # One committed to a device, one on every device of the mesh.
    on_devices = run(jax.device_put(X, jax.devices()[3]), jax.device_put(Y, everywhere))
    for got, want in zip(on_devices, run(X, Y), strict=True):
        np.testing.assert_equal(got, want)


@pytest.mark.parametrize("resident", [True, "split"])
@pytest.mark.parametrize(
    "mode",
    [{"steps_per_execution": 3}, {"run_eagerly": True}, {"jit_compile": False}],
    ids=str,
)
def test_resident_execution_modes_equal_keras(mode, resident):
    spy = _Resident()
    resident = _run(resident, True, spy, **mode)
    assert spy.counts["fit"] == 2
    _assert_same(_run(None, True, **mode), resident)


@pytest.mark.parametrize("resident", [True, "split"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_equals_keras(name, resident):
    # Split state (FSDP, ZeRO-1, PS) and state in host memory (CentralStorage);
    # batch 8: 4 full batches from the pass's index table, then 5 rows padded.
    def fit(strategy):
        keras.utils.set_random_seed(3)
        if strategy is None:
            model = compile_model(make_model())
            model.set_weights(WEIGHTS)
        else:
            strategy.input_options = _options(resident)
            model = build_in_scope(strategy, WEIGHTS)
        history = model.fit(
            X, Y, batch_size=8, epochs=2, shuffle=True, verbose=0
        ).history
        return history, model.get_weights()

    expected, got = fit(None), fit(STRATEGIES[name]())
    assert_history_close(expected[0], got[0])
    assert_weights_close(expected[1], got[1])


def _fit_layouts(options, x, shuffle=True, batch_size=8) -> list[str]:
    """The layouts of the datasets `fit` laid out on the devices."""
    strategy = mirrored(8)
    if options is not None:
        strategy.input_options = options
    model = build_in_scope(strategy, WEIGHTS)
    layouts = []
    lay_out = _array_input.lay_out_resident

    def recording(strategy, data, layout, **kwargs):
        layouts.append(layout)
        return lay_out(strategy, data, layout, **kwargs)

    with unittest.mock.patch.object(_array_input, "lay_out_resident", recording):
        model.fit(
            x,
            Y[: len(x)],
            batch_size=batch_size,
            epochs=1,
            shuffle=shuffle,
            verbose=0,
        )
    return layouts


def test_the_budget_decides_by_what_a_devices_memory_holds():
    # 37 rows of 6 float32 and an int32 label: 1036 bytes; batches of 8. The
    # 8 CPU devices share the host's memory: a copy on each costs 8288.
    assert _fit_layouts(None, X) == ["copy"]  # Default: up to 256 MiB.
    assert _fit_layouts(kd.InputOptions(device_resident_budget=8288), X) == ["copy"]
    # No copy fits: the host path (it beat the split layout on CPU devices).
    assert _fit_layouts(kd.InputOptions(device_resident_budget=8287), X) == []
    # Read in order: blocks, 8 parts of 130 bytes in the one memory.
    in_order = kd.InputOptions(device_resident_budget=1036)
    assert _fit_layouts(in_order, X, shuffle=False) == ["blocks"]
    assert _fit_layouts(in_order, X, shuffle=True) == []
    under = kd.InputOptions(device_resident_budget=1035)
    assert _fit_layouts(under, X, shuffle=False) == []
    # Asked for, over the budget: shuffled data split by rows (unless only
    # a copy serves: `shuffle="batch"`, batches of 10 rows for 8 replicas).
    forced = kd.InputOptions(device_resident=True, device_resident_budget=0)
    assert _fit_layouts(forced, X) == ["rows"]
    assert _fit_layouts(forced, X, shuffle=False) == ["blocks"]
    assert _fit_layouts(forced, X, shuffle="batch") == ["copy"]
    assert _fit_layouts(forced, X, batch_size=10) == ["copy"]
    assert _fit_layouts(kd.InputOptions(device_resident=False), X) == []


@pytest.mark.parametrize("shared_memory", [False, True])  # GPUs/TPUs; CPU.
def test_the_budget_counts_each_memory(shared_memory):
    def layout(budget, *, in_order=False, forced=None):
        options = kd.InputOptions(device_resident=forced, device_resident_budget=budget)
        return resident_layout(
            options,
            1000,
            8,
            in_order=in_order,
            splittable=True,
            shared_memory=shared_memory,
        )

    copy = 8000 if shared_memory else 1000  # A copy on each device.
    share = 1000 if shared_memory else 125  # Its part of the blocks (or rows).
    assert layout(copy) == "copy" and layout(copy - 1) is None
    assert layout(share, in_order=True) == "blocks"
    assert layout(share - 1, in_order=True) is None
    assert layout(copy - 1, forced=True) == "rows"
    assert layout(0, in_order=True, forced=True) == "blocks"
    assert layout(10**9, forced=False) is None


def test_float64_counts_as_floatx():
    # Keras casts float64 input to float32 before it reaches the devices.
    options = kd.InputOptions(device_resident=None, device_resident_budget=8288)
    assert _fit_layouts(options, X.astype("float64")) == ["copy"]


def test_inputs_without_targets():
    # fit(x) alone: Keras's batches are bare arrays, not tuples.
    class OwnLoss(keras.Sequential):
        def compute_loss(self, x=None, y=None, y_pred=None, *args, **kwargs):
            return keras.ops.mean(y_pred**2)

    def fit(strategy):
        keras.utils.set_random_seed(5)
        model = OwnLoss(make_model().layers)
        model.set_weights(WEIGHTS)
        if strategy is None:
            model.compile("sgd")
            return model.fit(X, batch_size=10, verbose=0).history["loss"]
        strategy.input_options = kd.InputOptions(device_resident=True)
        with strategy.scope():
            model.compile("sgd")
            return model.fit(X, batch_size=10, verbose=0).history["loss"]

    np.testing.assert_allclose(fit(mirrored(8)), fit(None), rtol=1e-5)


def test_input_options_are_checked():
    with pytest.raises(ValueError, match="device_resident_budget=-1"):
        kd.InputOptions(device_resident_budget=-1)
    with pytest.raises(ValueError, match="device_resident='yes'"):
        kd.InputOptions(device_resident="yes")
    with pytest.raises(TypeError, match=r"input_options=\{'device_resident'"):
        mirrored(2).input_options = {"device_resident": True}


def _resumable_fit(model, *callbacks, shuffle=True):
    keras.utils.set_random_seed(11)
    return model.fit(
        X,
        Y,
        batch_size=8,
        epochs=3,
        shuffle=shuffle,
        callbacks=list(callbacks),
        verbose=0,
    )


@pytest.mark.parametrize(
    "resident, shuffle",
    [(True, True), ("split", True), (True, False)],
    ids=["copied", "split", "blocks"],
)
def test_backup_and_restore_resumes_exactly(tmp_path, capsys, resident, shuffle):
    backup = kd.callbacks.BackupAndRestore(tmp_path, save_freq=1)
    with pytest.raises(RuntimeError, match="interrupted at step 7"):
        _resumable_fit(_model(resident), backup, InterruptAt(7), shuffle=shuffle)
    spy = _Resident()
    model = _model(resident)
    history = _resumable_fit(
        model, kd.callbacks.BackupAndRestore(tmp_path), spy, shuffle=shuffle
    ).history
    assert "resuming at epoch 2, step 2" in capsys.readouterr().out
    assert spy.counts["fit"] == 1
    expected = _model(resident)
    expected_history = _resumable_fit(expected, shuffle=shuffle).history
    np.testing.assert_equal(model.get_weights(), expected.get_weights())
    assert history["loss"] == expected_history["loss"][1:]


def test_a_shuffled_pass_over_blocks_is_refused_not_misread():
    # `resident_pass` lays blocks out only for passes in order; a pass that
    # is not must fail loudly, never read the wrong rows.
    strategy = mirrored(8)
    data = lay_out_resident(strategy, (X, Y), BLOCKS, block_rows=8)
    order = np.random.RandomState(0).permutation(37)
    batches = [order[i : i + 8] for i in range(0, 37, 8)]
    shuffled = ResidentPass(strategy, data, iter(batches), call=None, read_ahead=True)
    with pytest.raises(RuntimeError, match="batches of 8 rows out of order"):
        next(shuffled)
    tail = ResidentPass(strategy, data, iter([np.arange(30, 37)]), call=None)
    with pytest.raises(RuntimeError, match="reads rows before row 32"):
        next(tail)


def _assert_fit_on_devices_equals_keras(resident, seed, **fit_kwargs):
    """`fit` of `X, Y` on the devices gives Keras's history and weights."""

    def fit(resident, callbacks=()):
        keras.utils.set_random_seed(seed)
        model = _model(resident)
        history = model.fit(
            X, Y, batch_size=8, callbacks=list(callbacks), verbose=0, **fit_kwargs
        ).history
        return history, model.get_weights()

    spy = _Resident()
    got = fit(resident, [spy])
    assert spy.counts["fit"] == 1  # On the devices.
    expected = fit(None)
    assert_history_close(expected[0], got[0])
    assert_weights_close(expected[1], got[1])


@pytest.mark.parametrize("resident", [True, "split"])
@pytest.mark.parametrize("steps_per_epoch", [3, 7])  # Part of a pass; past it.
@pytest.mark.parametrize("shuffle", [True, False])
def test_steps_per_epoch_equals_keras(resident, steps_per_epoch, shuffle):
    # 37 rows, batches of 8: 5 a pass. Keras's epochs then cut across its
    # passes (and runs out of data at 7 steps an epoch, as Keras does).
    _assert_fit_on_devices_equals_keras(
        resident, 5, epochs=3, steps_per_epoch=steps_per_epoch, shuffle=shuffle
    )


@pytest.mark.parametrize("resident", [True, "split"])
def test_class_weight_equals_keras(resident):
    # Keras turns `class_weight` into per-row sample weights of the arrays.
    _assert_fit_on_devices_equals_keras(
        resident, 9, epochs=2, class_weight={0: 0.5, 1: 2.0, 2: 1.0}
    )
