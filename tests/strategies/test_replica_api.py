"""strategy.run / reduce / gather / experimental_local_results, replica context."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_dist as kd
from keras_dist.data.host._pipeline import element
from tests._helpers import mirrored
from tests.conftest import REPLICA_COUNTS

STRATEGIES = [*REPLICA_COUNTS, 1]


def _strategy(n):
    return kd.OneDeviceStrategy("cpu:0") if n == 1 else mirrored(n)


def _batch(strategy, rows, features=3):
    x = np.arange(rows * features, dtype="float32").reshape(rows, features)
    return x, element(strategy.placement, x)


@pytest.mark.parametrize("n", STRATEGIES)
def test_each_replica_gets_its_rows_and_replicated_args_whole(n):
    strategy = _strategy(n)
    x, batch = _batch(strategy, 16)
    w = np.ones((3, 2), "float32") * 2.0

    def fn(rows, weights, *, scale):
        ctx = kd.get_replica_context()
        return {
            "rows": rows @ weights * scale,
            "count": jnp.asarray(rows.shape[0]),
            "id": ctx.replica_id_in_sync_group,
            "weights": weights,
        }

    out = strategy.run(fn, args=(batch, w), kwargs={"scale": 0.5})
    assert isinstance(out["rows"], kd.PerReplica)
    np.testing.assert_allclose(strategy.gather(out["rows"], axis=0), x @ w * 0.5)
    ids = strategy.experimental_local_results(out["id"])
    assert [int(i) for i in ids] == list(range(n))
    counts = strategy.experimental_local_results(out["count"])
    assert [int(c) for c in counts] == [16 // n] * n
    # Unchanged replicated input: the same on every replica -> one array back.
    assert isinstance(out["weights"], jax.Array)
    assert out["weights"].sharding.is_fully_replicated
    np.testing.assert_array_equal(out["weights"], w)


@pytest.mark.parametrize("n", STRATEGIES)
def test_reduce_sum_and_mean(n):
    strategy = _strategy(n)
    x, batch = _batch(strategy, 8 * 2)
    per_replica = strategy.run(lambda r: r.sum(), args=(batch,))
    np.testing.assert_allclose(strategy.reduce("sum", per_replica, axis=None), x.sum())
    np.testing.assert_allclose(
        strategy.reduce(kd.ReduceOp.MEAN, per_replica, axis=None), x.sum() / n
    )
    rows = strategy.run(lambda r: r * 2.0, args=(batch,))
    np.testing.assert_allclose(strategy.reduce("SUM", rows, axis=0), (2 * x).sum(0))
    np.testing.assert_allclose(strategy.reduce("mean", rows, axis=0), (2 * x).mean(0))
    # A distributed batch itself is a per-replica value too.
    np.testing.assert_allclose(strategy.reduce("sum", batch, axis=0), x.sum(0))
    # A plain value counts as the same on every replica.
    np.testing.assert_allclose(strategy.reduce("sum", jnp.ones(2), axis=None), [n, n])
    np.testing.assert_allclose(strategy.reduce("mean", jnp.ones(2), axis=None), [1, 1])


def test_all_reduce_and_all_gather_inside_run():
    strategy = mirrored(4)
    x, batch = _batch(strategy, 8)

    def fn(rows):
        ctx = kd.get_replica_context()
        assert ctx.num_replicas_in_sync == 4
        return (
            ctx.all_reduce("sum", rows.sum()),
            ctx.all_reduce("mean", {"m": rows.sum()}),
            ctx.all_gather(rows, axis=0),
        )

    total, mean, gathered = strategy.run(fn, args=(batch,))
    np.testing.assert_allclose(total, x.sum())  # Same on every replica: one array.
    np.testing.assert_allclose(mean["m"], x.sum() / 4)
    assert isinstance(gathered, kd.PerReplica)  # JAX cannot prove it replicated.
    for value in strategy.experimental_local_results(gathered):
        np.testing.assert_allclose(value, x)


def test_pytrees_and_per_replica_values_flow_back_into_run():
    strategy = mirrored(8)
    x, batch = _batch(strategy, 16)
    first = strategy.run(lambda r: {"a": [r, r + 1.0]}, args=(batch,))
    second = strategy.run(lambda d: d["a"][0] + d["a"][1], args=(first,))
    np.testing.assert_allclose(strategy.gather(second, axis=0), 2 * x + 1)


def test_run_compiles_once_per_structure():
    strategy = mirrored(8)
    _, batch = _batch(strategy, 16)
    traces = []

    def fn(rows):
        traces.append(1)
        return rows.sum()

    for _ in range(3):
        strategy.run(fn, args=(batch,))
    assert len(traces) == 2  # One probe of the outputs, one compile; then cached.
    _, other = _batch(strategy, 24)
    strategy.run(fn, args=(other,))
    assert len(traces) == 4


def test_partial_batch_is_masked_in_gather_reduce_and_local_results():
    strategy = mirrored(8)
    x, batch = _batch(strategy, 13)  # Padded to 16: 2 rows per replica.
    assert batch.shape == (16, 3)
    rows = strategy.run(lambda r: r * 1.0, args=(batch,))
    np.testing.assert_allclose(strategy.gather(rows, axis=0), x)
    np.testing.assert_allclose(strategy.reduce("sum", rows, axis=0), x.sum(0))
    np.testing.assert_allclose(strategy.reduce("mean", rows, axis=0), x.mean(0))
    local = strategy.experimental_local_results(rows)
    assert [v.shape[0] for v in local] == [2, 2, 2, 2, 2, 2, 1, 0]
    np.testing.assert_allclose(np.concatenate(local), x)
    np.testing.assert_allclose(strategy.gather(batch, axis=0), x)


def test_summing_already_summed_gradients_warns():
    strategy = mirrored(4)
    _, batch = _batch(strategy, 8)
    w = jnp.ones(3)

    def fn(rows, w):
        grads = jax.grad(lambda w: (rows @ w).sum())(w)  # Already summed.
        return kd.get_replica_context().all_reduce("sum", grads)

    with pytest.warns(UserWarning, match="already summed over the replicas"):
        strategy.run(fn, args=(batch, w))


def test_replica_context_outside_run():
    assert kd.get_replica_context().num_replicas_in_sync == 1
    default = kd.get_replica_context()
    assert default.all_reduce("sum", 3.0) == 3.0
    with mirrored(2).scope():
        assert kd.get_replica_context() is None  # Cross-replica context.


def test_bad_input():
    strategy = mirrored(2)
    _, batch = _batch(strategy, 4)
    with pytest.raises(ValueError, match=r"Received: reduce_op='max'"):
        strategy.reduce("max", batch, axis=None)
    with pytest.raises(ValueError, match=r"Received: reduce_op=3"):
        strategy.reduce(3, batch)
    with pytest.raises(
        TypeError, match=r"must return arrays.*Received an output of type str"
    ):
        strategy.run(lambda r: "done", args=(batch,))
    with pytest.raises(TypeError, match=r"Received an output of type object"):
        strategy.run(lambda r: (r, object()), args=(batch,))
    with pytest.raises(TypeError, match=r"For one argument write args=\(x,\)"):
        strategy.run(lambda r: r, args=batch)
    with pytest.raises(TypeError, match="must be callable"):
        strategy.run(None, args=(batch,))
    with pytest.raises(ValueError, match="axis"):
        strategy.gather(batch, axis=5)

    def nested(rows):
        return strategy.reduce("sum", rows)

    with pytest.raises(RuntimeError, match="all_reduce"):
        strategy.run(nested, args=(batch,))


def test_keras_model_forward_inside_run_matches_global():
    strategy = mirrored(8)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    x, batch = _batch(strategy, 16)
    weights = [v.value for v in model.trainable_variables]

    def forward(tv, rows):
        out, _ = model.stateless_call(tv, [], rows)
        return out

    out = strategy.run(forward, args=(weights, batch))
    np.testing.assert_allclose(
        strategy.gather(out, axis=0), model.predict(x, verbose=0), rtol=1e-6
    )
