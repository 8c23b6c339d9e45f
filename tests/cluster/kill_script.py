"""One process of a 2-process run saving every step, to be SIGKILLed anywhere.

    keras-dist-run -n 2 --devices-per-process 4 kill_script.py WORKDIR

Used by tests/cluster/test_kill_trials.py. Each step: an asynchronous
`BackupAndRestore` backup (each process's Orbax thread writes its parts)
and an asynchronous `ModelCheckpoint` `.weights.h5` (the chief writes it
in the background).
Writes `pid_<rank>` at start (the test kills one of them) and
`weights_<rank>.json` when `fit` ends; KD_STEP_SECONDS slows each step;
KD_SAVE=0 trains the same saving nothing (the reference).
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
# As on a machine without TensorFlow (keras_dist does not need it; NumPy
# input): Keras's `set_random_seed`, which keras_dist calls to agree on a
# seed, would import it (3 s of each of the chain's ~44 process starts).
sys.modules["tensorflow"] = None  # type: ignore[assignment]

import keras_dist as kd  # noqa: E402

strategy = kd.MultiWorkerMirroredStrategy(
    communication_options=kd.CommunicationOptions(timeout_seconds=60)
)

import jax  # noqa: E402

from tests.cluster import _workload  # noqa: E402

workdir = pathlib.Path(sys.argv[1])
rank = jax.process_index()
(workdir / f"pid_{rank}").write_text(str(os.getpid()))
save = os.environ.get("KD_SAVE", "1") == "1"
weights = _workload.kill_trial_run(strategy, str(workdir), save=save)
(workdir / f"weights_{rank}.json").write_text(json.dumps(weights))
print(f"rank {rank} done", flush=True)
