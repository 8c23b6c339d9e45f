"""Loss scaling in a custom loop: an overflow on one replica skips the step on all.

mixed_float16, a LossScaleOptimizer and `strategy.run` on 8 replicas
(Mirrored, ParameterServer, FSDP, ZeRO-1, CentralStorage). Three
global batches of 16 rows (2 per replica): finite, then one whose rows on
replica 3 only are inf, then finite. The step on the second batch must be
skipped on every replica (weights unchanged everywhere, the scale halved
once, its counter reset) and the run must equal one device's on the same
batches (float16: rtol 1e-3, atol 1e-4), whether the optimizer gets the
gradients of the replicated weights (already summed over the replicas by
JAX) or each replica's own gradients summed with `all_reduce` (as in
tf.distribute); unsummed per-replica gradients are refused with the fix.
`kd.get_replica_context().all_finite` gives the one decision to any loop.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from tests.strategies._mixed_precision import (
    DISTRIBUTED,
    STRATEGIES,
    float32_policy_after,  # noqa: F401 (autouse fixture)
)

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _batches():
    rng = np.random.RandomState(0)
    x = rng.randn(48, 6).astype("float32")
    y = rng.randint(0, 3, 48).astype("int32")
    x[16 + 6 : 16 + 8] = np.inf  # Batch 2, rows 6-7: replica 3 of 8.
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def _build(strategy):
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    try:
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((6,)),
                    keras.layers.Dense(16, activation="relu"),
                    keras.layers.Dense(3),
                ]
            )
            optimizer = keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.1), initial_scale=2.0**10
            )
            optimizer.build(model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, optimizer


def _train_step(model, optimizer, gradients):
    """`gradients`: "summed" (of the replicated weights: JAX sums them over the
    replicas), "all_reduced" (each replica's own, then `all_reduce`, as in
    tf.distribute) or "per_replica" (each replica's own, not reduced)."""

    def train_step(state, x, y):
        trainable, non_trainable, opt_vars = state
        weights = trainable
        if gradients != "summed":  # Each replica differentiates its own copy.
            weights = jax.lax.pcast(trainable, "batch", to="varying")

        def loss_fn(trainable):
            logits, non_trainable_new = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            loss = kd.losses.compute_average_loss(LOSS(y, logits))
            mapping = list(zip(optimizer.variables, opt_vars, strict=True))
            with keras.StatelessScope(state_mapping=mapping):
                scaled = optimizer.scale_loss(loss)  # loss * the current scale
            return scaled, (loss, non_trainable_new)

        (_, (loss, non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            weights
        )
        if gradients == "all_reduced":
            grads = kd.get_replica_context().all_reduce("sum", grads)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return loss, (trainable, non_trainable, opt_vars)

    return train_step


def _train(name, gradients, dataset=None):
    strategy = STRATEGIES[name]()
    model, optimizer = _build(strategy)
    step = _train_step(model, optimizer, gradients)
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    scale = next(
        i for i, v in enumerate(optimizer.variables) if v is optimizer.dynamic_scale
    )
    counter = next(
        i for i, v in enumerate(optimizer.variables) if v is optimizer.step_counter
    )
    states = []
    dataset = _batches() if dataset is None else dataset
    for x, y in strategy.experimental_distribute_dataset(dataset):
        _, state = strategy.run(step, args=(state, x, y))
        weights, opt_vars = state[0], state[2]
        if name != "one_device":  # Every replica holds the same state.
            weights = [_same_on_every_replica(w) for w in weights]
            opt_vars = [_same_on_every_replica(v) for v in opt_vars]
        states.append(
            (
                [np.asarray(w) for w in weights],
                float(np.asarray(opt_vars[scale])),
                int(np.asarray(opt_vars[counter])),
            )
        )
    return states


def _same_on_every_replica(value):
    if isinstance(value, kd.PerReplica):
        first, *others = value.values
        for other in others:
            np.testing.assert_array_equal(np.asarray(other), np.asarray(first))
        return first
    for shard in value.addressable_shards[1:]:
        np.testing.assert_array_equal(
            np.asarray(shard.data), np.asarray(value.addressable_shards[0].data)
        )
    return value


@pytest.mark.parametrize(
    "name, gradients",
    [(name, "summed") for name in DISTRIBUTED] + [("mirrored", "all_reduced")],
)
def test_an_overflow_on_one_replica_skips_the_step_on_all(name, gradients):
    one = _train("one_device", gradients)
    eight = _train(name, gradients)
    for states in (one, eight):
        (w1, s1, c1), (w2, s2, c2), (w3, s3, c3) = states
        assert (s1, c1) == (2.0**10, 1)  # Finite: applied.
        assert (s2, c2) == (2.0**9, 0)  # Overflow: halved once, skipped...
        for a, b in zip(w1, w2, strict=True):
            np.testing.assert_array_equal(b, a)  # ... weights unchanged.
        assert (s3, c3) == (2.0**9, 1)
        assert not np.array_equal(w3[0], w2[0])
    for (w, s, c), (w_1, s_1, c_1) in zip(eight, one, strict=True):
        assert (s, c) == (s_1, c_1)
        for a, b in zip(w, w_1, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_gradients_that_differ_by_replica_are_refused_with_the_fix():
    """Not summed, each replica would decide alone whether to skip."""
    message = (
        r"differ by replica.*Received: grads\[0\] of shape \(6, 16\).*"
        r'all_reduce\("sum", grads\)'
    )
    with pytest.raises(ValueError, match=message):
        _train("mirrored", "per_replica", _batches().take(1))


def test_all_finite_is_one_decision_for_all_replicas():
    strategy = STRATEGIES["mirrored"]()
    (x, _), (bad, _), _ = list(strategy.experimental_distribute_dataset(_batches()))

    def check(x):
        ctx = kd.get_replica_context()
        local = jnp.all(jnp.isfinite(x))
        return local, ctx.all_finite({"x": x, "n": jnp.arange(2), "none": None})

    local, everywhere = strategy.run(check, args=(bad,))
    assert [bool(v) for v in local.values] == [i != 3 for i in range(8)]
    assert not isinstance(everywhere, kd.PerReplica)  # The same on every replica.
    assert everywhere.dtype == bool and not bool(everywhere)
    assert bool(strategy.run(check, args=(x,))[1])
    # A value already the same everywhere is decided without a collective.
    ones = np.ones(3, "float32")
    assert bool(strategy.run(lambda w: kd.get_replica_context().all_finite(w), (ones,)))
    # Outside any strategy: the one replica's own answer.
    assert not bool(kd.get_replica_context().all_finite([ones, np.array([np.nan])]))
    assert bool(kd.get_replica_context().all_finite([]))
