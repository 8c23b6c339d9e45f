"""TPUStrategy: device order by TPU topology, and training through it on CPU.

No TPU here: the order is tested on fake TPU devices (`tests/_tpu_fakes.py`,
JAX's own mock devices with a host parameter) against orders hand-checked in
JAX's tests (jax-ml/jax tests/mesh_utils_test.py), and the strategy is built
through its normal path with fake v5e-8 devices whose order is applied to the
8 virtual CPU devices, then trained against one device.
"""

import random
import types
import warnings

import jax
import keras
import numpy as np
import pytest
from jax.experimental import mesh_utils

import keras_dist as kd
from keras_dist.tpu import _strategy as _tpu
from keras_dist.tpu._mesh import tpu_device_order
from keras_dist.tpu._strategy import check_global_batch
from tests._docs import ROOT, as_installed, python_blocks, run
from tests._helpers import (
    assert_history_close,
    assert_weights_close,
    build_in_scope,
    initial_weights,
    make_data,
    mirrored,
)
from tests._tpu_fakes import fake_tpu_devices, ids

CPU = jax.local_devices(backend="cpu")

V2_8 = fake_tpu_devices(2, 2, 1, "TPU v2", cores_per_chip=2)
V3_8 = fake_tpu_devices(2, 2, 1, "TPU v3", cores_per_chip=2)
V4_8 = fake_tpu_devices(2, 2, 1, "TPU v4")  # 2x2x1, megacore: 1 device/chip
V5P_8 = fake_tpu_devices(2, 2, 1, "TPU v5p")
V5E_1 = fake_tpu_devices(1, 1, 1, "TPU v5 lite")  # Colab v5e-1
V5E_4 = fake_tpu_devices(2, 2, 1, "TPU v5 lite")
V5E_8 = fake_tpu_devices(4, 2, 1, "TPU v5 lite")  # Kaggle v5e-8: 4x2 on 1 host
V6E_1 = fake_tpu_devices(1, 1, 1, "TPU v6 lite")  # Colab v6e-1
V6E_8 = fake_tpu_devices(4, 2, 1, "TPU v6 lite")
TWO_V5E_8_SLICES = fake_tpu_devices(4, 2, 1, "TPU v5 lite", num_slices=2)
V4_16 = fake_tpu_devices(2, 2, 2, "TPU v4", host=(2, 2, 1))  # 2 hosts
V3_32 = fake_tpu_devices(4, 4, 1, "TPU v3", cores_per_chip=2, host=(2, 2, 1))
V4_32_TWO_SLICES = fake_tpu_devices(2, 2, 4, "TPU v4", host=(2, 2, 1), num_slices=2)

# Orders checked by hand against JAX's tests/mesh_utils_test.py.
HAND_CHECKED = [
    # test_v3_create_device_mesh '2x2_1d' (mock_2x2_devices, v3-8): the
    # physical ring over the tray, _TRAY_RING_ORDER. JAX's handler serves
    # "TPU v2" and "TPU v3" alike.
    ("v2-8", V2_8, [0, 1, 2, 3, 6, 7, 4, 5]),
    ("v3-8", V3_8, [0, 1, 2, 3, 6, 7, 4, 5]),
    # test_create_device_mesh_for_nd_torus '2x2x1': a 4-device axis takes the
    # physical axes (0, 1, 2), x major: chips (0,0) (0,1) (1,0) (1,1), ids
    # x + 2y. v5p has no handler for 2x2x1 and follows the same rule.
    ("v4 2x2x1", V4_8, [0, 2, 1, 3]),
    ("v5p 2x2x1", V5P_8, [0, 2, 1, 3]),
    ("v5e-1", V5E_1, [0]),
    ("v6e-1", V6E_1, [0]),
    # _v5e_create_device_mesh's 2x2 ring, _TRAY_2x2_RING_ORDER.
    ("v5e-4", V5E_4, [0, 1, 3, 2]),
    # test_v5e_create_device_mesh '4x2_1d': ring order over the tray; "TPU v6
    # lite" uses the same handler.
    ("v5e-8", V5E_8, [0, 1, 2, 3, 7, 6, 5, 4]),
    ("v6e-8", V6E_8, [0, 1, 2, 3, 7, 6, 5, 4]),
    # Two slices: slice 0 then slice 1, each in its ring order.
    ("2 x v5e-8", TWO_V5E_8_SLICES,
     [0, 1, 2, 3, 7, 6, 5, 4, 8, 9, 10, 11, 15, 14, 13, 12]),
    # test_v3_create_device_mesh '4x4_2d' (mock_4x4_devices, v3-32, 4 hosts):
    # JAX's [4, 8] mesh has one host's ring per row; host after host it is
    # our 1-D order.
    ("v3-32", V3_32,
     [0, 1, 2, 3, 10, 11, 8, 9, 4, 5, 6, 7, 14, 15, 12, 13,
      16, 17, 18, 19, 26, 27, 24, 25, 20, 21, 22, 23, 30, 31, 28, 29]),
]  # fmt: skip


