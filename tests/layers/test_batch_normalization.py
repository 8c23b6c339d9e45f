"""kd.layers.BatchNormalization / SyncBatchNormalization against NumPy.

Per-replica statistics are checked against NumPy's moments of each replica's
rows: a global batch of `n` rows on `R` replicas is padded to a multiple of
`R`, so replica `r` holds rows `r * b ... (r + 1) * b - 1`, `b = ceil(n / R)`
(37 rows, batch 10, 8 replicas: `b = 2` for the full batches — replicas 5-7
hold only padding — and `b = 1` for the last 7 rows — every replica one row,
replica 7 none).
"""

import contextlib
import functools

import jax
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from tests._helpers import mirrored
from tests.conftest import REPLICA_COUNTS

N, BATCH, C, MOMENTUM, EPS = 37, 10, 5, 0.5, 1e-3
MODES = {  # jit (the default): every other test.
    "eager": {"run_eagerly": True},
    "no_jit_compile": {"jit_compile": False},
    "steps_per_execution": {"steps_per_execution": 3},
}
# Outputs: a replica of one row has variance 0 and scales by 1 / sqrt(EPS), so
# Keras's `x * inv + (beta - mean * inv)` cancels values near 100 in float32.
OUT_ATOL = 1e-4


def _data(shape=(N, C), seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randn(*shape) * 3 + 1).astype("float32")


