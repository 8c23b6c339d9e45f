"""PreemptionCheckpointHandler: save at the agreed run, exact restart."""

import signal
import time

import pytest

import keras_dist as kd
from tests._helpers import assert_weights_close, mirrored
from tests.failure_handling import _loop


@pytest.fixture(scope="module")
def uninterrupted():
    return _loop.train(mirrored(4))


class _Manager:
    """A manager (save/restore) that records what it was asked."""

    def __init__(self, restored=None):
        self.saved, self.restored = [], restored

    def save(self, number, meta):
        self.saved.append((number, meta["total_run_calls"]))

    def restore(self):
        return self.restored


def test_sigterm_saves_exits_and_a_restart_resumes_exactly(tmp_path, uninterrupted):
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        _loop.train(mirrored(4), _loop.handler_in(tmp_path), kill_at=5)
    assert exited.value.code == 42  # tf's default exit code.
    assert signal.getsignal(signal.SIGTERM) is not previous  # Still watching.
    signal.signal(signal.SIGTERM, previous)
    # The restart: the same loop, the same directory, no signal.
    resumed_at = []

    def make(model):
        handler = _loop.handler_in(tmp_path)(model)
        resumed_at.append(handler.total_run_calls)
        return handler

    weights = _loop.train(mirrored(4), make)
    assert resumed_at == [5]  # SIGTERM during run 5: saved after it.
    assert_weights_close(uninterrupted, weights)
    assert signal.getsignal(signal.SIGTERM) is previous  # close() gave it back.


def test_the_restart_reads_total_run_calls(tmp_path):
    with pytest.raises(SystemExit):
        _loop.train(mirrored(4), _loop.handler_in(tmp_path), kill_at=5)
    model = _loop.build_in_scope(mirrored(4), _loop.initial_weights())
    handler = kd.PreemptionCheckpointHandler(None, model, tmp_path)
    assert handler.total_run_calls == 5
    handler.close()


def test_a_watcher_fn_and_an_exit_fn_that_returns(uninterrupted):
    manager, exits = _Manager(), []
    config = kd.TerminationConfig(
        termination_watcher_fn=lambda: len(manager.saved) == 0 and calls() >= 3,
        exit_fn=lambda: exits.append(True),
    )
    handler = kd.PreemptionCheckpointHandler(None, manager, termination_config=config)

    def calls():
        return handler.total_run_calls

    for _ in range(6):
        handler.run(lambda: None)
    assert manager.saved == [(3, 3)]  # Once: the notice is used up.
    assert exits == [True]
    assert handler.total_run_calls == 6
    handler.close()


def test_a_grace_period_trains_on_then_saves_again():
    manager, exits, saves = _Manager(), [], []
    config = kd.TerminationConfig(
        exit_fn=lambda: exits.append(len(manager.saved)),
        grace_period=0.5,
        save_fn=lambda: saves.append(True),
    )
    handler = kd.PreemptionCheckpointHandler(None, manager, termination_config=config)
    for run in range(40):
        if run == 2:
            signal.raise_signal(signal.SIGTERM)
        handler.run(time.sleep, 0.02)
    handler.close()
    first, final = manager.saved
    assert first == (3, 3)
    assert 10 <= final[0] - first[0] <= 26  # ~0.5 s of 0.02 s runs.
    assert exits == [2] and len(saves) == 2


def test_a_manager_restores_total_run_calls():
    handler = kd.PreemptionCheckpointHandler(
        None, _Manager(restored={"total_run_calls": 7})
    )
    assert handler.total_run_calls == 7
    handler.close()


def test_bad_arguments(tmp_path):
    model = _loop.build_in_scope(mirrored(2), _loop.initial_weights())
    with pytest.raises(ValueError, match=r"`checkpoint_dir` is needed"):
        kd.PreemptionCheckpointHandler(None, model)
    with pytest.raises(TypeError, match=r"Received: dict\."):
        kd.PreemptionCheckpointHandler(None, {}, tmp_path)
    with pytest.raises(TypeError, match="`termination_config` must be"):
        kd.PreemptionCheckpointHandler(None, _Manager(), termination_config={})
    with pytest.raises(ValueError, match=r"Received: local_dir='.*' with a _Manager"):
        kd.PreemptionCheckpointHandler(None, _Manager(), local_dir=tmp_path)
    with pytest.raises(ValueError, match=r"Received: local_save_freq=0"):
        kd.PreemptionCheckpointHandler(
            None, model, tmp_path, local_dir=tmp_path / "l", local_save_freq=0
        )
    with pytest.raises(ValueError, match=r"grace_period=-1"):
        kd.TerminationConfig(grace_period=-1)
    with pytest.raises(TypeError, match=r"exit_fn=42"):
        kd.TerminationConfig(exit_fn=42)
    evaluator = kd.cluster.TFConfigClusterResolver(
        tf_config={
            "cluster": {"worker": ["127.0.0.1:1"], "evaluator": ["127.0.0.1:2"]},
            "task": {"type": "evaluator", "index": 0},
        }
    )
    with pytest.raises(ValueError, match="outside the training cluster"):
        kd.PreemptionCheckpointHandler(evaluator, _Manager())
