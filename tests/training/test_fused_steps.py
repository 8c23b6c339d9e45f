"""Fused `steps_per_execution`: N batches in one program, Keras's numbers.

Under a strategy, `compile(steps_per_execution=N)` runs each group of N
batches of one structure as one compiled program (`lax.scan` of Keras's
step, `training/_fused_steps.py`); other groups (the shorter last group, a
group with a padded partial batch) run Keras's own loop. The numbers must be
those of Keras's loop under the same strategy
(`kd.InputOptions(fuse_steps=False)`) and of plain Keras (no strategy) with
the same `steps_per_execution`, for fit (history, weights), evaluate and
predict: on 37 rows in batches of 8 (a fused group of 4, then one partial
batch of 5 through Keras's loop) and on 64 rows (every group full), under
OneDevice, Mirrored (8 replicas), ZeRO-1 (optimizer state split over the
replicas) and CentralStorage, for NumPy (device-resident and host path),
tf.data, `PyDataset` and a generator; with Dropout and BatchNormalization
(seeds and moving statistics carried through the scan), gradient
accumulation, batch callbacks and an exact resume. Counting the programs'
calls proves that the groups really run as one program.

Measured on 8 CPU devices: fused and Keras's loop are bit-identical (ZeRO-1:
weights within 3e-8); against plain Keras, weights within 1.2e-7 and
outputs within 2.4e-7 (the replicas' sums add in another order).
"""

import collections
import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist as kd
from keras_dist.data._batch_group import group_of
from keras_dist.training._fused_steps import FusedSteps, has_primitive
from keras_dist.training._step import StepProgram
from tests._helpers import (
    InterruptAt,
    assert_history_close,
    assert_weights_close,
    initial_weights,
    make_data,
    make_model,
)
from tests._strategies import STRATEGIES

RTOL = ATOL = 1e-6


class Case(NamedTuple):
    rows: int
    batch: int
    steps: int  # steps_per_execution

    @property
    def generator_steps(self) -> int:
        """Batches a generator's pass reads: the epoch's groups, all full."""
        return self.steps * math.ceil(math.ceil(self.rows / self.batch) / self.steps)


CASES = {
    # Batches 8, 8, 8, 8, 5: a fused group of 4, then 1 through Keras's loop.
    "37_rows_spe_4": Case(37, 8, 4),
    # 8 full batches: 4 fused groups of 2.
    "64_rows_spe_2": Case(64, 8, 2),
}


class Result(NamedTuple):
    history: dict
    scores: dict
    outputs: np.ndarray
    weights: list


# Inputs ----------------------------------------------------------------------


class _Batches(keras.utils.PyDataset):
    def __init__(self, *arrays, batch: int):
        super().__init__()
        self.arrays, self.batch = arrays, batch

    def __len__(self):
        return math.ceil(len(self.arrays[0]) / self.batch)

    def __getitem__(self, index):
        rows = slice(index * self.batch, (index + 1) * self.batch)
        return tuple(a[rows] for a in self.arrays)


def _cycle(*arrays, batch: int):
    """An endless generator of the arrays' batches, pass after pass."""
    while True:
        for start in range(0, len(arrays[0]), batch):
            yield tuple(a[start : start + batch] for a in arrays)


def _input(kind: str, case: Case, call: str) -> dict:
    """The input arguments of `call` ("fit", "evaluate" or "predict")."""
    x, y, sw = make_data(case.rows)
    arrays = (x,) if call == "predict" else (x, y, sw)
    if kind in ("numpy", "numpy_host"):
        names = ("x", "y", "sample_weight")
        return dict(zip(names, arrays, strict=False)) | {"batch_size": case.batch}
    if kind == "tf_data":
        return {"x": tf.data.Dataset.from_tensor_slices(arrays).batch(case.batch)}
    if kind == "py_dataset":
        return {"x": _Batches(*arrays, batch=case.batch)}
    if kind == "generator":
        steps = "steps_per_epoch" if call == "fit" else "steps"
        return {"x": _cycle(*arrays, batch=case.batch), steps: case.generator_steps}
    raise ValueError(f"Unknown input kind. Received: kind={kind!r}")


# Runs ------------------------------------------------------------------------


def _strategy(name: str | None, *, fuse: bool = True, host: bool = False):
    if name is None:
        return None
    strategy = STRATEGIES[name]()
    strategy.input_options = kd.InputOptions(
        fuse_steps=fuse, device_resident=False if host else None
    )
    return strategy


