"""Device strings as tf.distribute users type them."""

import jax
import pytest

import keras_dist as kd
from keras_dist.errors import DeviceNotFoundError
from keras_dist.strategies.devices._devices import resolve_device, resolve_devices

CPU = jax.local_devices(backend="cpu")


@pytest.mark.parametrize(
    "spec, index",
    [
        ("cpu:0", 0),
        ("cpu:3", 3),
        ("/cpu:5", 5),
        ("/CPU:7", 7),
        ("CPU:1", 1),
        ("/device:CPU:2", 2),
        ("device:CPU:4", 4),
        ("/job:localhost/replica:0/task:0/device:CPU:6", 6),
        ("/job:worker/replica:0/task:0/device:cpu:1", 1),
    ],
)
def test_device_string_forms(spec, index):
    assert resolve_device(spec) is CPU[index]


def test_jax_device_object_is_accepted():
    assert resolve_device(CPU[2]) is CPU[2]
    assert kd.MirroredStrategy([CPU[1], "cpu:0"]).devices == (CPU[1], CPU[0])


def test_none_means_every_local_device():
    assert kd.MirroredStrategy().devices == tuple(jax.local_devices())
    assert kd.MirroredStrategy().num_replicas_in_sync == 8


def test_index_out_of_range_lists_visible_devices():
    with pytest.raises(DeviceNotFoundError) as info:
        kd.MirroredStrategy(["cpu:0", "cpu:8"])
    message = str(info.value)
    assert "'cpu:8'" in message and "devices=" in message
    assert "cpu:7" in message and "Visible devices" in message


def test_missing_platform_lists_visible_devices():
    with pytest.raises(DeviceNotFoundError, match=r"Received: device='/gpu:0'.*cpu:0"):
        kd.OneDeviceStrategy("/gpu:0")


@pytest.mark.parametrize("spec", ["gpu", "cpu0", "cpu:-1", "/job:x/device:XPU:0", ""])
def test_unknown_device_string(spec):
    with pytest.raises(ValueError, match="not a device spec") as info:
        kd.OneDeviceStrategy(spec)
    assert f"Received: device={spec!r}" in str(info.value)
    assert '"/gpu:0"' in str(info.value)


def test_wrong_type():
    with pytest.raises(TypeError, match=r"Received: device=3 of type int"):
        kd.OneDeviceStrategy(3)


def test_single_string_instead_of_list():
    with pytest.raises(TypeError, match=r"Wrap it in a list: devices=\['cpu:0'\]"):
        kd.MirroredStrategy("cpu:0")


def test_empty_device_list():
    with pytest.raises(ValueError, match=r"Received: devices=\[\]"):
        kd.MirroredStrategy([])


def test_duplicate_devices():
    with pytest.raises(ValueError, match=r"'cpu:1' and '/CPU:1' are both"):
        kd.MirroredStrategy(["cpu:1", "/CPU:1"])


def test_resolve_devices_keeps_order():
    assert resolve_devices(["cpu:3", "cpu:0"]) == (CPU[3], CPU[0])
