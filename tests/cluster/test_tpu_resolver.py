"""TPUClusterResolver: no TPU here (ValueError, tf's fallback), fakes, pods."""

import warnings

import pytest

import keras_dist as kd
from keras_dist.cluster import _initialize, _tpu_devices, _tpu_resolver
from keras_dist.errors import TPUNotFoundError
from tests._tpu_fakes import fake_tpu_devices

V5E_8 = fake_tpu_devices(4, 2, 1, "TPU v5 lite")
V4_16 = fake_tpu_devices(2, 2, 2, "TPU v4", host=(2, 2, 1))


def test_no_tpu_is_a_value_error_naming_the_platform_and_the_fix():
    with pytest.raises(ValueError) as caught:
        kd.cluster.TPUClusterResolver()
    error = caught.value
    assert isinstance(error, TPUNotFoundError)
    assert isinstance(error, kd.errors.DeviceNotFoundError)
    message = str(error)
    assert message.startswith("No TPU is visible to JAX: it found platform 'cpu'")
    assert "Received: tpu=None." in message
    assert 'pip install "jax[tpu]>=0.10,<0.13"' in message
    assert "except ValueError:" in message
    assert "tensorflow-cpu" not in message  # tensorflow-cpu is what is installed.


def test_the_tf_tutorial_fallback_works_unchanged():
    try:
        resolver = kd.cluster.TPUClusterResolver()
        kd.tpu.initialize_tpu_system(resolver)
        strategy = kd.TPUStrategy(resolver)
    except ValueError:
        strategy = kd.MirroredStrategy()
    assert type(strategy) is kd.MirroredStrategy
    assert strategy.num_replicas_in_sync == 8


def test_the_kaggle_connect_fallback_works_unchanged():
    try:
        resolver = kd.cluster.TPUClusterResolver.connect()
        strategy = kd.TPUStrategy(resolver)
    except ValueError:
        strategy = kd.OneDeviceStrategy("cpu:0")
    assert type(strategy) is kd.OneDeviceStrategy


def test_full_tensorflow_in_the_process_is_named_with_the_fix(monkeypatch):
    import tensorflow  # noqa: F401  (tensorflow-cpu here: not a full TF)

    assert _tpu_devices.full_tensorflow() is None
    versions = {"tensorflow": "2.21.0"}

    def version(name):
        if name not in versions:
            raise _tpu_devices.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(_tpu_devices.importlib.metadata, "version", version)
    assert _tpu_devices.full_tensorflow() == "tensorflow 2.21.0"
    with pytest.raises(ValueError, match=r"tensorflow 2\.21\.0") as caught:
        kd.cluster.TPUClusterResolver()
    assert "pip install tensorflow-cpu" in str(caught.value)


def test_a_tpu_held_by_another_process_says_so(monkeypatch):
    def devices(backend=None):
        raise RuntimeError(
            "TPU initialization failed: The TPU is already in use by process "
            "with pid 1234. Not attempting to load libtpu.so in this process."
        )

    monkeypatch.setattr(_tpu_devices.jax, "devices", devices)
    with pytest.raises(ValueError, match="already in use by process") as caught:
        kd.cluster.TPUClusterResolver()
    assert "Only one process can hold a TPU" in str(caught.value)


def test_unused_arguments_warn_once_naming_them():
    with pytest.warns(UserWarning) as record:
        resolver = kd.cluster.TPUClusterResolver(
            "my-tpu", zone="us-central1-b", project="proj", devices=V5E_8
        )
    assert len(record) == 1
    message = str(record[0].message)
    assert "ignores tpu='my-tpu', zone='us-central1-b', project='proj':" in message
    assert "job_name" not in message and "credentials" not in message
    assert record[0].filename == __file__
    assert resolver.tpu == "my-tpu"

    with pytest.warns(UserWarning, match="grpc://10.0.0.2:8470") as record:
        kd.cluster.TPUClusterResolver(
            "grpc://10.0.0.2:8470", credentials=object(), devices=V5E_8
        )
    assert len(record) == 1 and "credentials=<object" in str(record[0].message)


@pytest.mark.parametrize("tpu", [None, "", "local"])
def test_the_local_tpu_and_tf_defaults_do_not_warn(tpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolver = kd.cluster.TPUClusterResolver(
            tpu, job_name="worker", credentials="default", devices=V5E_8
        )
    assert resolver.master() == "local"


def test_a_real_class_with_the_fake_devices():
    resolver = kd.cluster.TPUClusterResolver(devices=V4_16)
    assert isinstance(resolver, kd.cluster.TPUClusterResolver)
    assert resolver.devices == tuple(V4_16)
    assert resolver.num_hosts == 2
    resolver.join_cluster()  # Devices are known: nothing to join.
    assert repr(resolver) == (
        "TPUClusterResolver(tpu=None, num_hosts=2, num_devices=8)"
    )


def test_argument_errors():
    with pytest.raises(TypeError, match=r"`tpu` must be a string.*Received: tpu=3"):
        kd.cluster.TPUClusterResolver(3)
    with pytest.raises(ValueError, match=r"platforms \['cpu'\]"):
        kd.cluster.TPUClusterResolver(devices=[kd.MirroredStrategy().devices[0]])
    with pytest.raises(ValueError, match=r"platforms \[\]"):
        kd.cluster.TPUClusterResolver(devices=[])


def test_not_a_pod_here():
    assert _tpu_devices.cloud_tpu_hosts() is None


def test_a_pod_joins_before_reading_devices(monkeypatch):
    """On 4 TPU VM hosts the resolver counts them without starting the TPU,
    and `join_cluster` joins through `kd.cluster.initialize` first."""
    events = []
    monkeypatch.setattr(_initialize, "backend_started", lambda: False)
    monkeypatch.setattr(_tpu_resolver, "cloud_tpu_hosts", lambda: (4, 2))

    def visible(*, tpu):
        events.append("devices")
        return tuple(V4_16)

    def initialize(resolver, *, timeout):
        events.append(resolver)

    monkeypatch.setattr(_tpu_resolver, "visible_tpu_devices", visible)
    monkeypatch.setattr(_initialize, "initialize", initialize)

    resolver = kd.cluster.TPUClusterResolver()
    assert resolver.num_hosts == 4 and events == []
    with pytest.raises(RuntimeError, match=r"spans 4 hosts.*join_cluster"):
        _ = resolver.devices
    resolver.join_cluster()
    joined, read = events
    assert (joined.num_processes, joined.process_id, joined.source) == (4, 2, "jax")
    assert joined.coordinator_address is None  # JAX reads it from the TPU VM.
    assert read == "devices" and resolver.devices == tuple(V4_16)
    resolver.join_cluster()
    assert len(events) == 2  # Once.
