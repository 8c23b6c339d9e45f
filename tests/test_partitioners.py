"""`kd.partitioners` give tf's numbers (tf's docstrings, and tf itself)."""

import pytest
import tensorflow as tf

import keras_dist as kd

P = kd.partitioners


@pytest.mark.parametrize(
    "partitioner, shape, expected",
    [
        # The examples of tf's docstrings (sharded_variable.py,
        # partitioned_variables.py).
        (P.FixedShardsPartitioner(num_shards=2), (10, 3), [2, 1]),
        (P.MinSizePartitioner(min_shard_bytes=4, max_shards=2), (6, 1), [2, 1]),
        (P.MinSizePartitioner(min_shard_bytes=4, max_shards=10), (6, 1), [6, 1]),
        (P.MinSizePartitioner(max_shards=16), (1024, 1024), [16, 1]),
        (P.MaxSizePartitioner(max_shard_bytes=4), (6, 1), [6, 1]),
        (P.MaxSizePartitioner(max_shard_bytes=4, max_shards=2), (6, 1), [2, 1]),
        (P.MaxSizePartitioner(max_shard_bytes=1024), (6, 1), [1, 1]),
    ],
)
def test_tf_documented_examples(partitioner, shape, expected):
    assert partitioner(shape, "float32") == expected


_SHAPES = [(10, 3), (3, 10), (7,), (1024, 1024), (100, 7, 3), (1, 5)]
_ARGS = [
    ("FixedShardsPartitioner", {"num_shards": 8}),
    ("FixedShardsPartitioner", {"num_shards": 1}),
    ("MinSizePartitioner", {}),
    ("MinSizePartitioner", {"min_shard_bytes": 12, "max_shards": 8}),
    ("MinSizePartitioner", {"min_shard_bytes": 100, "max_shards": 3}),
    ("MaxSizePartitioner", {"max_shard_bytes": 40}),
    ("MaxSizePartitioner", {"max_shard_bytes": 40, "max_shards": 4}),
    ("MaxSizePartitioner", {"max_shard_bytes": 1 << 20}),
]


@pytest.mark.parametrize("name, kwargs", _ARGS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "string"])
def test_same_numbers_as_tf(name, kwargs, dtype):
    ours = getattr(P, name)(**kwargs)
    theirs = getattr(tf.distribute.experimental.partitioners, name)(**kwargs)
    for shape in _SHAPES:
        expected = theirs(tf.TensorShape(shape), tf.as_dtype(dtype))
        assert ours(shape, dtype) == list(expected), shape


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: P.FixedShardsPartitioner(0), "num_shards=0"),
        (lambda: P.FixedShardsPartitioner(2.5), "num_shards=2.5"),
        (lambda: P.MinSizePartitioner(min_shard_bytes=-1), "min_shard_bytes=-1"),
        (lambda: P.MinSizePartitioner(max_shards=0), "max_shards=0"),
        (lambda: P.MinSizePartitioner(bytes_per_string=0), "bytes_per_string=0"),
        (lambda: P.MaxSizePartitioner(max_shard_bytes=-5), "max_shard_bytes=-5"),
        (lambda: P.MaxSizePartitioner(4, max_shards=0), "max_shards=0"),
    ],
)
def test_bad_arguments_name_the_argument_and_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_axis_out_of_range_and_unknown_dims():
    with pytest.raises(ValueError, match="axis 2"):
        P.FixedShardsPartitioner(2)((4, 4), "float32", axis=2)
    with pytest.raises(ValueError, match="fully defined"):
        P.FixedShardsPartitioner(2)((None, 4), "float32")


def test_repr_shows_the_arguments():
    assert repr(P.MaxSizePartitioner(64, max_shards=2)) == (
        "MaxSizePartitioner(max_shard_bytes=64, max_shards=2, bytes_per_string=16)"
    )
