"""MultiWorkerMirroredStrategy in one process, its options, and its bad input."""

import json

import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from keras_dist.data._partial_batch import real_mask, real_rows_in, take_real
from keras_dist.data.host import _auto_shard
from tests._helpers import (
    assert_weights_close,
    build_in_scope,
    initial_weights,
    make_data,
)

CLUSTER_VARS = ("TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS", "KERAS_DIST_COORDINATOR")


@pytest.fixture
def no_cluster(monkeypatch):
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)


def test_one_process_is_mirrored_over_every_local_device(no_cluster):
    strategy = kd.MultiWorkerMirroredStrategy()
    assert strategy.num_processes == 1
    assert strategy.process_id == 0
    assert strategy.is_chief
    assert strategy.num_replicas_in_sync == 8
    assert strategy.cluster_resolver.source == "single process"
    assert repr(strategy) == (
        "MultiWorkerMirroredStrategy(num_processes=1, process_id=0, "
        "num_replicas_in_sync=8)"
    )
    x, y, sw = make_data(45)
    weights = initial_weights()
    results = []
    for s in (strategy, kd.OneDeviceStrategy("cpu:0")):
        model = build_in_scope(s, weights)
        model.fit(x, y, sample_weight=sw, batch_size=16, epochs=2, shuffle=False)
        results.append(model.get_weights())
    assert_weights_close(results[1], results[0])


def test_parameter_servers_are_refused_with_the_fix(no_cluster, monkeypatch):
    config = {
        "cluster": {"worker": ["localhost:1"], "ps": ["localhost:2"]},
        "task": {"type": "worker", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.raises(kd.errors.ClusterConfigError) as error:
        kd.MultiWorkerMirroredStrategy()
    message = str(error.value)
    assert "`ps` (parameter server) tasks" in message
    assert "\"ps\": ['localhost:2']" in message
    assert 'remove the "ps" entries from TF_CONFIG' in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_seconds": 0}, "Received: timeout_seconds=0"),
        ({"timeout_seconds": "60"}, "Received: timeout_seconds='60'"),
        ({"implementation": "nccl"}, "Received: implementation='nccl'"),
    ],
)
def test_communication_options_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kd.CommunicationOptions(**kwargs)


def test_communication_options_must_be_ours(no_cluster):
    with pytest.raises(TypeError, match=r"must be a `kd\.CommunicationOptions`"):
        kd.MultiWorkerMirroredStrategy(communication_options={"timeout": 1})


def test_auto_shard_policy_is_read_from_the_dataset_options():
    dataset = tf.data.Dataset.range(8).batch(4)
    assert _auto_shard.auto_shard_policy(dataset) is kd.data.AutoShardPolicy.AUTO
    for policy in ("FILE", kd.data.AutoShardPolicy.DATA, "off"):
        shaped = kd.data.with_auto_shard_policy(dataset, policy)
        expected = kd.data.AutoShardPolicy[str(getattr(policy, "name", policy)).upper()]
        assert _auto_shard.auto_shard_policy(shaped) is expected
    with pytest.raises(ValueError, match="Received: policy='SOMETIMES'"):
        kd.data.with_auto_shard_policy(dataset, "SOMETIMES")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.HINT
    )
    with pytest.raises(ValueError, match=r"HINT needs tf\.distribute.s sharding hints"):
        _auto_shard.auto_shard_policy(dataset.with_options(options))


def test_one_process_keeps_the_dataset_whole(no_cluster):
    dataset = kd.data.with_auto_shard_policy(tf.data.Dataset.range(8).batch(4), "FILE")
    strategy = kd.MirroredStrategy()
    assert _auto_shard.per_process_share(strategy, dataset) is dataset


def test_per_process_share_rebatches_and_needs_a_divisible_batch():
    dataset = tf.data.Dataset.range(10).batch(4)
    share = _auto_shard.shard_per_process(dataset, kd.data.AutoShardPolicy.OFF, 2, 1)
    assert [b.tolist() for b in share.as_numpy_iterator()] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
    ]
    with pytest.raises(ValueError, match="Received: batch size 3"):
        _auto_shard.shard_per_process(
            tf.data.Dataset.range(10).batch(3), kd.data.AutoShardPolicy.OFF, 2, 0
        )


def test_real_row_segments():
    rows = np.arange(16)
    # Process blocks of 8 rows: 5 real in the first, 2 in the second.
    segments = ((0, 5), (8, 2))
    assert take_real(rows, segments).tolist() == [0, 1, 2, 3, 4, 8, 9]
    assert take_real(rows, 3).tolist() == [0, 1, 2]
    assert real_mask(rows, segments).sum() == 7
    # Replicas of 4 rows: 4, 1, 2, 0 real rows.
    assert [real_rows_in(segments, 4 * i, 4 * i + 4) for i in range(4)] == [4, 1, 2, 0]
