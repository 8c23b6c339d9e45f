"""Device-resident layouts: which data is copied, split as blocks or by rows.

The layouts themselves (shards, padding, the take of a batch, the exchange
of a split pass and its plan), which one `fit`/`evaluate`/`predict` choose
for which data under which budget, and the errors of a pass a layout cannot
serve. `test_device_resident.py` checks the numbers against Keras.
"""

import unittest.mock

import jax
import numpy as np
import pytest

import keras_dist as kd
from keras_dist._seams import _adapters
from keras_dist.data.resident._resident import ResidentPass
from keras_dist.data.resident._resident_data import (
    BLOCKS,
    DEFAULT_BUDGET,
    ROWS,
    budget,
    lay_out_resident,
    resident_layout,
)
from keras_dist.strategies.placement import _resident_placement
from keras_dist.strategies.placement._exchange import plan_exchange
from keras_dist.training._fused_steps import has_primitive
from tests._helpers import build_in_scope, mirrored
from tests.data._resident_cases import SPLIT, WEIGHTS, X, Y


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_blocks_hold_each_replicas_rows_and_take_a_batch_as_indices_would(devices):
    strategy = mirrored(devices)
    data = [
        np.arange(70 * 3, dtype=np.float32).reshape(70, 3),
        np.arange(70, dtype=np.int32) * 10,
    ]
    blocks, tail = strategy.placement.lay_out_blocks(
        data, 16
    )  # 4 batches of 16, 6 rows.
    for block, rows in zip(blocks, data, strict=True):
        assert block.shape == (4, 16, *rows.shape[1:])
        for shard in block.addressable_shards:  # Its rows of every batch.
            assert shard.data.shape[:2] == (4, 16 // devices)
    for part, rows in zip(tail, data, strict=True):
        np.testing.assert_array_equal(part, rows[64:])
        assert part.sharding.is_fully_replicated
    step = strategy.placement.step_numbers(3)[2]  # Batch 2: rows 32-47.
    taken = strategy.placement.take_rows(blocks, step, blocked=True)
    placed = strategy.placement.lay_out_dataset(data)
    gathered = strategy.placement.take_rows(
        placed, strategy.placement.lay_out(np.arange(32, 48))
    )
    for got, want, rows in zip(taken, gathered, data, strict=True):
        np.testing.assert_array_equal(got, rows[32:48])
        np.testing.assert_array_equal(got, want)
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    # Each device indexes its own block: no gather, no collective (indices:
    # a gather).
    jaxpr = jax.make_jaxpr(
        lambda s: strategy.placement.take_rows(blocks, s, blocked=True)
    )
    for primitive in ("gather", "all_gather", "psum", "all_to_all", "ppermute"):
        assert not has_primitive(jaxpr(step).jaxpr, primitive)
    by_index = jax.make_jaxpr(lambda i: strategy.placement.take_rows(placed, i))
    assert has_primitive(by_index(np.arange(16, dtype=np.int32)).jaxpr, "gather")
    with pytest.raises(ValueError, match="batch_rows=12 for 8 replicas"):
        mirrored(8).placement.lay_out_blocks(data, 12)


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_split_rows_lay_a_shuffled_pass_out_as_blocks(devices):
    strategy = mirrored(devices)
    data = [
        np.arange(70 * 3, dtype=np.float32).reshape(70, 3) + 1,
        np.arange(70, dtype=np.int32) * 10 + 1,
    ]
    split, replica_rows = strategy.placement.lay_out_rows(data)
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
    blocks, last = strategy.placement.exchange_rows(
        split, replica_rows, [full, partial]
    )
    for block, rows in zip(blocks, data, strict=True):
        np.testing.assert_array_equal(block, rows[full])
        for shard in block.addressable_shards:  # Its rows of every batch.
            assert shard.data.shape[:2] == (4, 16 // devices)
    for block, rows in zip(last, data, strict=True):
        np.testing.assert_array_equal(block[0, :6], rows[order[64:]])
        assert not np.asarray(block[0, 6:]).any()  # Padding: zero rows.
    # A step takes its block, laid out as `lay_out` lays out a batch.
    step = strategy.placement.step_numbers(3)[2]
    taken = strategy.placement.take_rows(blocks, step, blocked=True)
    laid_out = strategy.placement.lay_out(data[0][full[2]])
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
    split, replica_rows = strategy.placement.lay_out_rows([rows])
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
        results.append(strategy.placement.exchange_rows(split, replica_rows, groups))
    for blocks, last in results:
        np.testing.assert_array_equal(blocks[0], rows[full])
        np.testing.assert_array_equal(last[0][0, :56], rows[order[2944:]])
        assert not np.asarray(last[0][0, 56:]).any()  # Padding: zero rows.


def test_split_rows_need_a_pass_read_ahead():
    strategy = mirrored(8)
    data = lay_out_resident(strategy.placement, (X, Y), ROWS)
    with pytest.raises(RuntimeError, match="needs each pass read ahead"):
        ResidentPass(strategy.placement, data, iter([np.arange(8)]), call=None)


class _Layouts:
    """Records the datasets a strategy lays out: copied, blocks or split rows."""

    def __init__(self, strategy):
        self.copies, self.blocks, self.splits = [], [], []
        target = strategy.placement  # What the input pipeline lays out with.
        lay_out_dataset, lay_out_blocks = target.lay_out_dataset, target.lay_out_blocks
        lay_out_rows = target.lay_out_rows

        def copied(data):
            self.copies.append(lay_out_dataset(data))
            return self.copies[-1]

        def blocked(data, batch_rows):
            self.blocks.append(lay_out_blocks(data, batch_rows))
            return self.blocks[-1]

        def split(data):
            self.splits.append(lay_out_rows(data))
            return self.splits[-1]

        target.lay_out_dataset, target.lay_out_blocks = copied, blocked
        target.lay_out_rows = split

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


def _fit_layouts(options, x, shuffle=True, batch_size=8) -> list[str]:
    """The layouts of the datasets `fit` laid out on the devices."""
    strategy = mirrored(8)
    if options is not None:
        strategy.input_options = options
    model = build_in_scope(strategy, WEIGHTS)
    layouts = []
    lay_out = _adapters.lay_out_resident

    def recording(strategy, data, layout, **kwargs):
        layouts.append(layout)
        return lay_out(strategy, data, layout, **kwargs)

    with unittest.mock.patch.object(_adapters, "lay_out_resident", recording):
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


class _Accelerator:
    """A GPU as the budget sees one (none here): its platform and the
    memory statistics JAX reports for it."""

    platform = "gpu"

    def __init__(self, limit=None, in_use=0):
        self._stats = (
            None if limit is None else {"bytes_limit": limit, "bytes_in_use": in_use}
        )

    def memory_stats(self):
        return self._stats


@pytest.mark.parametrize("shared_memory", [False, True])  # GPUs/TPUs; CPU.
def test_the_budget_counts_each_memory(shared_memory):
    devices = tuple(jax.devices()) if shared_memory else (_Accelerator(),) * 8

    def layout(budget, *, in_order=False, forced=None):
        options = kd.InputOptions(device_resident=forced, device_resident_budget=budget)
        return resident_layout(
            options, 1000, 8, in_order=in_order, splittable=True, devices=devices
        )

    copy = 8000 if shared_memory else 1000  # A copy on each device.
    share = 1000 if shared_memory else 125  # Its part of the blocks (or rows).
    assert layout(copy) == "copy" and layout(copy - 1) is None
    assert layout(share, in_order=True) == "blocks"
    assert layout(share - 1, in_order=True) is None
    assert layout(copy - 1, forced=True) == "rows"
    assert layout(0, in_order=True, forced=True) == "blocks"
    assert layout(10**9, forced=False) is None


def test_the_default_budget_is_a_quarter_of_the_least_free_device_memory():
    automatic = kd.InputOptions()
    assert automatic.device_resident_budget is None
    gib = 2**30
    # An H200's 139 GiB, 19 GiB in use on one device: a quarter of 120 GiB.
    devices = (_Accelerator(139 * gib, 2 * gib), _Accelerator(139 * gib, 19 * gib))
    assert budget(automatic, devices) == 30 * gib
    # A device that reports no statistics (CPU's): the fixed default.
    assert budget(automatic, tuple(jax.devices())) == DEFAULT_BUDGET == 256 * 2**20
    assert budget(automatic, (*devices, _Accelerator())) == DEFAULT_BUDGET
    assert budget(kd.InputOptions(device_resident_budget=5), devices) == 5
    # 4 GB on 8 such GPUs is copied to each; on 8 GPUs of 16 GiB, nearly
    # full, it takes the host path.
    assert (
        resident_layout(
            automatic,
            4 * 10**9,
            8,
            in_order=False,
            splittable=True,
            devices=devices * 4,
        )
        == "copy"
    )
    small = (_Accelerator(16 * gib, 12 * gib),) * 8
    assert (
        resident_layout(
            automatic, 4 * 10**9, 8, in_order=False, splittable=True, devices=small
        )
        is None
    )


def test_float64_counts_as_floatx():
    # Keras casts float64 input to float32 before it reaches the devices.
    options = kd.InputOptions(device_resident=None, device_resident_budget=8288)
    assert _fit_layouts(options, X.astype("float64")) == ["copy"]


def test_a_shuffled_pass_over_blocks_is_refused_not_misread():
    # `resident_pass` lays blocks out only for passes in order; a pass that
    # is not must fail loudly, never read the wrong rows.
    strategy = mirrored(8)
    data = lay_out_resident(strategy.placement, (X, Y), BLOCKS, block_rows=8)
    order = np.random.RandomState(0).permutation(37)
    batches = [order[i : i + 8] for i in range(0, 37, 8)]
    shuffled = ResidentPass(
        strategy.placement, data, iter(batches), call=None, read_ahead=True
    )
    with pytest.raises(RuntimeError, match="batches of 8 rows out of order"):
        next(shuffled)
    tail = ResidentPass(strategy.placement, data, iter([np.arange(30, 37)]), call=None)
    with pytest.raises(RuntimeError, match="reads rows before row 32"):
        next(tail)