def _replica_moments(xb, replicas, mask=None):
    """[(rows, mean, var)] of each replica holding real rows (float64)."""
    n = len(xb)
    b = -(-n // replicas)
    out = []
    for r in range(replicas):
        rows = slice(r * b, min((r + 1) * b, n))
        if r * b >= n:
            continue  # Only padding on this replica: left out.
        xr = xb[rows].astype("float64")
        axes = tuple(range(xr.ndim - 1))
        if mask is None:
            out.append((rows, xr.mean(axes), xr.var(axes)))
            continue
        w = np.broadcast_to(mask[rows][..., None], xr.shape).astype("float64")
        count = w.sum(axes) + keras.backend.epsilon()
        mean = (w * xr).sum(axes) / count
        out.append((rows, mean, (w * (xr - mean) ** 2).sum(axes) / count))
    return out


def _reference(x, replicas, gamma, beta, mask=None, batch=BATCH):
    """Training-mode outputs of every batch and the final moving statistics."""
    outputs = np.zeros(x.shape, "float64")
    moving_mean, moving_var = np.zeros(x.shape[-1]), np.ones(x.shape[-1])
    for start in range(0, len(x), batch):
        xb = x[start : start + batch]
        mb = None if mask is None else mask[start : start + batch]
        moments = _replica_moments(xb, replicas, mb)
        for rows, mean, var in moments:
            normed = (xb[rows] - mean) / np.sqrt(var + EPS) * gamma + beta
            outputs[start : start + batch][rows] = normed
        moving_mean = MOMENTUM * moving_mean + (1 - MOMENTUM) * np.mean(
            [m for _, m, _ in moments], axis=0
        )
        moving_var = MOMENTUM * moving_var + (1 - MOMENTUM) * np.mean(
            [v for _, _, v in moments], axis=0
        )
    return outputs, moving_mean, moving_var


class _TrainingMode(keras.layers.Layer):
    """Calls its layer in training mode, also in `predict` (to read outputs)."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer
        self.supports_masking = True

    def call(self, x, mask=None):
        return self.layer(x, training=True, mask=mask)


GAMMA = np.linspace(0.5, 2.0, C).astype("float32")
BETA = np.linspace(-1.0, 1.0, C).astype("float32")


def _bn(cls=kd.layers.BatchNormalization, **kwargs):
    return cls(
        momentum=MOMENTUM,
        epsilon=EPS,
        gamma_initializer=keras.initializers.Constant(GAMMA),
        beta_initializer=keras.initializers.Constant(BETA),
        **kwargs,
    )


def _scope(strategy):
    return strategy.scope() if strategy else contextlib.nullcontext()


def _model(strategy, layer, shape=(C,), masked=False, wrap=False):
    with _scope(strategy):
        inputs = keras.Input(shape)
        h = keras.layers.Masking(0.0)(inputs) if masked else inputs
        out = (_TrainingMode(layer) if wrap else layer)(h)
        model = keras.Model(inputs, out)
    return model


def _fit(model, x, mode=None, lr=0.0):
    model.compile(keras.optimizers.SGD(lr), "mse", **(mode or {}))
    model.fit(x, np.zeros_like(x), batch_size=BATCH, shuffle=False, verbose=0)


def _moving(layer):
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()


@pytest.mark.parametrize("replicas", REPLICA_COUNTS)
def test_fit_moving_statistics_are_the_mean_of_replica_moments(replicas):
    x = _data()
    model = _model(mirrored(replicas), layer := _bn())
    _fit(model, x)
    _, mean, var = _reference(x, replicas, GAMMA, BETA)
    np.testing.assert_allclose(_moving(layer)[0], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_moving(layer)[1], var, rtol=1e-5, atol=1e-6)
    # Per-replica statistics differ from the global ones (the test has teeth).
    _, _, global_var = _reference(x, 1, GAMMA, BETA)
    assert not np.allclose(var, global_var, rtol=1e-3)


@pytest.mark.parametrize(
    "strategy",
    [
        lambda: kd.MirroredStrategy(
            [f"cpu:{i}" for i in range(8)], shard_variables=True
        ),
        lambda: kd.CentralStorageStrategy([f"cpu:{i}" for i in range(4)]),
    ],
    ids=["fsdp8", "central_storage4"],
)
def test_split_and_host_state_strategies(strategy):
    strategy = strategy()
    x = _data(seed=9)
    _fit(_model(strategy, layer := _bn()), x)
    _, mean, var = _reference(x, strategy.num_replicas_in_sync, GAMMA, BETA)
    np.testing.assert_allclose(_moving(layer)[0], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_moving(layer)[1], var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas", REPLICA_COUNTS)
def test_training_outputs_use_each_replicas_moments(replicas):
    x = _data(seed=1)
    model = _model(mirrored(replicas), _bn(), wrap=True)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    got = model.predict(x, batch_size=BATCH, verbose=0)
    expected, _, _ = _reference(x, replicas, GAMMA, BETA)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=OUT_ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_every_execution_mode(mode):
    x = _data(seed=2)
    fitted = _model(mirrored(8), layer := _bn())
    _fit(fitted, x, MODES[mode])
    expected, mean, var = _reference(x, 8, GAMMA, BETA)
    np.testing.assert_allclose(_moving(layer)[0], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_moving(layer)[1], var, rtol=1e-5, atol=1e-6)
    predictor = _model(mirrored(8), _bn(), wrap=True)
    predictor.compile(keras.optimizers.SGD(0.0), "mse", **MODES[mode])
    got = predictor.predict(x, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=OUT_ATOL)


def test_train_on_batch_with_one_row_per_replica():
    """7 rows on 8 replicas: 1 row each (variance 0, output beta), 1 replica none."""
    x = _data((7, C), seed=3)
    model = _model(mirrored(8), layer := _bn())
    model.compile(keras.optimizers.SGD(0.0), "mse")
    model.train_on_batch(x, np.zeros_like(x))
    # Mean over the 7 replicas of their one row; variances all 0.
    np.testing.assert_allclose(
        _moving(layer)[0], (1 - MOMENTUM) * x.mean(0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(_moving(layer)[1], np.full(C, MOMENTUM), rtol=1e-6)
    predictor = _model(mirrored(8), _bn(), wrap=True)
    got = predictor.predict(x, batch_size=7, verbose=0)
    np.testing.assert_allclose(got, np.broadcast_to(BETA, x.shape), atol=OUT_ATOL)
    assert np.isfinite(_moving(layer)).all()


def test_mask_per_replica():
    x = _data((N, 4, C), seed=4)
    x[::3, 2:] = 0.0  # Masked time steps (Masking(0.0)).
    x[5, :] = 0.0  # A fully masked row.
    mask = (x != 0).any(-1)
    model = _model(mirrored(4), layer := _bn(), shape=(4, C), masked=True)
    _fit(model, x)
    expected, mean, var = _reference(x, 4, GAMMA, BETA, mask)
    np.testing.assert_allclose(_moving(layer)[0], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_moving(layer)[1], var, rtol=1e-5, atol=1e-6)
    predictor = _model(mirrored(4), _bn(), shape=(4, C), masked=True, wrap=True)
    got = predictor.predict(x, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=OUT_ATOL)


def _one_fit(strategy, cls, **kwargs):
    keras.utils.set_random_seed(7)
    x = _data(seed=5)
    with _scope(strategy):
        model = keras.Sequential(
            [
                keras.Input((C,)),
                keras.layers.Dense(C, kernel_initializer="glorot_uniform"),
                _bn(cls, **kwargs),
                keras.layers.Dense(C),
            ]
        )
    _fit(model, x, lr=0.05)
    return [np.asarray(w) for w in model.get_weights()]


@functools.cache
def _keras_fit():
    return _one_fit(None, keras.layers.BatchNormalization)


_SYNC = (kd.layers.SyncBatchNormalization, {})
_SYNCHRONIZED = (kd.layers.BatchNormalization, {"synchronized": True})
_STRATEGIES = {
    "none": lambda: None,
    "one_device": lambda: kd.OneDeviceStrategy("cpu:0"),
    "mirrored8": lambda: mirrored(8),
}


@pytest.mark.parametrize(
    ("layer", "strategy"),
    [
        (_SYNC, "none"),
        (_SYNC, "one_device"),
        (_SYNC, "mirrored8"),
        (_SYNCHRONIZED, "mirrored8"),
    ],
    ids=["sync-none", "sync-one_device", "sync-mirrored8", "synchronized-mirrored8"],
)
def test_sync_layer_equals_keras_and_one_device(layer, strategy):
    cls, kwargs = layer
    got = _one_fit(_STRATEGIES[strategy](), cls, **kwargs)
    for got_weight, want in zip(got, _keras_fit(), strict=True):
        np.testing.assert_allclose(got_weight, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["none", "one_device"])
def test_per_replica_layer_is_keras_on_one_replica(strategy):
    keras_weights = _one_fit(_STRATEGIES[strategy](), keras.layers.BatchNormalization)
    got = _one_fit(_STRATEGIES[strategy](), kd.layers.BatchNormalization)
    for got_weight, want in zip(got, keras_weights, strict=True):
        np.testing.assert_array_equal(got_weight, want)


def _run_steps(strategy, layer, x):
    """A custom loop: `stateless_call` in training mode inside `strategy.run`."""
    with strategy.scope():
        model = keras.Sequential([keras.Input((C,)), layer])
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(BATCH)
    trainable = [v.value for v in model.trainable_variables]
    state = [v.value for v in model.non_trainable_variables]

    def step(trainable, state, batch):
        return model.stateless_call(trainable, state, batch, training=True)

    outputs = []
    for batch in strategy.experimental_distribute_dataset(dataset):
        out, state = strategy.run(step, args=(trainable, state, batch))
        outputs.append(np.asarray(strategy.gather(out, axis=0)))
    for leaf in state:  # The moving statistics stay one replicated value.
        assert isinstance(leaf, jax.Array) and leaf.sharding.is_fully_replicated
    return np.concatenate(outputs), [np.asarray(v) for v in state]


@pytest.mark.parametrize("replicas", [2, 8])
def test_inside_strategy_run(replicas):
    x = _data(seed=6)
    got, (mean, var) = _run_steps(mirrored(replicas), _bn(), x)
    expected, want_mean, want_var = _reference(x, replicas, GAMMA, BETA)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=OUT_ATOL)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, want_var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas", [2, 8])
def test_sync_inside_strategy_run_equals_one_device(replicas):
    x = _data(seed=6)
    got, (mean, var) = _run_steps(
        mirrored(replicas), _bn(kd.layers.SyncBatchNormalization), x
    )
    expected, want_mean, want_var = _reference(x, 1, GAMMA, BETA)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=OUT_ATOL)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(var, want_var, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "layer",
    [
        kd.layers.BatchNormalization(momentum=0.7, synchronized=True, name="bn"),
        kd.layers.BatchNormalization(momentum=0.7, name="bn"),
        kd.layers.SyncBatchNormalization(momentum=0.7, name="bn"),
    ],
    ids=["synchronized", "per_replica", "sync"],
)
def test_keras_file_round_trip(tmp_path, layer):
    x = _data(seed=8)
    model = _model(mirrored(4), layer)
    _fit(model, x, lr=0.1)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    restored = loaded.get_layer("bn")
    assert type(restored) is type(layer)
    assert restored.get_config() == layer.get_config()
    assert restored.synchronized == layer.synchronized
    for got, want in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    # Keras's layer reads the same weights (a drop-in).
    plain = keras.layers.BatchNormalization.from_config(
        {**layer.get_config(), "synchronized": False}
    )
    plain.build((None, C))
    plain.set_weights(layer.get_weights())
    np.testing.assert_array_equal(plain(x), layer(x))


def test_bad_synchronized_is_a_type_error():
    with pytest.raises(
        TypeError,
        match=r"`synchronized` must be True .* "
        r"Received: synchronized='yes' of type str",
    ):
        kd.layers.BatchNormalization(synchronized="yes")
    with pytest.raises(ValueError, match=r"Received: synchronized=False\. For "):
        kd.layers.SyncBatchNormalization(synchronized=False)


def test_renorm_needs_synchronized_under_replicas():
    model = _model(mirrored(2), _bn(renorm=True, name="bn"))
    with pytest.raises(ValueError, match=r"layer 'bn'.*Received: renorm=True"):
        _fit(model, _data())


class _ChunkedKerasBN(keras.layers.BatchNormalization):
    """One device: Keras's layer on each replica's rows in turn (weights only)."""

    def __init__(self, replicas, **kwargs):
        super().__init__(**kwargs)
        self.replicas = replicas

    def call(self, x, training=None):
        b = -(-x.shape[0] // self.replicas)
        parts = [
            super(_ChunkedKerasBN, self).call(x[i : i + b], training=training)
            for i in range(0, x.shape[0], b)
        ]
        return keras.ops.concatenate(parts, axis=0)


def test_fit_gradients_flow_through_each_replicas_moments():
    """Trained weights equal one device normalizing each replica's rows apart.

    8 replicas: the last batch has replicas of one row, whose normalization
    (variance 0, scale 1 / sqrt(EPS)) passes rounding on to the gradients.
    """
    got = _one_fit(mirrored(8), kd.layers.BatchNormalization)
    reference = _one_fit(None, lambda **kw: _ChunkedKerasBN(8, **kw))
    trainable = [0, 1, 2, 3, 6, 7]  # Dense, gamma, beta, Dense (not moving stats).
    # The one-row replicas' scale (1 / sqrt(EPS), about 32) amplifies float
    # rounding, which differs between CPUs (their vector widths): 1.7e-5 on
    # an AVX2 machine where another gave under 1e-5. Keras's own moments
    # differ by over 1e-3 (below).
    for index in trainable:
        np.testing.assert_allclose(got[index], reference[index], rtol=1e-5, atol=1e-4)
    keras_weights = _keras_fit()
    assert not np.allclose(got[2], keras_weights[2], rtol=1e-3)


class _Flattened(keras.layers.Layer):
    """Applies its layer to the rows of every time step at once (n * T rows)."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer

    def call(self, x, training=None):
        flat = keras.ops.reshape(x, (-1, x.shape[-1]))
        return keras.ops.reshape(self.layer(flat, training=training), x.shape)


def test_rows_that_are_not_the_batch_are_refused():
    model = _model(mirrored(2), _Flattened(_bn(name="bn")), shape=(3, C))
    with pytest.raises(
        ValueError,
        match=r"\(10 real rows over 2 replicas\).*Received: inputs of shape "
        r"\(30, 5\) in layer 'bn'\. Use `kd.layers.SyncBatchNormalization`",
    ):
        _fit(model, _data((N, 3, C)))
