"""Rows given where the replica API takes batches, and values of another strategy.

Each misuse is a clear error at the call (or at the first element of an
iterator); each correct use next to it still gives exact numbers.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import keras_dist as kd
from tests._helpers import mirrored


def _first_half():
    return kd.MirroredStrategy([f"cpu:{i}" for i in range(4)])


def _second_half():
    return kd.MirroredStrategy([f"cpu:{i}" for i in range(4, 8)])


def _data(n=8):
    x = np.arange(n * 3, dtype="float32").reshape(n, 3)
    return x, np.arange(n, dtype="int32")


def _gathered(strategy, dist):
    """Every batch of `dist`, gathered back to the host, concatenated per leaf."""
    batches = [jax.tree.map(lambda a: strategy.gather(a, axis=0), b) for b in dist]
    return jax.tree.map(lambda *xs: np.concatenate(xs), *batches)


# 1. An array is rows, not a dataset of batches. -------------------------------


@pytest.mark.parametrize("as_array", [np.asarray, jnp.asarray, tf.constant])
def test_array_given_as_dataset_is_refused(as_array):
    strategy = mirrored(4)
    x, _ = _data()
    with pytest.raises(TypeError) as info:
        strategy.experimental_distribute_dataset(as_array(x))
    message = str(info.value)
    assert "not an array: iterating an array yields its rows" in message
    assert "Received: dataset=" in message
    assert "of shape (8, 3) and dtype float32" in message
    assert "from_tensor_slices(x).batch(GLOBAL_BATCH_SIZE)" in message


def test_dict_of_arrays_given_as_dataset_is_refused():
    strategy = mirrored(4)
    x, y = _data()
    with pytest.raises(TypeError) as info:
        strategy.experimental_distribute_dataset({"x": x, "y": y})
    message = str(info.value)
    assert "not a mapping: iterating a dict yields its keys" in message
    assert "Received: dataset=dict {'x': float32[8,3], 'y': int32[8]}" in message
    assert "from_tensor_slices(features_dict).batch(GLOBAL_BATCH_SIZE)" in message


def test_batched_arrays_are_distributed_exactly():
    strategy = mirrored(4)
    x, y = _data(10)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(x).batch(8)
    )
    np.testing.assert_array_equal(_gathered(strategy, dist), x)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices({"x": x, "y": y}).batch(4)
    )
    out = _gathered(strategy, dist)
    np.testing.assert_array_equal(out["x"], x)
    np.testing.assert_array_equal(out["y"], y)


# 2. A Python list of examples is not a list of batches. -----------------------


def test_list_of_examples_is_refused():
    strategy = mirrored(4)
    x, y = _data()
    with pytest.raises(ValueError) as info:
        strategy.experimental_distribute_dataset([(x[i], y[i]) for i in range(8)])
    message = str(info.value)
    assert "element 0 is not: it has a scalar component (int32[])" in message
    assert "Received: dataset=list of 8 elements, element 0=(float32[3], int32[])" in (
        message
    )
    assert "from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE)" in message

    with pytest.raises(ValueError, match=r"scalar component \(int32\[\]\)"):
        strategy.experimental_distribute_dataset(
            [{"x": x[i], "y": y[i]} for i in range(8)]
        )
    with pytest.raises(ValueError, match=r"scalar component \(float 0\.5\)"):
        strategy.experimental_distribute_dataset([(x[:4], 0.5)])
    # Features and a one-hot label: the leading dimensions disagree.
    onehot = np.eye(2, dtype="float32")[y % 2]
    with pytest.raises(ValueError) as info:
        strategy.experimental_distribute_dataset([(x[i], onehot[i]) for i in range(8)])
    assert "disagree on the leading (batch) dimension (3 vs 2)" in str(info.value)
    assert "element 0=(float32[3], float32[2])" in str(info.value)


def test_features_and_labels_tuple_is_refused():
    strategy = mirrored(4)
    x, y = _data()
    with pytest.raises(ValueError) as info:
        strategy.experimental_distribute_dataset((x, y))
    message = str(info.value)
    assert "element 1 differs from element 0" in message
    assert (
        "Received: dataset=tuple of 2 elements, element 0=float32[8,3], "
        "element 1=int32[8]"
    ) in message
    assert "as given to `model.fit`" in message
    assert "from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE)" in message


def test_iterator_of_examples_is_refused_at_its_first_element():
    strategy = mirrored(4)
    x, y = _data()
    # Nothing is read at the call: a generator's elements are seen only then.
    dist = strategy.experimental_distribute_dataset((x[i], y[i]) for i in range(8))
    with pytest.raises(ValueError) as info:
        next(iter(dist))
    message = str(info.value)
    assert "its first element is not: it has a scalar component" in message
    assert "Received: first element of dataset=(float32[3], int32[])" in message


def test_lists_and_iterators_of_batches_are_distributed_exactly():
    strategy = mirrored(4)
    x, y = _data(10)
    batches = [(x[:8], y[:8]), (x[8:], y[8:])]  # A partial last batch.
    for dataset in (batches, tuple(batches), iter(batches)):
        out_x, out_y = _gathered(
            strategy, strategy.experimental_distribute_dataset(dataset)
        )
        np.testing.assert_array_equal(out_x, x)
        np.testing.assert_array_equal(out_y, y)
    # A list of equally shaped arrays is a list of batches (it cannot be told
    # from rows, so it is accepted).
    out = _gathered(strategy, strategy.experimental_distribute_dataset([x, x + 1]))
    np.testing.assert_array_equal(out, np.concatenate([x, x + 1]))


# 3. A tf.data dataset of examples (no scalar component) is refused. ----------


@pytest.mark.parametrize(
    "build, pipeline",
    [
        (lambda x: tf.data.Dataset.from_tensor_slices(x), "`from_tensor_slices`"),
        (
            lambda x: (
                tf.data.Dataset.from_tensor_slices(x)
                .map(lambda r: r * 2.0)
                .shuffle(4)
                .repeat(2)
                .prefetch(1)
            ),
            "`from_tensor_slices` -> `map` -> `shuffle` -> `repeat` -> `prefetch`",
        ),
        (
            lambda x: tf.data.Dataset.from_tensor_slices(x).batch(4).unbatch(),
            "`unbatch`",
        ),
        (
            lambda x: tf.data.Dataset.zip(
                tf.data.Dataset.from_tensor_slices(x),
                tf.data.Dataset.from_tensor_slices(x[:, :2]),
            ),
            "`from_tensor_slices` -> `from_tensor_slices` -> `zip`",
        ),
        (
            lambda x: tf.compat.v1.data.Dataset.from_tensor_slices(x).cache(),
            "`from_tensor_slices` -> `cache`",
        ),
    ],
)
def test_unbatched_tf_dataset_of_features_is_refused(build, pipeline):
    strategy = mirrored(4)
    x, _ = _data()
    with pytest.raises(ValueError) as info:
        strategy.experimental_distribute_dataset(build(x))
    message = str(info.value)
    assert "`dataset` must be batched by the global batch size" in message
    assert f"it is {pipeline}, with no `batch`" in message
    assert "Received: dataset=" in message
    assert "element_spec=" in message and "shape=(3,)" in message
    assert "Batch it: `dataset.batch(GLOBAL_BATCH_SIZE)`" in message


def _index_batches(x):
    """Slices of index batches, each gathered into a batch by `map`."""
    indices = np.arange(8).reshape(2, 4)
    table = tf.constant(x)
    return tf.data.Dataset.from_tensor_slices(indices).map(
        lambda idx: tf.gather(table, idx)
    )


@pytest.mark.parametrize(
    "build",
    [
        lambda x: (
            tf.data.Dataset.from_tensor_slices(x)
            .batch(4)
            .map(lambda b: b + 0.0)
            .prefetch(2)
            .repeat(1)
            .shuffle(1)
            .cache()
            .take(5)
            .with_options(tf.data.Options())
        ),
        lambda x: tf.data.Dataset.from_tensor_slices(x).batch(4, drop_remainder=True),
        lambda x: tf.data.Dataset.from_tensor_slices(x).batch(4, num_parallel_calls=2),
        lambda x: tf.data.Dataset.from_tensor_slices(x).padded_batch(4),
        lambda x: tf.data.Dataset.from_tensor_slices(x.reshape(2, 4, 3)).rebatch(4),
        lambda x: tf.data.Dataset.from_tensors(x),  # One element: the whole batch.
        lambda x: tf.data.Dataset.from_generator(
            lambda: iter([x[:4], x[4:]]),
            output_signature=tf.TensorSpec((None, 3), tf.float32),
        ),
        lambda x: tf.data.Dataset.range(1).interleave(
            lambda _: tf.data.Dataset.from_tensor_slices(x).batch(4)
        ),
        _index_batches,  # A map that adds a dimension may build batches.
    ],
    ids=[
        "batch_then_map_etc",
        "drop_remainder",
        "parallel_batch",
        "padded_batch",
        "rebatch",
        "from_tensors",
        "from_generator",
        "interleave",
        "map_gathers_batches",
    ],
)
def test_batched_tf_datasets_are_accepted_and_exact(build):
    strategy = mirrored(4)
    x, _ = _data()
    dist = strategy.experimental_distribute_dataset(build(x))
    np.testing.assert_array_equal(_gathered(strategy, dist), x)


def test_tfds_dataset_batched_by_the_user_is_accepted():
    strategy = mirrored(4)
    with tfds.testing.mock_data(
        num_examples=12, policy=tfds.testing.MockPolicy.USE_CODE
    ):
        dataset = tfds.load("mnist", split="train", as_supervised=True)
        expected = np.concatenate([label for _, label in dataset.batch(12)])
        with pytest.raises(ValueError, match="must be batched"):
            strategy.experimental_distribute_dataset(dataset)  # A scalar label.
        batched = dataset.map(lambda image, label: (image, label)).batch(8).prefetch(1)
        out = _gathered(strategy, strategy.experimental_distribute_dataset(batched))
    assert out[0].shape == (12, 28, 28, 1)
    np.testing.assert_array_equal(out[1], expected)


# 4. dataset_fn must return a dataset of per-replica batches. ------------------


def test_dataset_fn_returning_rows_is_refused():
    strategy = mirrored(4)
    x, y = _data()
    with pytest.raises(TypeError) as info:
        strategy.distribute_datasets_from_function(lambda ctx: x)
    message = str(info.value)
    assert "`dataset_fn(input_context)` must be a dataset of per-replica" in message
    assert "Received: dataset_fn(input_context)=ndarray of shape (8, 3)" in message
    assert "input_context.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)" in message

    with pytest.raises(TypeError) as info:
        strategy.distribute_datasets_from_function(lambda ctx: {"x": x, "y": y})
    message = str(info.value)
    assert "Received: dataset_fn(input_context)=dict {'x': float32[8,3]" in message
    assert "get_per_replica_batch_size(GLOBAL_BATCH_SIZE)" in message

    with pytest.raises(ValueError) as info:
        strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.from_tensor_slices(x)
        )
    message = str(info.value)
    assert "must be batched by the per-replica batch size" in message
    assert (
        "Batch it: `dataset.batch(input_context.get_per_replica_batch_size("
        "GLOBAL_BATCH_SIZE))`"
    ) in message

    with pytest.raises(ValueError, match=r"element 0 is not: it has a scalar"):
        strategy.distribute_datasets_from_function(
            lambda ctx: [(x[i], y[i]) for i in range(8)]
        )


def test_dataset_fn_returning_per_replica_batches_is_exact():
    strategy = mirrored(4)
    x, y = _data(10)

    def dataset_fn(ctx):
        per_replica = ctx.get_per_replica_batch_size(8)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica)

    out_x, out_y = _gathered(
        strategy, strategy.distribute_datasets_from_function(dataset_fn)
    )
    np.testing.assert_array_equal(out_x, x)
    np.testing.assert_array_equal(out_y, y)


# 5. run: a batch or PerReplica of another strategy. ---------------------------


def _distributed_batch(strategy, x):
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(len(x))
    return next(iter(strategy.experimental_distribute_dataset(dataset)))


@pytest.mark.parametrize(
    "make_other",
    [_second_half, lambda: mirrored(8)],
    ids=["disjoint_devices", "eight_vs_four"],
)
def test_run_refuses_a_batch_of_another_strategy(make_other):
    strategy, other = _first_half(), make_other()
    x, _ = _data()
    batch = _distributed_batch(other, x)
    with pytest.raises(ValueError) as info:
        strategy.run(lambda w, r: r * w, args=(2.0, batch))
    message = str(info.value)
    assert re.search(
        rf"`args\[1\]` of `strategy\.run` is a batch distributed by "
        rf"{re.escape(repr(other))}, not by this strategy, "
        rf"{re.escape(repr(strategy))}",
        message,
    )
    assert (
        f"Received: args[1]=float32[8,3] split over {other.num_replicas_in_sync}"
        in (message)
    )
    assert "Distribute the dataset with the strategy that runs the step" in message
    with pytest.raises(ValueError, match=r"`kwargs\['rows'\]\['x'\]` of `strategy"):
        strategy.run(lambda rows: rows["x"], kwargs={"rows": {"x": batch}})


def test_the_error_names_the_newest_strategy_over_the_batchs_devices(monkeypatch):
    """Two live strategies over the same 8 devices: the newer split the batch."""
    for name in ("TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS", "KERAS_DIST_COORDINATOR"):
        monkeypatch.delenv(name, raising=False)
    older = kd.MultiWorkerMirroredStrategy()
    strategy, other = _first_half(), mirrored(8)
    assert older.mesh == other.mesh
    batch = _distributed_batch(other, _data()[0])
    with pytest.raises(ValueError) as info:
        strategy.run(lambda r: r, args=(batch,))
    assert f"is a batch distributed by {other!r}, not by this strategy" in str(
        info.value
    )
    assert "MultiWorkerMirroredStrategy" not in str(info.value)
    del older


def test_run_refuses_a_per_replica_value_of_another_strategy():
    strategy, other = _first_half(), _second_half()
    x, _ = _data()
    per_replica = other.run(lambda r: r * 2.0, args=(_distributed_batch(other, x),))
    with pytest.raises(ValueError) as info:
        strategy.run(lambda r: r + 1.0, args=(per_replica,))
    message = str(info.value)
    assert (
        f"`args[0]` of `strategy.run` is a PerReplica value returned by the `run` "
        f"of {other!r}, not by this strategy, {strategy!r}"
    ) in message
    assert "Received: args[0]=PerReplica(num_replicas=4, shape=(2, 3)" in message
    assert "Run every step on the strategy whose `run` made the value" in message


def test_run_on_its_own_batches_gives_each_row_once():
    strategy = _first_half()
    x, _ = _data()
    batch = _distributed_batch(strategy, x)
    rows = strategy.run(lambda r: r * 2.0, args=(batch,))
    np.testing.assert_array_equal(strategy.gather(rows, axis=0), 2 * x)
    again = strategy.run(lambda r: r + 1.0, args=(rows,))
    np.testing.assert_array_equal(strategy.gather(again, axis=0), 2 * x + 1)
    # A strategy on the same devices lays batches out alike: accepted.
    twin = _first_half()
    np.testing.assert_array_equal(
        twin.gather(twin.run(lambda r: r * 2.0, args=(batch,)), axis=0), 2 * x
    )
    # Replicated weights (a plain array) still reach every replica whole.
    w = jnp.ones((3,), "float32")
    out = strategy.run(lambda r, w: r * w, args=(batch, w))
    np.testing.assert_array_equal(strategy.gather(out, axis=0), x)


# 6. reduce / gather / experimental_local_results of another strategy. --------


@pytest.mark.parametrize(
    "call",
    [
        lambda s, v: s.reduce("sum", v, axis=None),
        lambda s, v: s.reduce("mean", v, axis=0),
        lambda s, v: s.gather(v, axis=0),
        lambda s, v: s.experimental_local_results(v),
    ],
    ids=["reduce", "reduce_axis0", "gather", "experimental_local_results"],
)
@pytest.mark.parametrize(
    "make_other", [_second_half, lambda: mirrored(8)], ids=["disjoint", "8v4"]
)
def test_cross_replica_calls_refuse_values_of_another_strategy(call, make_other):
    strategy, other = _first_half(), make_other()
    x, _ = _data()
    batch = _distributed_batch(other, x)
    per_replica = other.run(lambda r: r * 2.0, args=(batch,))
    name = ("reduce", "gather", "experimental_local_results")
    with pytest.raises(ValueError) as info:
        call(strategy, {"out": per_replica})
    message = str(info.value)
    (called,) = [n for n in name if f"`strategy.{n}`" in message]
    assert (
        f"`value['out']` of `strategy.{called}` is a PerReplica value returned by "
        f"the `run` of {other!r}, not by this strategy, {strategy!r}"
    ) in message
    assert "Received: value['out']=PerReplica(" in message
    assert f"Call `{called}` on the strategy whose `run` returned it." in message
    with pytest.raises(ValueError) as info:
        call(strategy, batch)
    assert f"`value` of `strategy.{called}` is a batch distributed by {other!r}" in (
        str(info.value)
    )
    assert f"Call `{called}` on the strategy that distributed it." in str(info.value)


def test_cross_replica_calls_on_own_values_are_exact():
    strategy = _first_half()
    x, _ = _data()
    batch = _distributed_batch(strategy, x)
    per_replica = strategy.run(lambda r: r * 2.0, args=(batch,))
    np.testing.assert_array_equal(strategy.gather(per_replica, axis=0), 2 * x)
    np.testing.assert_allclose(
        strategy.reduce("sum", per_replica, axis=None),
        (2 * x).reshape(4, 2, 3).sum(0),
    )
    np.testing.assert_allclose(strategy.reduce("sum", batch, axis=0), x.sum(0))
    local = strategy.experimental_local_results(per_replica)
    np.testing.assert_array_equal(np.concatenate(local), 2 * x)
