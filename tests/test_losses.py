"""compute_average_loss and scale_regularization_loss: global-batch scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.data.host._pipeline import element
from tests._helpers import mirrored
from tests.conftest import REPLICA_COUNTS

LOSSES = np.linspace(0.5, 2.0, 16).astype("float32")


def test_global_context_is_the_plain_mean():
    np.testing.assert_allclose(kd.losses.compute_average_loss(LOSSES), LOSSES.mean())
    np.testing.assert_allclose(
        kd.losses.compute_average_loss(LOSSES, global_batch_size=32), LOSSES.sum() / 32
    )
    weights = np.linspace(0, 1, 16).astype("float32")
    np.testing.assert_allclose(
        kd.losses.compute_average_loss(LOSSES, sample_weight=weights),
        (LOSSES * weights).sum() / 16,
        rtol=1e-6,
    )
    assert float(kd.losses.scale_regularization_loss(3.0)) == 3.0


def test_extra_dimensions_are_averaged_per_example():
    per_pixel = np.arange(16 * 4 * 5, dtype="float32").reshape(16, 4, 5)
    np.testing.assert_allclose(
        kd.losses.compute_average_loss(per_pixel),
        per_pixel.mean(axis=(1, 2)).mean(),
        rtol=1e-6,
    )
    weights = np.arange(16, dtype="float32")
    expected = (per_pixel.mean(axis=(1, 2)) * weights).sum() / 16
    np.testing.assert_allclose(
        kd.losses.compute_average_loss(per_pixel, sample_weight=weights),
        expected,
        rtol=1e-6,
    )


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("rows", [16, 13])
def test_inside_run_the_gradient_equals_the_one_device_mean(n, rows):
    strategy = mirrored(n)
    rng = np.random.RandomState(0)
    x = rng.randn(rows, 3).astype("float32")
    w = jnp.asarray(rng.randn(3).astype("float32"))
    reg = 0.01

    def loss_fn(w, xb):
        per_example = (xb @ w) ** 2
        return kd.losses.compute_average_loss(per_example) + (
            kd.losses.scale_regularization_loss(reg * jnp.sum(w**2))
        )

    def replica_step(w, xb):
        return jax.value_and_grad(loss_fn)(w, xb)

    batch = element(strategy.placement, x)
    loss, grads = strategy.run(replica_step, args=(w, batch))
    total_loss = strategy.reduce("sum", loss, axis=None)
    expected_loss, expected_grads = jax.value_and_grad(
        lambda w: jnp.mean((x @ w) ** 2) + reg * jnp.sum(w**2)
    )(w)
    np.testing.assert_allclose(total_loss, expected_loss, rtol=1e-5)
    # Gradients of the replicated `w` come back summed over replicas: one array.
    assert isinstance(grads, jax.Array)
    np.testing.assert_allclose(grads, expected_grads, rtol=1e-5)


def test_explicit_global_batch_size_inside_run():
    strategy = mirrored(4)
    x = np.ones((13, 1), "float32")
    batch = element(strategy.placement, x)  # 13 real rows of 16.

    def fn(xb):
        return kd.losses.compute_average_loss(xb[:, 0], global_batch_size=32)

    total = strategy.reduce("sum", strategy.run(fn, args=(batch,)), axis=None)
    np.testing.assert_allclose(total, 13 / 32)  # Padding left out, divisor as given.


def test_bad_input():
    with pytest.raises(
        ValueError, match=r"received a scalar \(shape=\(\)\).*reduction=None"
    ):
        kd.losses.compute_average_loss(jnp.asarray(1.0))
    with pytest.raises(TypeError, match="dtype=int32"):
        kd.losses.compute_average_loss(np.ones(4, "int32"))
    with pytest.raises(ValueError, match="global_batch_size=0"):
        kd.losses.compute_average_loss(LOSSES, global_batch_size=0)
    with pytest.raises(ValueError, match="global_batch_size=-4"):
        kd.losses.compute_average_loss(LOSSES, global_batch_size=-4)
    with pytest.raises(TypeError, match=r"global_batch_size=2\.5"):
        kd.losses.compute_average_loss(LOSSES, global_batch_size=2.5)
    with pytest.raises(TypeError, match="regularization_loss"):
        kd.losses.scale_regularization_loss(np.int32(3))
    strategy = mirrored(4)
    batch = element(strategy.placement, np.ones((13, 2), "float32"))
    with pytest.raises(ValueError, match="one row per example"):
        strategy.run(lambda xb: kd.losses.compute_average_loss(xb.T), args=(batch,))