@pytest.mark.parametrize(
    "devices, expected", [c[1:] for c in HAND_CHECKED], ids=[c[0] for c in HAND_CHECKED]
)
def test_order_matches_jax_tests(devices, expected):
    assert ids(tpu_device_order(devices)) == expected


SINGLE_HOST = {
    "v2-8": V2_8,
    "v3-8": V3_8,
    "v4-8": V4_8,
    "v5p-8": V5P_8,
    "v5e-1": V5E_1,
    "v5e-4": V5E_4,
    "v5e-8": V5E_8,
    "v6e-1": V6E_1,
    "v6e-8": V6E_8,
}


@pytest.mark.parametrize("devices", SINGLE_HOST.values(), ids=SINGLE_HOST.keys())
def test_one_host_is_jax_create_device_mesh(devices):
    expected = mesh_utils.create_device_mesh((len(devices),), devices)
    assert tpu_device_order(devices) == list(expected.flat)


def test_slices_are_jax_create_hybrid_device_mesh():
    devices = TWO_V5E_8_SLICES
    expected = mesh_utils.create_hybrid_device_mesh((8,), (2,), devices)
    assert tpu_device_order(devices) == list(expected.flat)
    order = tpu_device_order(devices)
    assert [d.slice_index for d in order] == [0] * 8 + [1] * 8


@pytest.mark.parametrize(
    "devices", [V4_16, V3_32, V4_32_TWO_SLICES], ids=["v4-16", "v3-32", "2 x v4-32"]
)
def test_each_host_is_one_block_in_topology_order(devices):
    order = tpu_device_order(devices)
    processes = [d.process_index for d in order]
    per_host = len(devices) // (max(processes) + 1)
    assert processes == sorted(processes)  # Contiguous, host after host.
    for start in range(0, len(order), per_host):
        host = order[start : start + per_host]
        in_id_order = sorted(host, key=lambda d: d.id)  # As `jax.devices()` lists.
        expected = mesh_utils.create_device_mesh((per_host,), in_id_order)
        assert host == list(expected.flat)


def test_why_hosts_are_granules():
    """JAX's 1-D mesh over a whole v4 pod slice interleaves the two hosts,
    which the input pipeline's per-process row blocks cannot follow."""
    whole = mesh_utils.create_device_mesh((8,), V4_16)
    assert [d.process_index for d in whole.flat] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert ids(tpu_device_order(V4_16)) == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize(
    "devices", [V3_8, V5E_8, V3_32], ids=["v3-8", "v5e-8", "v3-32"]
)
def test_input_order_does_not_matter(devices):
    shuffled = list(devices)
    random.Random(0).shuffle(shuffled)
    assert tpu_device_order(shuffled) == tpu_device_order(devices)
    assert tpu_device_order(devices[::-1]) == tpu_device_order(devices)


def test_incomplete_slice_falls_back_to_id_order_with_a_warning():
    with pytest.warns(RuntimeWarning, match="could not order the 3 TPU v4 devices"):
        order = tpu_device_order(V4_8[:3])
    assert ids(order) == [0, 1, 2]


@pytest.mark.parametrize(
    "devices, message",
    [
        ([], "at least one TPU device"),
        (CPU[:2], r"must all be TPU devices. Received: platforms \['cpu'\]"),
        ([*V5E_1, V4_8[1]], r"mix TPU generations \['TPU v4', 'TPU v5 lite'\]"),
        (V4_16[:6], r"same number of devices. Received: devices per host \{0: 4, 1: 2"),
    ],
)
def test_bad_device_lists(devices, message):
    with pytest.raises(ValueError, match=message):
        tpu_device_order(devices)


