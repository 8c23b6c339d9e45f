"""The custom loop of the preemption tests, the same in-process and per process.

`train` runs `STEPS` steps of `train_on_batch` on the batch picked by the
handler's `total_run_calls`, so a restarted loop continues where it stopped.
"""

import os
import signal
import time

import numpy as np

import keras_dist as kd
from tests._helpers import build_in_scope, initial_weights, make_data

STEPS, BATCH = 12, 16
X, Y, _ = make_data(STEPS * BATCH, seed=7)


def batch(step: int):
    rows = slice(step * BATCH, (step + 1) * BATCH)
    return X[rows], Y[rows]


def train(strategy, handler_fn=None, *, kill_at=None, step_seconds=0.0, sigkill=None):
    """The weights after STEPS steps; `handler_fn(model)` makes the handler.

    `kill_at`: this process sends itself SIGTERM during that run (1-based).
    `sigkill`: `(run, marker, local_dir)`: it SIGKILLs itself during that run,
    once (the marker file), after the local saves made are on every
    process's storage (`_workload._settled`).
    """
    model = build_in_scope(strategy, initial_weights())
    handler = handler_fn(model) if handler_fn else None

    def step(x, y):
        run = (handler.total_run_calls if handler else 0) + 1
        if run == kill_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if sigkill and run == sigkill[0] and not os.path.exists(sigkill[1]):
            from tests.cluster._workload import _settled

            _settled(sigkill[2])
            with open(sigkill[1], "w") as f:
                f.write("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(step_seconds)
        return model.train_on_batch(x, y)

    if handler is None:
        for i in range(STEPS):
            model.train_on_batch(*batch(i))
        return [np.asarray(w) for w in model.get_weights()]
    while handler.total_run_calls < STEPS:
        handler.run(step, *batch(handler.total_run_calls))
        print(f"run {handler.total_run_calls}", flush=True)
    handler.close()
    return [np.asarray(w) for w in model.get_weights()]


def handler_in(directory, **config):
    def make(model):
        return kd.PreemptionCheckpointHandler(
            None, model, directory, kd.TerminationConfig(**config)
        )

    return make
