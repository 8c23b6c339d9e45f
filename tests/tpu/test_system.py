"""kd.tpu.initialize_tpu_system and Topology, on fake TPU systems."""

import dataclasses

import pytest

import keras_dist as kd
from tests._tpu_fakes import fake_tpu_devices


def _topology(devices) -> kd.tpu.Topology:
    resolver = kd.cluster.TPUClusterResolver(devices=devices)
    return kd.tpu.initialize_tpu_system(resolver)


def test_v5e_8():
    topology = _topology(fake_tpu_devices(4, 2, 1, "TPU v5 lite"))
    assert topology == kd.tpu.Topology(
        device_kind="TPU v5 lite",
        mesh_shape=(4, 2, 1, 1),
        num_tasks=1,
        num_tpus_per_task=8,
        num_slices=1,
        device_coordinates=(tuple((x, y, 0, 0) for y in range(2) for x in range(4)),),
    )
    assert (topology.num_chips, topology.cores_per_chip, topology.num_devices) == (
        8,
        1,
        8,
    )
    assert str(topology) == (
        "TPU v5 lite: 8 chips (4x2x1), 1 device per chip, 8 devices on 1 host"
    )
    assert repr(topology) == (
        "Topology(device_kind='TPU v5 lite', mesh_shape=(4, 2, 1, 1), "
        "num_tasks=1, num_tpus_per_task=8, num_slices=1)"
    )


def test_v3_8_has_two_cores_per_chip():
    topology = _topology(fake_tpu_devices(2, 2, 1, "TPU v3", cores_per_chip=2))
    assert topology.mesh_shape == (2, 2, 1, 2)
    assert (topology.num_chips, topology.cores_per_chip, topology.num_devices) == (
        4,
        2,
        8,
    )
    assert topology.device_coordinates[0][:3] == (
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (1, 0, 0, 0),
    )
    assert str(topology) == (
        "TPU v3: 4 chips (2x2x1), 2 devices per chip, 8 devices on 1 host"
    )


def test_v6e_1():
    topology = _topology(fake_tpu_devices(1, 1, 1, "TPU v6 lite"))
    assert (
        str(topology)
        == "TPU v6 lite: 1 chip (1x1x1), 1 device per chip, 1 device on 1 host"
    )


def test_v4_pod_slice_of_two_hosts():
    topology = _topology(fake_tpu_devices(2, 2, 2, "TPU v4", host=(2, 2, 1)))
    assert (topology.mesh_shape, topology.num_tasks, topology.num_tpus_per_task) == (
        (2, 2, 2, 1),
        2,
        4,
    )
    assert topology.device_coordinates[1] == (
        (0, 0, 1, 0),
        (1, 0, 1, 0),
        (0, 1, 1, 0),
        (1, 1, 1, 0),
    )
    assert (
        str(topology)
        == "TPU v4: 8 chips (2x2x2), 1 device per chip, 8 devices on 2 hosts"
    )


def test_two_slices():
    topology = _topology(fake_tpu_devices(4, 2, 1, "TPU v5 lite", num_slices=2))
    assert (topology.mesh_shape, topology.num_slices, topology.num_chips) == (
        (4, 2, 1, 1),
        2,
        16,
    )
    assert str(topology) == (
        "TPU v5 lite: 2 slices of 8 chips (4x2x1), 1 device per chip, "
        "16 devices on 2 hosts"
    )


def test_frozen_and_hashable():
    topology = _topology(fake_tpu_devices(2, 2, 1, "TPU v4"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        topology.num_tasks = 2
    assert hash(topology) == hash(_topology(fake_tpu_devices(2, 2, 1, "TPU v4")))


def test_no_tpu_and_bad_arguments():
    with pytest.raises(ValueError, match="No TPU is visible to JAX"):
        kd.tpu.initialize_tpu_system()
    with pytest.raises(TypeError, match="Received: str"):
        kd.tpu.initialize_tpu_system("local")
    with pytest.raises(ValueError, match=r"devices per host \{0: 4, 1: 2\}"):
        kd.tpu.Topology.from_devices(
            fake_tpu_devices(2, 2, 2, "TPU v4", host=(2, 2, 1))[:6]
        )
