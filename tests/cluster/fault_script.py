"""One process of a BackupAndRestore run that may lose a worker.

Args: a work directory; env KD_KILL_RANK / KD_KILL_AT make that rank SIGKILL
itself after that many train steps, once (a marker file remembers it; a
comma list: at each of those global steps, over the restarts; KD_FAULT:
"stop", "hang" or "raise" instead, `_workload._KillAt`);
KD_INPUT picks the input, KD_LOCAL a local tier, KD_SHARD=1 FSDP
(`_workload.backup_run`).
Writes `weights_<rank>.json` when training ends, and `state_<rank>.json`: the
optimizer's variables and the last epoch's logs.
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

if os.environ.get("KD_INPUT", "numpy") == "numpy":
    sys.modules["tensorflow"] = None  # type: ignore[assignment]  # No tf.data: kill_script.py
import keras_dist as kd

strategy = kd.MultiWorkerMirroredStrategy(
    communication_options=kd.CommunicationOptions(timeout_seconds=60),
    shard_variables=os.environ.get("KD_SHARD") == "1",  # FSDP
)

import jax  # noqa: E402

from tests.cluster import _workload  # noqa: E402

workdir = sys.argv[1]
rank = jax.process_index()
kill_at = None
if os.environ.get("KD_KILL_RANK") == str(rank):
    steps = tuple(int(s) for s in os.environ["KD_KILL_AT"].split(","))
    kill_at = steps[0] if len(steps) == 1 else steps
state: dict = {}
weights = _workload.backup_run(
    strategy,
    os.path.join(workdir, "backup"),
    kill_at,
    os.environ.get("KD_INPUT", "numpy"),
    os.environ.get("KD_FAULT", "kill"),
    # KD_LOCAL="K" or "K,wipe": a local tier every K steps (`backup_run`).
    None
    if "KD_LOCAL" not in os.environ
    else (int(os.environ["KD_LOCAL"].split(",")[0]), "wipe" in os.environ["KD_LOCAL"]),
    state=state,
)
with open(os.path.join(workdir, f"weights_{rank}.json"), "w") as f:
    json.dump(weights, f)
with open(os.path.join(workdir, f"state_{rank}.json"), "w") as f:
    json.dump(state, f)  # The optimizer's variables, the last epoch's logs.
print(f"rank {rank} done", flush=True)
