"""Test instrumentation: a callback that SIGKILLs one process once.

`KD_KILL_RANK` / `KD_KILL_EPOCH` (0-based) name the process and the epoch at
whose beginning it kills itself; the file `killed` in the working
directory marks that it did, so the restarted run goes on.
"""

import os
import signal

import jax
import keras


class _KillAtEpoch(keras.callbacks.Callback):
    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch and not os.path.exists("killed"):
            with open("killed", "w") as f:
                f.write(str(epoch))
            os.kill(os.getpid(), signal.SIGKILL)


def kill_at_epoch() -> list:
    """`[the callback]` in the process `KD_KILL_RANK`, else `[]`."""
    if os.environ.get("KD_KILL_RANK") != str(jax.process_index()):
        return []
    return [_KillAtEpoch(int(os.environ["KD_KILL_EPOCH"]))]
