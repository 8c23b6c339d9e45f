"""Sparse inputs (issue 10, item 3): scipy.sparse, tf.SparseTensor, jax BCOO.

Unit tests of `keras_dist.data._sparse`, then fit / evaluate / predict with
sparse `x` under keras_dist strategies against plain Keras (no strategy).
37 rows in global batches of 10 end with a partial batch of 7, which splits
over 8 replicas only once padded; 40 rows in batches of 8 need no padding.
"""

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
import scipy.sparse
import tensorflow as tf
from jax.experimental import sparse as jax_sparse
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import keras_dist as kd
from keras_dist.data import _sparse
from tests._helpers import assert_history_close, assert_weights_close, mirrored

FEATURES, CLASSES = 6, 3


def sparse_problem(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`n` rows of `FEATURES` features, ~60% zeros, and integer labels."""
    rng = np.random.RandomState(seed)
    x = rng.randn(n, FEATURES).astype("float32")
    x[rng.rand(n, FEATURES) < 0.6] = 0.0
    x[3] = 0.0  # An all-zero row.
    y = (x @ rng.randn(FEATURES, CLASSES)).argmax(1).astype("int32")
    return x, y


X, Y = sparse_problem(37)


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]), ("batch",))


def _dense(matrix) -> np.ndarray:
    return np.asarray(matrix.todense())


# is_sparse / is_leaf / rows_of / to_bcoo ------------------------------------


def test_is_sparse_knows_every_sparse_type():
    assert _sparse.is_sparse(jax_sparse.BCOO.fromdense(X))
    assert _sparse.is_sparse(scipy.sparse.csr_matrix(X))
    assert _sparse.is_sparse(scipy.sparse.coo_matrix(X))
    assert _sparse.is_sparse(tf.sparse.from_dense(X))
    for dense in (X, jnp.asarray(X), tf.constant(X), None, 3.0):
        assert not _sparse.is_sparse(dense)


def test_is_leaf_makes_a_sparse_matrix_one_leaf():
    batch = (jax_sparse.BCOO.fromdense(X[:10]), Y[:10], None)
    # What broke batch_size_of: the BCOO flattens into data (nse,), indices.
    shapes = [leaf.shape for leaf in jax.tree.leaves(batch)]
    assert len(shapes) == 3 and shapes[2] == (10,) and shapes[0] != (10, FEATURES)
    leaves = jax.tree.leaves(batch, is_leaf=_sparse.is_leaf)
    assert len(leaves) == 2
    assert isinstance(leaves[0], jax_sparse.BCOO)
    assert {_sparse.rows_of(leaves[0]), leaves[1].shape[0]} == {10}


def test_rows_of_is_the_dense_row_count_not_the_entry_count():
    matrix = jax_sparse.BCOO.fromdense(X)
    assert matrix.nse != 37
    assert _sparse.rows_of(matrix) == 37
    assert _sparse.rows_of(scipy.sparse.csr_matrix(X)) == 37
    assert _sparse.rows_of(tf.sparse.from_dense(X)) == 37


@pytest.mark.parametrize(
    "make",
    [scipy.sparse.csr_matrix, tf.sparse.from_dense, jax_sparse.BCOO.fromdense],
    ids=["scipy", "tf", "bcoo"],
)
def test_to_bcoo_keeps_the_values(make):
    matrix = _sparse.to_bcoo(make(X))
    assert isinstance(matrix, jax_sparse.BCOO)
    np.testing.assert_array_equal(_dense(matrix), X)


def test_to_bcoo_refuses_other_formats():
    with pytest.raises(TypeError, match="BCSR"):
        _sparse.to_bcoo(jax_sparse.BCSR.fromdense(X))


def test_map_rows_sends_sparse_and_dense_leaves_apart():
    batch = {"x": jax_sparse.BCOO.fromdense(X), "y": Y}
    kinds = _sparse.map_rows(lambda leaf: "dense", lambda leaf: "sparse", batch)
    assert kinds == {"x": "sparse", "y": "dense"}


# pad_sparse / take_sparse ---------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [scipy.sparse.csr_matrix, tf.sparse.from_dense, jax_sparse.BCOO.fromdense],
    ids=["scipy", "tf", "bcoo"],
)
def test_pad_sparse_appends_zero_rows_exactly(make):
    padded = _sparse.pad_sparse(make(X[30:]), 8)
    assert isinstance(padded, jax_sparse.BCOO)
    assert padded.shape == (8, FEATURES)
    dense = _dense(padded)
    np.testing.assert_array_equal(dense[:7], X[30:])
    np.testing.assert_array_equal(dense[7:], 0.0)


def test_pad_sparse_keeps_entries_and_is_identity_at_size():
    matrix = jax_sparse.BCOO.fromdense(X[:7])
    padded = _sparse.pad_sparse(matrix, 16)
    assert padded.nse == matrix.nse
    np.testing.assert_array_equal(padded.data, matrix.data)
    assert _sparse.pad_sparse(matrix, 7) is matrix
    with pytest.raises(ValueError, match="7 rows to 6 rows"):
        _sparse.pad_sparse(matrix, 6)


def test_pad_sparse_keeps_out_of_bounds_entries_out_of_bounds():
    # A BCOO sliced by rows (what Keras's array adapter yields for a BCOO x)
    # keeps every entry; the ones of other rows point at row `shape[0]`.
    sliced = jax_sparse.BCOO.fromdense(X)[30:37]
    with_nonzero_sentinels = jax_sparse.BCOO(
        (jnp.ones_like(sliced.data), sliced.indices), shape=sliced.shape
    )
    assert int(sliced.indices[:, 0].max()) == 7
    for matrix in (sliced, with_nonzero_sentinels):
        expected = _dense(matrix)
        dense = _dense(_sparse.pad_sparse(matrix, 8))
        np.testing.assert_array_equal(dense[:7], expected)
        np.testing.assert_array_equal(dense[7:], 0.0)


def test_pad_sparse_with_batch_dimensions():
    matrix = jax_sparse.BCOO.fromdense(X[:7], n_batch=1)
    padded = _sparse.pad_sparse(matrix, 8)
    assert padded.n_batch == 1 and padded.shape == (8, FEATURES)
    np.testing.assert_array_equal(_dense(padded)[:7], X[:7])
    np.testing.assert_array_equal(_dense(padded)[7:], 0.0)
    np.testing.assert_array_equal(_dense(_sparse.take_sparse(padded, 7)), X[:7])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_pad_then_take_is_the_original(compiled):
    matrix = jax_sparse.BCOO.fromdense(X[30:])
    padded = _sparse.pad_sparse(matrix, 8)
    take = _sparse.take_sparse
    if compiled:
        take = jax.jit(take, static_argnums=1)
    real = take(padded, 7)
    assert isinstance(real, jax_sparse.BCOO)
    assert real.shape == (7, FEATURES)
    assert real.nse == padded.nse  # Static under jit.
    np.testing.assert_array_equal(_dense(real), X[30:])
    assert take(padded, 8) is padded or compiled


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jit"])
def test_take_sparse_segments(compiled):
    # Two processes' blocks of 8 rows: 5 real rows, then 7 real rows.
    rows = np.concatenate([X[:5], np.zeros((3, FEATURES), "float32"), X[5:12], X[:1]])
    padded = jax_sparse.BCOO.fromdense(rows)
    segments = ((0, 5), (8, 7))
    take = _sparse.take_sparse
    if compiled:
        take = jax.jit(take, static_argnums=1)
    real = take(padded, segments)
    assert real.shape == (12, FEATURES)
    np.testing.assert_array_equal(_dense(real), X[:12])
    np.testing.assert_array_equal(_dense(take(padded, ((8, 7),))), X[5:12])


# place_sparse ---------------------------------------------------------------


def test_the_batch_layout_does_not_fit_a_bcoo():
    """Why `place_sparse` replicates: the children are not row-major."""
    matrix = _sparse.pad_sparse(jax_sparse.BCOO.fromdense(X[30:]), 8)
    mesh = _mesh()
    with pytest.raises(ValueError, match="rank"):  # data is (nse,).
        jax.device_put(matrix, NamedSharding(mesh, PartitionSpec("batch", None)))
    if matrix.nse % 8:
        with pytest.raises(ValueError):  # nse entries do not split 8 ways.
            jax.device_put(matrix, NamedSharding(mesh, PartitionSpec("batch")))


def test_place_sparse_replicates_over_the_mesh():
    mesh = _mesh()
    placed = _sparse.place_sparse(scipy.sparse.csr_matrix(X[:16]), mesh)
    assert isinstance(placed, jax_sparse.BCOO)
    for child in (placed.data, placed.indices):
        assert child.sharding.is_equivalent_to(_sparse.sparse_sharding(mesh), 1)
        assert len(child.sharding.device_set) == 8
    np.testing.assert_array_equal(_dense(placed), X[:16])


def test_replicated_sparse_with_sharded_labels_is_exact_under_jit():
    """A padded, replicated BCOO cut in the step == the one-device result."""
    mesh = _mesh()
    kernel = np.random.RandomState(1).randn(FEATURES, CLASSES).astype("float32")
    labels = np.concatenate([Y[30:], np.zeros(1, "int32")])

    def loss(kernel, x, y, num_real):
        x, y = _sparse.take_sparse(x, num_real), y[:num_real]
        logits = x @ kernel
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(num_real), y])

    step = jax.jit(jax.value_and_grad(loss), static_argnums=3)
    expected = jax.value_and_grad(loss)(
        kernel, jax_sparse.BCOO.fromdense(X[30:]), Y[30:], 7
    )
    x = _sparse.place_sparse(
        _sparse.pad_sparse(jax_sparse.BCOO.fromdense(X[30:]), 8), mesh
    )
    y = jax.device_put(labels, NamedSharding(mesh, PartitionSpec("batch")))
    value, grad = step(
        jax.device_put(kernel, NamedSharding(mesh, PartitionSpec())), x, y, 7
    )
    np.testing.assert_allclose(value, expected[0], rtol=1e-6)
    np.testing.assert_allclose(grad, expected[1], rtol=1e-6, atol=1e-7)


# fit / evaluate / predict: strategies == plain Keras ------------------------


def _bcoo(x):
    return jax_sparse.BCOO.fromdense(x)


def _tf_data(x, y, batch):
    sparse_x = tf.sparse.from_dense(x)
    elements = sparse_x if y is None else (sparse_x, y)
    return tf.data.Dataset.from_tensor_slices(elements).batch(batch)


# How each kind of sparse x goes into fit / evaluate / predict: arrays (with
# batch_size) or a dataset of batches.
SPARSE_KINDS = {
    "scipy.csr_matrix": scipy.sparse.csr_matrix,
    "tf.SparseTensor-tf.data": None,
    "jax.BCOO": _bcoo,
}


def _initial_weights(sparse_input: bool) -> list[np.ndarray]:
    keras.utils.set_random_seed(1234)
    return _sparse_model(sparse_input).get_weights()


def _sparse_model(sparse_input: bool) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((FEATURES,), sparse=sparse_input),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


def sparse_fit_evaluate_predict(
    strategy: kd.Strategy | None,
    kind: str,
    rows: int = 37,
    batch: int = 10,
    sparse_input: bool = True,
):
    """fit (2 epochs, validation) / evaluate / predict on sparse `x` of `kind`.

    With `strategy=None` it is plain Keras with no distribution: the
    reference. Returns `(history, weights, evaluated, predicted)`.
    """
    x, y = sparse_problem(rows)
    xv, yv = x[:17] * 0.5, y[:17]
    weights = _initial_weights(sparse_input)
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        model = _sparse_model(sparse_input)
        model.set_weights(weights)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    make = SPARSE_KINDS[kind]
    if make is None:
        history = model.fit(
            _tf_data(x, y, batch),
            epochs=2,
            validation_data=_tf_data(xv, yv, batch),
            shuffle=False,
            verbose=0,
        )
        evaluated = model.evaluate(_tf_data(x, y, batch), verbose=0)
        predicted = model.predict(_tf_data(x, None, batch), verbose=0)
    else:
        history = model.fit(
            make(x),
            y,
            batch_size=batch,
            epochs=2,
            validation_data=(make(xv), yv),
            shuffle=False,
            verbose=0,
        )
        evaluated = model.evaluate(make(x), y, batch_size=batch, verbose=0)
        predicted = model.predict(make(x), batch_size=batch, verbose=0)
    return history.history, model.get_weights(), evaluated, predicted


@functools.cache
def plain_keras_sparse_results(
    kind: str, rows: int = 37, batch: int = 10, sparse_input: bool = True
):
    """The reference: `sparse_fit_evaluate_predict` in plain Keras, cached."""
    return sparse_fit_evaluate_predict(None, kind, rows, batch, sparse_input)


def _assert_same(reference, results, rows: int):
    ref_history, ref_weights, ref_eval, ref_pred = reference
    history, weights, evaluated, predicted = results
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(history)
    assert_history_close(ref_history, history)
    assert_weights_close(ref_weights, weights)
    np.testing.assert_allclose(evaluated, ref_eval, rtol=1e-5, atol=1e-6)
    assert predicted.shape == (rows, CLASSES)  # Exactly the real rows.
    np.testing.assert_allclose(predicted, ref_pred, rtol=1e-5, atol=1e-6)


STRATEGIES = {
    "mirrored8": lambda: mirrored(8),
    "one-device": lambda: kd.OneDeviceStrategy("cpu:0"),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("kind", list(SPARSE_KINDS))
def test_sparse_partial_batch_matches_plain_keras(kind, strategy):
    """37 rows, batches of 10: the last batch (7 rows) is padded to 8."""
    reference = plain_keras_sparse_results(kind)
    _assert_same(
        reference, sparse_fit_evaluate_predict(STRATEGIES[strategy](), kind), 37
    )


@pytest.mark.parametrize("kind", list(SPARSE_KINDS))
def test_sparse_even_batches_match_plain_keras(kind):
    """40 rows, batches of 8: every batch splits over 8 replicas as is."""
    reference = plain_keras_sparse_results(kind, rows=40, batch=8)
    results = sparse_fit_evaluate_predict(mirrored(8), kind, rows=40, batch=8)
    _assert_same(reference, results, 40)


def test_sparse_x_into_a_dense_input_matches_plain_keras():
    """`Input(sparse=False)`: the step still receives a BCOO (Keras densifies
    it in the model), so the pipeline must handle it all the same."""
    kind = "scipy.csr_matrix"
    reference = plain_keras_sparse_results(kind, sparse_input=False)
    results = sparse_fit_evaluate_predict(mirrored(8), kind, sparse_input=False)
    _assert_same(reference, results, 37)


def test_sparse_batches_are_read_on_the_calling_thread():
    """Keras slices sparse batches with JAX ops: no read-ahead thread for them
    (eager JAX work on a second thread during a step aborted XLA on CPU)."""
    seen = []

    class Threads(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.extend(t.name for t in threading.enumerate())

    x, y = sparse_problem(40)
    strategy = mirrored(8)
    # The host path (in-memory arrays are otherwise kept on the devices).
    strategy.input_options = kd.InputOptions(device_resident=False)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((FEATURES,), sparse=True), keras.layers.Dense(CLASSES)]
        )
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.fit(
        scipy.sparse.csr_matrix(x), y, batch_size=8, verbose=0, callbacks=[Threads()]
    )
    assert seen and "keras_dist-prefetch" not in seen
    seen.clear()
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[Threads()])
    assert "keras_dist-prefetch" in seen  # Dense batches are read ahead.