# The strategy -----------------------------------------------------------------


def _fake_v5e_8_strategy(monkeypatch) -> kd.TPUStrategy:
    """A TPUStrategy built through its path for a v5e-8, on the 8 CPU devices.

    The resolver holds fake v5e-8 devices and the strategy orders them as on
    the TPU; the only stand-in is the last step, fake device -> runtime
    device (CPU device with the same id).
    """
    monkeypatch.setattr(_tpu, "_as_jax_devices", lambda ds: [CPU[d.id] for d in ds])
    resolver = kd.cluster.TPUClusterResolver(devices=V5E_8)
    return kd.TPUStrategy(resolver)


def test_strategy_uses_the_topology_order(monkeypatch):
    strategy = _fake_v5e_8_strategy(monkeypatch)
    assert strategy.devices == tuple(CPU[i] for i in [0, 1, 2, 3, 7, 6, 5, 4])
    assert strategy.num_replicas_in_sync == 8
    assert strategy.mesh.axis_names == ("batch",)
    assert isinstance(strategy, kd.Strategy)
    assert isinstance(strategy, keras.distribution.DataParallel)
    assert strategy.cluster_resolver.devices == tuple(V5E_8)
    assert repr(strategy).startswith("TPUStrategy(devices=[cpu:0, cpu:1, ..., cpu:4]")


def test_fit_evaluate_predict_equal_one_device(monkeypatch):
    x, y, sw = make_data(37, seed=0)  # 37 rows, batch 10: a last batch of 7.
    xt, yt, _ = make_data(37, seed=1)
    weights = initial_weights()
    results = []
    for strategy in (kd.OneDeviceStrategy("cpu:0"), _fake_v5e_8_strategy(monkeypatch)):
        model = build_in_scope(strategy, weights)
        history = model.fit(
            x, y, sample_weight=sw, batch_size=10, epochs=3, shuffle=False, verbose=0
        )
        evaluated = model.evaluate(xt, yt, batch_size=10, verbose=0)
        predicted = model.predict(xt, batch_size=10, verbose=0)
        results.append((history.history, model.get_weights(), evaluated, predicted))
    (ref_h, ref_w, ref_e, ref_p), (h, w, e, p) = results
    assert_history_close(ref_h, h)
    assert_weights_close(ref_w, w)
    np.testing.assert_allclose(e, ref_e, rtol=1e-5, atol=1e-6)
    assert p.shape == (37, 3)
    np.testing.assert_allclose(p, ref_p, rtol=1e-5, atol=1e-6)
    assert max(np.abs(a - b).max() for a, b in zip(weights, w, strict=True)) > 1e-3


def test_run_and_reduce_follow_the_mesh_order(monkeypatch):
    strategy = _fake_v5e_8_strategy(monkeypatch)
    x = np.arange(13 * 2, dtype="float32").reshape(13, 2)  # 13 rows: padded to 16.
    (batch,) = list(strategy.experimental_distribute_dataset([x]))

    def step(rows):
        replica = kd.get_replica_context().replica_id_in_sync_group
        return rows * 2.0, jax.numpy.full((1,), replica)

    doubled, replica_ids = strategy.run(step, args=(batch,))
    np.testing.assert_array_equal(strategy.gather(doubled, axis=0), x * 2.0)
    np.testing.assert_allclose(strategy.reduce("sum", doubled, axis=0), x.sum(0) * 2)
    local = strategy.experimental_local_results(replica_ids)
    assert [int(v[0]) for v in local] == list(range(8))
    assert [next(iter(v.devices())) for v in local] == list(strategy.devices)


def test_without_a_tpu_the_error_names_the_platform_and_the_fix():
    with pytest.raises(ValueError) as caught:
        kd.TPUStrategy()
    message = str(caught.value)
    assert isinstance(caught.value, kd.errors.TPUNotFoundError)
    assert "platform 'cpu' (8 devices)" in message
    assert 'pip install "jax[tpu]>=0.10,<0.13"' in message
    assert "except ValueError:\n        strategy = kd.MirroredStrategy()" in message


