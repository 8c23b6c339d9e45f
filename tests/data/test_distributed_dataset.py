"""experimental_distribute_dataset, distribute_datasets_from_function, prefetch."""

import copy
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from keras_dist.data.host._pipeline import Prefetcher
from tests._helpers import mirrored
from tests.conftest import REPLICA_COUNTS


def _data(n=37):
    x = np.arange(n * 2, dtype="float32").reshape(n, 2)
    return x, np.arange(n, dtype="int32")


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_global_batches_split_over_replicas(n):
    strategy = mirrored(n)
    x, y = _data(37)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    dist = strategy.experimental_distribute_dataset(dataset)
    seen_x, seen_y = [], []
    for images, labels in dist:
        assert isinstance(images, jax.Array)
        assert images.shape[0] % n == 0
        assert {s.data.shape[0] for s in images.addressable_shards} == {
            images.shape[0] // n
        }
        seen_x.append(strategy.gather(images, axis=0))
        seen_y.append(strategy.gather(labels, axis=0))
    # Every sample exactly once, in order; the partial batch of 5 is padded.
    np.testing.assert_array_equal(np.concatenate(seen_x), x)
    np.testing.assert_array_equal(np.concatenate(seen_y), y)
    assert len(seen_x) == 3


def test_each_iter_is_a_new_pass_and_next_works():
    strategy = mirrored(4)
    x, y = _data(32)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    )
    for _ in range(2):
        assert sum(1 for _ in dist) == 4
    iterator = iter(dist)
    first = next(iterator)
    second = iterator.get_next()
    np.testing.assert_array_equal(strategy.gather(first[1], 0), y[:8])
    np.testing.assert_array_equal(strategy.gather(second[1], 0), y[8:16])


def test_fixed_number_of_steps_on_a_repeated_dataset():
    strategy = mirrored(8)
    x, y = _data(20)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16)
    )
    iterator = iter(dist)
    labels = [strategy.gather(next(iterator)[1], 0) for _ in range(5)]
    np.testing.assert_array_equal(np.concatenate(labels), np.tile(y, 4))
    iterator.close()


def test_dict_elements_and_numpy_iterables():
    strategy = mirrored(2)
    x, y = _data(6)
    batches = [{"x": x[:4], "y": y[:4]}, {"x": x[4:], "y": y[4:]}]
    out = list(strategy.experimental_distribute_dataset(batches))
    assert set(out[0]) == {"x", "y"}
    np.testing.assert_array_equal(strategy.gather(out[1]["y"], 0), y[4:])


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_distribute_datasets_from_function(n):
    strategy = mirrored(n)
    x, y = _data(45)
    contexts = []

    def dataset_fn(ctx: kd.InputContext):
        contexts.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(4 * n)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    (ctx,) = contexts
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id) == (1, 0)
    assert ctx.num_replicas_in_sync == n
    batches = list(dist)
    assert batches[0][0].shape == (4 * n, 2)
    np.testing.assert_array_equal(
        np.concatenate([strategy.gather(b[1], 0) for b in batches]), y
    )


def test_input_context():
    ctx = kd.InputContext(
        num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8
    )
    assert ctx.get_per_replica_batch_size(64) == 8
    assert repr(ctx) == (
        "InputContext(num_input_pipelines=2, input_pipeline_id=1, "
        "num_replicas_in_sync=8)"
    )
    with pytest.raises(
        ValueError, match=r"Received: global_batch_size=60\. Use e\.g\. 56 or 64"
    ):
        ctx.get_per_replica_batch_size(60)
    with pytest.raises(ValueError, match="global_batch_size=0"):
        ctx.get_per_replica_batch_size(0)
    with pytest.raises(ValueError, match="input_pipeline_id=2"):
        kd.InputContext(num_input_pipelines=2, input_pipeline_id=2)