def _model(strategy, steps: int, *, optimizer=None, mode=(), **model_kwargs):
    weights = initial_weights(**model_kwargs)
    keras.utils.set_random_seed(7)  # The Dropout seeds.
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = make_model(**model_kwargs)
        model.set_weights(weights)
        model.compile(
            optimizer=optimizer or keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps,
            **dict(mode),
        )
    return model


def _run(
    name, kind, case, *, fuse=True, callbacks=(), epochs=2, validation=False, **model
) -> Result:
    """fit, evaluate and predict with `kind` input: every result."""
    strategy = _strategy(name, fuse=fuse, host=kind == "numpy_host")
    net = _model(strategy, case.steps, **model)
    keras.utils.set_random_seed(3)  # The same shuffle in every run.
    callbacks = list(callbacks)
    history = net.fit(
        **_input(kind, case, "fit"),
        # 35 rows: a fused group of 4 batches of 8, then 3 rows alone.
        validation_data=make_data(35, seed=1)[:2] if validation else None,
        epochs=epochs,
        shuffle=kind.startswith("numpy"),
        callbacks=callbacks,
        verbose=0,
    ).history
    scores = net.evaluate(
        **_input(kind, case, "evaluate"),
        callbacks=callbacks,
        return_dict=True,
        verbose=0,
    )
    outputs = net.predict(
        **_input(kind, case, "predict"), callbacks=callbacks, verbose=0
    )
    return Result(history, scores, outputs, net.get_weights())


@functools.cache
def _keras(kind: str, case_name: str, **kwargs) -> Result:
    """Plain Keras (no strategy), the same `steps_per_execution`: the reference."""
    return _run(None, kind, CASES[case_name], **kwargs)


def _assert_same(expected: Result, got: Result, what: str) -> None:
    assert_history_close(expected.history, got.history, rtol=RTOL, atol=ATOL)
    assert sorted(got.scores) == sorted(expected.scores), what
    for key, value in expected.scores.items():
        np.testing.assert_allclose(
            got.scores[key], value, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {key}"
        )
    assert got.outputs.shape == expected.outputs.shape, what
    np.testing.assert_allclose(
        got.outputs, expected.outputs, rtol=RTOL, atol=ATOL, err_msg=what
    )
    assert_weights_close(expected.weights, got.weights, rtol=RTOL, atol=ATOL)


# Counting the programs' calls ------------------------------------------------


@pytest.fixture
def dispatches(monkeypatch):
    """Counts the calls of fused programs and of one-step programs.

    A one-step program is a compiled `StepProgram`, called `(state, batch)`
    (an eager step is a `StepProgram` too, not a program: not counted).
    """
    counts = collections.Counter()
    init, call = FusedSteps.__init__, StepProgram.__call__

    def counting_init(self, step, jit, **kwargs):
        def counting_jit(program):
            compiled = jit(program)

            def dispatch(*args):
                counts["fused"] += 1
                return compiled(*args)

            return dispatch

        init(self, step, counting_jit, **kwargs)

    def counting_call(self, *args, **kwargs):
        counts["one_step"] += len(args) == 2 and self.compiled
        return call(self, *args, **kwargs)

    monkeypatch.setattr(FusedSteps, "__init__", counting_init)
    monkeypatch.setattr(StepProgram, "__call__", counting_call)
    return counts


