"""Resolvers are `ClusterResolver` types; node lists and ports are read strictly."""

import dataclasses
import json

import pytest

import keras_dist as kd
from keras_dist.cluster._environment import first_host
from keras_dist.errors import ClusterConfigError

TF_CONFIG = json.dumps(
    {
        "cluster": {"worker": ["host1:12345", "host2:12345"]},
        "task": {"type": "worker", "index": 1},
    }
)


@pytest.fixture
def slurm(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "trn[07-08]")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("KERAS_DIST_PORT", raising=False)
    return monkeypatch


def _resolvers():
    return [
        kd.cluster.TFConfigClusterResolver(tf_config=TF_CONFIG),
        kd.cluster.SimpleClusterResolver("10.0.0.1:1234", 2, 1),
        kd.cluster.SlurmClusterResolver(),
    ]


def test_resolvers_are_cluster_resolver_types(slurm):
    for resolver in _resolvers():
        assert isinstance(resolver, kd.cluster.ClusterResolver)
        cls = type(resolver)
        assert isinstance(resolver, cls) and cls is not kd.cluster.ClusterResolver
        changed = dataclasses.replace(resolver, source="mine")
        assert type(changed) is cls and changed.source == "mine"
        assert dataclasses.astuple(changed)[:3] == dataclasses.astuple(resolver)[:3]
        assert dataclasses.replace(resolver) == resolver
        assert kd.cluster.resolve(resolver) is resolver


def test_tf_config_resolver_fields():
    r = kd.cluster.TFConfigClusterResolver(tf_config=TF_CONFIG)
    assert (r.coordinator_address, r.num_processes, r.process_id, r.source) == (
        "host1:12345",
        2,
        1,
        "TF_CONFIG",
    )
    assert r.cluster_spec == {"worker": ["host1:12345", "host2:12345"]}


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node[003-005,9],gpu1", "node003"),
        ("gpu-[1-2]-[3-4]", "gpu-1-3"),
        (" n1 ", "n1"),
        ("rack1-node[10-12]", "rack1-node10"),
    ],
)
def test_good_node_lists(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["node[1-3", "node1-3]", "node[3-1]", "[]", ","])
def test_bad_node_lists_are_refused(nodelist):
    with pytest.raises(ClusterConfigError, match="Cannot read the SLURM node list"):
        first_host(nodelist)


def test_bad_node_list_fails_in_the_resolver(slurm):
    slurm.setenv("SLURM_STEP_NODELIST", "node[1-3")
    with pytest.raises(ClusterConfigError, match=r"unbalanced.*'node\[1-3'"):
        kd.cluster.resolve()


@pytest.mark.parametrize("port", ["abc", "0", "70000", "-1", "12.5"])
def test_bad_keras_dist_port(slurm, port):
    slurm.setenv("KERAS_DIST_PORT", port)
    with pytest.raises(ClusterConfigError, match=f"KERAS_DIST_PORT={port!r}"):
        kd.cluster.SlurmClusterResolver()


def test_good_keras_dist_port(slurm):
    slurm.setenv("KERAS_DIST_PORT", "2222")
    assert kd.cluster.SlurmClusterResolver().coordinator_address == "trn07:2222"


def test_bad_slurm_ntasks_is_named(slurm):
    slurm.setenv("SLURM_NTASKS", "abc")
    with pytest.raises(ClusterConfigError, match="SLURM_NTASKS='abc'"):
        kd.cluster.resolve()