def test_unbatched_dataset_is_refused():
    strategy = mirrored(2)
    x, y = _data(8)
    with pytest.raises(ValueError, match=r"must be batched.*dataset\.batch\("):
        strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y))
        )
    with pytest.raises(ValueError, match="get_per_replica_batch_size"):
        strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.from_tensor_slices((x, y))
        )
    with pytest.raises(TypeError, match=r"kd\.InputOptions"):
        strategy.experimental_distribute_dataset([x], options={"prefetch": 2})
    with pytest.raises(ValueError, match="experimental_per_replica_buffer_size=0"):
        kd.InputOptions(experimental_per_replica_buffer_size=0)


def test_batches_that_change_rank_or_dtype_mid_pass_are_refused():
    strategy = mirrored(2)
    batches = [np.zeros((4, 3), "float32"), np.zeros((4, 3, 1), "float32")]
    with pytest.raises(ValueError, match=r"Batch 1 of list does not match batch 0"):
        list(strategy.experimental_distribute_dataset(batches))
    batches = [np.zeros((4, 3), "float32"), np.zeros((4, 3), "int32")]
    with pytest.raises(ValueError, match="dtype int32"):
        list(strategy.experimental_distribute_dataset(batches))


def test_prefetch_runs_ahead_on_a_background_thread():
    produced = []

    def slow_source():
        for i in range(4):
            produced.append((i, threading.current_thread().name))
            yield i

    prefetcher = Prefetcher(slow_source(), buffer_size=2)
    deadline = time.monotonic() + 5
    while len(produced) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Before the consumer asked for anything: item 0 is queued, 1 and 2 waiting.
    assert len(produced) >= 3
    assert produced[0][1] == "keras_dist-prefetch"
    assert list(prefetcher) == [0, 1, 2, 3]


def test_prefetch_reraises_errors_in_order_and_close_stops_it():
    def failing():
        yield 1
        raise RuntimeError("broken pipeline")

    prefetcher = Prefetcher(failing(), buffer_size=1)
    assert next(prefetcher) == 1
    with pytest.raises(RuntimeError, match="broken pipeline"):
        next(prefetcher)

    def endless():
        while True:
            yield 0

    prefetcher = Prefetcher(endless(), buffer_size=1)
    next(prefetcher)
    prefetcher.close()
    prefetcher._thread.join(timeout=2)
    assert not prefetcher._thread.is_alive()


def test_without_fetch_to_device():
    strategy = mirrored(2)
    x, y = _data(6)
    options = kd.InputOptions(experimental_fetch_to_device=False)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(4), options=options
    )
    labels = [strategy.gather(b[1], 0) for b in dist]
    np.testing.assert_array_equal(np.concatenate(labels), y)


def test_a_padded_batch_carries_its_real_rows_wherever_user_code_puts_it():
    # The real-row count lives on each array of the element, not in a table
    # keyed by identity: user containers keep it, a new array does not get it.
    strategy = mirrored(8)
    x, y = _data(13)  # Batches of 8 and 5 rows: the second is padded to 8.
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    )
    _, (last_x, last_y) = list(dist)
    assert last_x.shape == (8, 2)
    repacked = {"features": [last_x], "labels": copy.copy((last_y,))}
    gathered = strategy.gather(repacked, axis=0)
    np.testing.assert_array_equal(gathered["features"][0], x[8:])
    np.testing.assert_array_equal(gathered["labels"][0], y[8:])

    def mean_of_ones(labels):
        return kd.losses.compute_average_loss(jnp.ones(labels.shape[0]))

    # Divided by the 5 real rows: the replicas' sums add up to exactly 1.
    total = strategy.reduce(
        "sum", strategy.run(mean_of_ones, args=(repacked["labels"][0],)), axis=None
    )
    np.testing.assert_allclose(float(total), 1.0, rtol=1e-6)
    fresh = jax.device_put(np.asarray(last_x), last_x.sharding)
    assert strategy.gather(fresh, axis=0).shape == (8, 2)
    local = strategy.experimental_local_results(last_y)
    assert [int(v.shape[0]) for v in local] == [1, 1, 1, 1, 1, 0, 0, 0]