class _PerCall(keras.callbacks.Callback):
    """(fused, one-step) programs called during each of fit, evaluate, predict."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts, self.calls, self._starts = counts, {}, {}

    def _begin(self, call):
        self._starts[call] = collections.Counter(self.counts)

    def _end(self, call):
        counted = self.counts - self._starts[call]
        self.calls[call] = (counted["fused"], counted["one_step"])

    def on_train_begin(self, logs=None):
        self._begin("fit")

    def on_train_end(self, logs=None):
        self._end("fit")

    def on_test_begin(self, logs=None):
        self._begin("evaluate")

    def on_test_end(self, logs=None):
        self._end("evaluate")

    def on_predict_begin(self, logs=None):
        self._begin("predict")

    def on_predict_end(self, logs=None):
        self._end("predict")


# 1. fused == Keras's loop == plain Keras -------------------------------------

# strategy, input, case, (fused, one-step) programs called by fit's 2 epochs.
PARITY = [
    ("mirrored", "numpy", "37_rows_spe_4", (2, 2)),
    ("one_device", "numpy", "64_rows_spe_2", (8, 0)),
    ("zero1", "numpy_host", "37_rows_spe_4", (2, 2)),
    ("mirrored", "tf_data", "64_rows_spe_2", (8, 0)),
    ("central_storage", "py_dataset", "37_rows_spe_4", (2, 2)),
    # 8 steps an epoch over 5-batch passes: only the first group of the fit
    # has 4 batches of 8 rows; every other one has the partial batch.
    ("mirrored", "generator", "37_rows_spe_4", (1, 12)),
]


@pytest.mark.parametrize(("name", "kind", "case", "fit_calls"), PARITY)
def test_fused_equals_keras_loop_and_plain_keras(
    dispatches, name, kind, case, fit_calls
):
    spy = _PerCall(dispatches)
    fused = _run(name, kind, CASES[case], callbacks=[spy])
    assert spy.calls["fit"] == fit_calls
    _assert_same(_run(name, kind, CASES[case], fuse=False), fused, "fuse_steps=False")
    _assert_same(_keras(kind, case), fused, "plain Keras")
    # A generator's predict reads 8 batches: 37 rows, then 24 of the next pass.
    assert len(fused.outputs) == (61 if kind == "generator" else CASES[case].rows)


# 2. RNG seeds and moving statistics through the scan -------------------------


def test_dropout_and_batch_normalization_carry_their_state():
    model = {"batch_norm": True, "dropout": 0.3, "validation": True}
    case = CASES["37_rows_spe_4"]
    fused = _run("mirrored", "numpy", case, **model)
    assert "val_loss" in fused.history
    _assert_same(_run("mirrored", "numpy", case, fuse=False, **model), fused, "loop")
    _assert_same(_keras("numpy", "37_rows_spe_4", **model), fused, "plain Keras")


# 3. One call per group -------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "rows", "fuse", "expected"),
    [
        ("numpy", 64, True, (2, 0)),  # 8 full batches: 2 programs of 4 steps.
        ("numpy", 64, False, (0, 8)),  # Keras's loop: 8 one-step programs.
        ("numpy", 37, True, (1, 1)),  # 4 full batches in one, the partial alone.
        ("tf_data", 37, True, (1, 1)),  # Batches read one by one, then grouped.
    ],
)
def test_a_group_is_one_call(dispatches, kind, rows, fuse, expected):
    spy = _PerCall(dispatches)
    _run("mirrored", kind, Case(rows, 8, 4), fuse=fuse, callbacks=[spy], epochs=1)
    assert spy.calls == {"fit": expected, "evaluate": expected, "predict": expected}


def test_fuse_steps_set_between_calls_takes_effect(dispatches):
    """Keras keeps its step functions across calls: the option is read per group."""
    strategy = _strategy("mirrored")
    net = _model(strategy, 4)
    fit = _input("numpy", Case(64, 8, 4), "fit")
    calls = []
    for fuse in (True, False, True):
        strategy.input_options = kd.InputOptions(fuse_steps=fuse)
        spy = _PerCall(dispatches)
        net.fit(**fit, epochs=1, shuffle=False, callbacks=[spy], verbose=0)
        calls.append(spy.calls["fit"])
    assert calls == [(2, 0), (0, 8), (2, 0)]


def test_a_convolution_on_cpu_devices_runs_through_keras_loop(dispatches):
    """XLA:CPU runs a convolution inside a loop slowly: such a step is not fused.

    The first group is read as a group, then run batch by batch; Keras's loop
    runs every later one. The numbers stay Keras's.
    """
    spy = _PerCall(dispatches)
    got = _run("mirrored", "numpy", CASES["37_rows_spe_4"], callbacks=[spy], conv=True)
    # 5 batches an epoch, 2 epochs; evaluate and predict 5 batches each.
    assert spy.calls == {"fit": (0, 10), "evaluate": (0, 5), "predict": (0, 5)}
    _assert_same(_keras("numpy", "37_rows_spe_4", conv=True), got, "plain Keras")


def _counting_transfers(monkeypatch, strategy) -> collections.Counter:
    """Counts the strategy's layouts of one batch and of a group of batches."""
    counts: collections.Counter = collections.Counter()
    placement = strategy.placement
    for name in ("lay_out", "lay_out_steps"):
        real = getattr(placement, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(placement, name, counting)
    return counts


@pytest.mark.parametrize(
    ("kind", "rows", "conv", "expected"),
    [
        # 16 full batches: 4 groups of 4, each one transfer.
        ("numpy_host", 128, False, {"lay_out_steps": 4}),
        # 4 full batches in one transfer; the partial batch alone.
        ("numpy_host", 37, False, {"lay_out_steps": 1, "lay_out": 1}),
        ("tf_data", 37, False, {"lay_out_steps": 1, "lay_out": 1}),
        ("py_dataset", 128, False, {"lay_out_steps": 4}),
        # A generator's steps are read on demand: the same groups, no thread.
        ("generator", 128, False, {"lay_out_steps": 4}),
        # Not fused (a convolution on CPU): the first group was read as one,
        # then batch by batch, but for the groups the thread read ahead (1
        # or 2, as the threads run): checked below.
        ("numpy_host", 128, True, None),
    ],
)
def test_the_host_path_lays_a_group_out_in_one_transfer(
    monkeypatch, dispatches, kind, rows, conv, expected
):
    """The N batches of a fused group go to the devices stacked, at once.

    With `steps_per_execution=N` the input thread stacks N host batches and
    lays them out in one transfer (`InputPass.next_group`); the numbers are
    those of Keras's loop fed batch by batch (`fuse_steps=False`).
    """
    case = Case(rows, 8, 4)
    results, transfers = [], []
    for fuse in (True, False):
        strategy = _strategy("mirrored", fuse=fuse, host=True)
        counts = _counting_transfers(monkeypatch, strategy)
        net = _model(strategy, case.steps, conv=conv)
        keras.utils.set_random_seed(3)
        fit = _input(kind, case, "fit")
        if kind == "generator":
            fit["steps_per_epoch"] = math.ceil(rows / 8)
        shuffle = kind.startswith("numpy")
        history = net.fit(**fit, epochs=1, shuffle=shuffle, verbose=0).history
        results.append((history, net.get_weights()))
        transfers.append(dict(counts))
    # Keras's build reads one more batch, from a pass of its own, before `fit`.
    assert transfers[1] == {"lay_out": math.ceil(rows / 8) + 1}
    if expected is None:
        groups = transfers[0]["lay_out_steps"]
        assert groups in (2, 3)
        assert transfers[0] == {"lay_out_steps": groups, "lay_out": 17 - 4 * groups}
    else:
        expected = expected | {"lay_out": expected.get("lay_out", 0) + 1}
        assert transfers[0] == expected
    (fused_history, fused_weights), (loop_history, loop_weights) = results
    assert_history_close(loop_history, fused_history, rtol=RTOL, atol=ATOL)
    assert_weights_close(loop_weights, fused_weights, rtol=RTOL, atol=ATOL)


def test_the_step_decides_fusion_from_its_jaxpr():
    def conv_step(x, kernel):  # A convolution and its gradient.
        return jax.grad(lambda k: jnp.sum(jax.lax.conv(x, k, (1,), "SAME")))(kernel)

    def nested(x, kernel):  # The convolution inside a `jit` and a `cond`.
        inner = jax.jit(lambda a, b: jax.lax.conv(a, b, (1,), "SAME"))
        return jax.lax.cond(True, inner, lambda a, b: a, x, kernel)

    x, kernel = jnp.ones((1, 1, 6)), jnp.ones((1, 1, 3))
    conv = "conv_general_dilated"
    for fn in (conv_step, nested):
        assert has_primitive(jax.make_jaxpr(fn)(x, kernel).jaxpr, conv)
    dense = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((3, 2)))
    assert not has_primitive(dense.jaxpr, conv)


