"""The seeds' custom training loop: N devices give the numbers of one device."""

import functools

import jax
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from tests._helpers import mirrored
from tests.conftest import REPLICA_COUNTS

N_TRAIN, N_TEST, GLOBAL_BATCH = 101, 29, 16  # 101 = 6 * 16 + 5: a partial batch.


def _data(n, seed):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, 6).astype("float32")
    return x, (x @ rng.randn(6, 3)).argmax(1).astype("int32")


@functools.cache
def _train(n_devices: int, optimizer_name: str, from_function: bool):
    strategy = kd.OneDeviceStrategy("cpu:0") if n_devices == 1 else mirrored(n_devices)
    x, y = _data(N_TRAIN, 0)
    if from_function:

        def dataset_fn(ctx):
            per_replica = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(per_replica)

        train_dist = strategy.distribute_datasets_from_function(dataset_fn)
    else:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        train_dist = strategy.experimental_distribute_dataset(dataset)

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(1e-3)),
            ]
        )
        optimizer = (
            keras.optimizers.SGD(0.1, momentum=0.9)
            if optimizer_name == "sgd"
            else keras.optimizers.Adam(1e-3)
        )
        optimizer.build(model.trainable_variables)
        loss_object = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=None
        )
        accuracy = keras.metrics.SparseCategoricalAccuracy()

    def train_step(state, images, labels):
        trainable, non_trainable, opt_vars = state

        def loss_fn(trainable):
            logits, non_trainable_new, losses = model.stateless_call(
                trainable, non_trainable, images, training=True, return_losses=True
            )
            loss = kd.losses.compute_average_loss(loss_object(labels, logits))
            loss += kd.losses.scale_regularization_loss(sum(losses))
            return loss, (logits, non_trainable_new)

        (loss, (logits, non_trainable)), grads = jax.value_and_grad(
            loss_fn, has_aux=True
        )(trainable)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return loss, logits, (trainable, non_trainable, opt_vars)

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    epoch_losses, epoch_accuracy = [], []
    for _ in range(3):
        total, batches = 0.0, 0
        accuracy.reset_state()
        for images, labels in train_dist:
            loss, logits, state = strategy.run(train_step, args=(state, images, labels))
            total += strategy.reduce("sum", loss, axis=None)
            batches += 1
            accuracy.update_state(
                strategy.gather(labels, axis=0), strategy.gather(logits, axis=0)
            )
        epoch_losses.append(float(total / batches))
        epoch_accuracy.append(float(accuracy.result()))
    return epoch_losses, epoch_accuracy, [np.asarray(w) for w in state[0]], state


@pytest.mark.parametrize("n", REPLICA_COUNTS)
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_custom_loop_matches_one_device(n, optimizer_name):
    ref_loss, ref_acc, ref_w, _ = _train(1, optimizer_name, False)
    loss, acc, weights, state = _train(n, optimizer_name, False)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(acc, ref_acc, rtol=1e-6)
    for a, b in zip(ref_w, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # The updated state stays one replicated array per variable.
    for leaf in jax.tree.leaves(state):
        assert isinstance(leaf, jax.Array) and leaf.sharding.is_fully_replicated


@pytest.mark.parametrize("n", [4, 8])
def test_datasets_from_function_match_one_device(n):
    ref_loss, _, ref_w, _ = _train(1, "sgd", True)
    loss, _, weights, _ = _train(n, "sgd", True)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(ref_w, weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_training_moves_the_loss():
    losses, acc, _, _ = _train(1, "sgd", False)
    assert losses[-1] < losses[0] - 0.1
    assert acc[-1] > 0.5