def test_strategy_argument_errors(monkeypatch):
    with pytest.raises(ValueError, match="experimental_device_assignment` is not sup"):
        kd.TPUStrategy(experimental_device_assignment=[0, 1])
    with pytest.raises(TypeError, match="Received: SimpleNamespace"):
        kd.TPUStrategy(types.SimpleNamespace())
    resolver = kd.cluster.TPUClusterResolver(devices=V5E_8)
    with pytest.raises(TypeError, match=r"needs `jax.Device`s.*FakeTpuDevice"):
        kd.TPUStrategy(resolver)  # Fake devices describe a TPU; they cannot run.


def test_check_global_batch(monkeypatch):
    strategy = _fake_v5e_8_strategy(monkeypatch)
    with pytest.warns(UserWarning) as record:
        check_global_batch(strategy, 100)
        check_global_batch(strategy, 5)
    assert len(record) == 2
    assert "not a multiple of the 8 TPU cores" in str(record[0].message)
    assert "padded to 104 rows, so 4 rows" in str(record[0].message)
    assert "Received: batch_size=100. Use batch_size=96 or 104" in str(
        record[0].message
    )
    assert "Use batch_size=8," in str(record[1].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_global_batch(strategy, 128)  # A multiple: silent.
        check_global_batch(mirrored(8), 100)  # Other strategies pad cheaply.


def test_tpu_guide_example_falls_back_without_a_tpu():
    """The TPU guide's snippet runs here unchanged: MirroredStrategy on CPU."""
    guide = ROOT / "docs" / "guides" / "tpu.md"
    blocks = [b for b in python_blocks(guide) if "TPUStrategy" in b]
    assert blocks, "the TPU guide has no TPUStrategy example"
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = run(["-c", blocks[0]], env_extra={**flags, **as_installed(guide)})
    assert out.splitlines()[0] == "MirroredStrategy 8"
    assert "Epoch 2/2" in out


def test_fit_with_a_batch_that_does_not_fill_the_cores_warns(monkeypatch):
    strategy = _fake_v5e_8_strategy(monkeypatch)
    x, y, _ = make_data(20)
    model = build_in_scope(strategy, initial_weights())
    with pytest.warns(UserWarning, match="Use batch_size=8 or 16"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.evaluate(x, y, batch_size=16, verbose=0)


@pytest.mark.parametrize("model_parallel", [2, 4])
def test_a_2d_order_is_jax_create_device_mesh_row_by_row(model_parallel):
    # JAX lays the model axis of a (n / k, k) mesh along the fastest links.
    expected = mesh_utils.create_device_mesh(
        (8 // model_parallel, model_parallel), V5E_8
    )
    assert tpu_device_order(V5E_8, model_parallel) == list(expected.flat)
    order = tpu_device_order(V4_16, model_parallel)  # 2 hosts: rows stay in one.
    rows = np.array(order, dtype=object).reshape(-1, model_parallel)
    assert all(len({d.process_index for d in row}) == 1 for row in rows)


def test_model_parallel_on_a_tpu_trains_as_one_device(monkeypatch):
    monkeypatch.setattr(_tpu, "_as_jax_devices", lambda ds: [CPU[d.id] for d in ds])
    resolver = kd.cluster.TPUClusterResolver(devices=V5E_8)
    strategy = kd.TPUStrategy(resolver, model_parallel=2)
    expected = mesh_utils.create_device_mesh((4, 2), V5E_8)
    assert strategy.devices == tuple(CPU[d.id] for d in expected.flat)
    assert dict(strategy.mesh.shape) == {"batch": 4, "model": 2}
    assert strategy.num_replicas_in_sync == 4
    x, y, sw = make_data(37, seed=0)
    weights = initial_weights()
    results = []
    for s in (kd.OneDeviceStrategy("cpu:0"), strategy):
        model = build_in_scope(s, weights)
        history = model.fit(
            x, y, sample_weight=sw, batch_size=10, epochs=2, shuffle=False, verbose=0
        )
        results.append((history.history, model.get_weights()))
    assert_history_close(results[0][0], results[1][0])
    assert_weights_close(results[0][1], results[1][1])