def test_state_a_step_leaves_unchanged_is_the_programs_input():
    """So an evaluate group copies no weights (host-memory state: no copy back).

    `lax.scan` forwards a carry its body returns unchanged (JAX's own
    forwarding, which `FusedSteps` relies on; this pins it across upgrades).
    """

    def step(state, batch):  # Changes the counter, returns the weights as given.
        weights, count = state
        return jnp.sum(batch @ weights), (weights, count + 1)

    fused = FusedSteps(step, jax.jit, steps=3, concatenate=False, keras_loop=None)
    batches = [jnp.full((2, 4), float(i)) for i in range(3)]
    group = group_of(batches)
    state = (jnp.ones((4, 3)), jnp.zeros((), jnp.int32))
    program = fused._fused(group)
    jaxpr = jax.make_jaxpr(program)(state, group.shared, group.varying).jaxpr
    weights_in, count_in = jaxpr.invars[:2]
    _, weights_out, count_out = jaxpr.outvars
    assert weights_out is weights_in  # Passed through, not a scan output.
    assert count_out is not count_in
    loss, (weights, count) = jax.jit(program)(state, group.shared, group.varying)
    assert int(count) == 3 and float(loss) == 2 * 4 * 3 * 2.0
    np.testing.assert_array_equal(weights, state[0])


def test_central_storage_evaluate_group_returns_its_host_weights_uncopied(
    monkeypatch,
):
    """In the compiled HLO: an evaluate group's weights are its parameters.

    CentralStorage keeps the weights in host memory (`S(5)` in XLA's
    layouts). The fused evaluate program's weight outputs are its weight
    parameters themselves, aliased to them: no copy back. The fused fit
    program's are computed (the control: the check sees a changed weight).
    Measured: the evaluate group's HLO returns all 8 weights of the model
    (Dense, BatchNormalization, Dense) as its parameters 0-7.
    """
    from keras_dist._seams import _trainer as _loop

    programs = []  # (step name, jitted, its first call's argument types).
    original = _loop._originals["jit"]

    def recording_jit(fun, *args, **kwargs):
        jitted = original(fun, *args, **kwargs)
        called = []

        def call(*call_args):
            if not called:
                called.append(True)
                types = jax.tree.map(_type_of, call_args)
                programs.append((fun.__name__, jitted, types))
            return jitted(*call_args)

        return call

    monkeypatch.setitem(_loop._originals, "jit", recording_jit)
    strategy = STRATEGIES["central_storage"]()
    x, y, _ = make_data(64, seed=0)
    with strategy.scope():
        model = make_model(batch_norm=True)  # Non-trainable weights too.
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=4,
        )
    model.evaluate(x, y, batch_size=8, verbose=0)
    model.fit(x, y, batch_size=8, verbose=0)
    fused = [p[1:] for p in programs if p[0] == "fused"]
    assert len(fused) == 2  # Evaluate's group program, then fit's.
    weights = len(model.trainable_variables) + len(model.non_trainable_variables)
    for (jitted, types), changes in zip(fused, (False, True), strict=True):
        hlo = jitted.lower(*types).compile().as_text()
        params, root, aliases = _entry(hlo)
        assert all(":S(5)" in params[i][1] for i in range(weights))  # Host memory.
        for i in range(weights):  # Output 0: the loss; then the state.
            passed = root[1 + i] == params[i][0]
            assert passed is not changes, (i, root[1 + i], params[i])
            if not changes:  # And given back in the parameter's own buffer.
                assert f"{{{1 + i}}}: ({i}, {{}}" in aliases, aliases


def _type_of(leaf):
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


def _entry(hlo: str) -> tuple[list, list, str]:
    """`(params, root, aliases)` of a compiled HLO module's entry computation.

    `params[i]`: parameter i's `(name, layout)`; `root`: the names in the
    entry's ROOT tuple; `aliases`: the module's `input_output_alias`.
    """
    header = hlo.splitlines()[0]
    aliases = header.split("input_output_alias=")[1] if "alias=" in header else ""
    inputs = header.split("entry_computation_layout={(")[1].split(")->")[0]
    layouts = _top_level(inputs)
    entry = hlo[hlo.index("\nENTRY") :].splitlines()
    names = {}
    for line in entry:
        if " parameter(" in line:
            name, rest = line.strip().split(" = ", 1)
            names[int(rest.split(" parameter(")[1].split(")")[0])] = name
    (root,) = [line for line in entry if line.strip().startswith("ROOT")]
    operands = root.split(" tuple(")[1].rsplit(")", 1)[0]
    root_names = [op.split("*/")[-1].strip() for op in _top_level(operands)]
    params = [(names[i], layout) for i, layout in enumerate(layouts)]
    return params, root_names, aliases


def _top_level(text: str) -> list[str]:
    """`text` split at its commas outside brackets and braces."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "[{(") - (char in "]})")
        if char == "," and not depth:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


# 4. Callbacks ----------------------------------------------------------------


class _BatchLogs(keras.callbacks.Callback):
    """Every batch-level callback call: (hook, batch, logs as floats)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def _log(self, hook, batch, logs):
        floats = {k: float(np.asarray(v)) for k, v in (logs or {}).items()}
        self.calls.append((hook, batch, floats))

    def on_train_batch_begin(self, batch, logs=None):
        self._log("train_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._log("train_end", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._log("test_end", batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._log("predict_end", batch, {})  # The outputs: test 1.


def test_batch_callbacks_see_keras_batches_and_logs():
    logged = []
    for name in (None, "mirrored"):
        spy = _BatchLogs()
        _run(name, "numpy", CASES["37_rows_spe_4"], callbacks=[spy])
        logged.append(spy.calls)
    expected, got = logged
    # Once per group, numbered as Keras does: the last step of the group.
    group_calls = [("train_begin", 0), ("train_end", 3)]
    group_calls += [("train_begin", 4), ("train_end", 7)]
    assert [(hook, batch) for hook, batch, _ in got] == [
        *group_calls * 2,  # 2 epochs.
        ("test_end", 3),
        ("test_end", 7),
        ("predict_end", 3),
        ("predict_end", 7),
    ]
    assert [(hook, batch, sorted(logs)) for hook, batch, logs in got] == [
        (hook, batch, sorted(logs)) for hook, batch, logs in expected
    ]
    for (hook, batch, want), (_, _, have) in zip(expected, got, strict=True):
        for key in want:
            np.testing.assert_allclose(
                have[key], want[key], rtol=RTOL, atol=ATOL, err_msg=f"{hook} {batch}"
            )


# 5. Exact resume at a group boundary -----------------------------------------


def _resumable_fit(rows: int, *callbacks):
    net = _model(_strategy("mirrored"), 4)
    keras.utils.set_random_seed(11)
    x, y, _ = make_data(rows)
    history = net.fit(
        x, y, batch_size=8, epochs=3, shuffle=True, callbacks=list(callbacks),
        verbose=0,
    ).history  # fmt: skip
    return net, history


def test_backup_and_restore_resumes_at_a_group_boundary(tmp_path, capsys):
    # 5 steps an epoch (the last one a partial batch), 4 a group: step 9 ends
    # epoch 2's fused group. The resumed fit skips its 4 batches, runs the
    # partial one through Keras's loop, then epoch 3 fused.
    backup = kd.callbacks.BackupAndRestore(tmp_path, save_freq=1)
    with pytest.raises(RuntimeError, match="interrupted at step 9"):
        _resumable_fit(37, backup, InterruptAt(9))
    net, history = _resumable_fit(37, kd.callbacks.BackupAndRestore(tmp_path))
    assert "resuming at epoch 2, step 4" in capsys.readouterr().out
    expected, expected_history = _resumable_fit(37)
    assert int(np.asarray(net.optimizer.iterations)) == 15
    assert_weights_close(
        expected.get_weights(), net.get_weights(), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
        history["loss"], expected_history["loss"][1:], rtol=RTOL, atol=ATOL
    )


# 6. The option is checked ----------------------------------------------------


def test_fuse_steps_must_be_a_bool():
    with pytest.raises(ValueError, match=r"`fuse_steps`.*fuse_steps='yes'"):
        kd.InputOptions(fuse_steps="yes")


# 7. Without jit: Keras's loop of eager steps ---------------------------------


@pytest.mark.parametrize(
    "mode",
    [(("run_eagerly", True),), (("jit_compile", False),)],
    ids=["run_eagerly", "jit_compile=False"],
)
def test_steps_without_jit_equal_keras(dispatches, mode):
    spy = _PerCall(dispatches)
    got = _run("mirrored", "numpy", CASES["37_rows_spe_4"], mode=mode, callbacks=[spy])
    assert spy.calls == dict.fromkeys(("fit", "evaluate", "predict"), (0, 0))
    # Plain Keras's compiled steps (its eager ones give the same numbers, as
    # tests/test_keras_parity.py checks; the first eager run costs seconds).
    _assert_same(_keras("numpy", "37_rows_spe_4"), got, str(mode))


# 8. Gradient accumulation ----------------------------------------------------


def test_gradient_accumulation_fused_equals_loop_and_keras():
    def optimizer():
        return keras.optimizers.SGD(0.1, momentum=0.5, gradient_accumulation_steps=2)

    case = Case(64, 8, 4)  # 8 micro-batches an epoch: 4 updates.
    fused, loop = (
        _run("zero1", "numpy", case, fuse=fuse, optimizer=optimizer())
        for fuse in (True, False)
    )
    _assert_same(loop, fused, "fuse_steps=False")
    _assert_same(_run(None, "numpy", case, optimizer=optimizer()), fused, "Keras")
