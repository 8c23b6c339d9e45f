"""One process of a custom loop under PreemptionCheckpointHandler.

Args: a work directory. Writes `pid_<rank>` at start (the test SIGTERMs one
process) and `weights_<rank>.json` when the loop ends; every process prints
"rank R saved at run N" when it saves. KD_STEP_SECONDS slows each step.
KD_LOCAL=K: a local tier every K runs; KD_KILL_RANK / KD_KILL_RUN: that
rank SIGKILLs itself during that run, once. KD_CHECKPOINT_DIR: the
handler's `checkpoint_dir` (default: `<workdir>/ckpt`), e.g. a bucket.
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

sys.modules["tensorflow"] = None  # type: ignore[assignment]  # No tf.data: kill_script.py
import keras_dist as kd  # noqa: E402

strategy = kd.MultiWorkerMirroredStrategy(
    communication_options=kd.CommunicationOptions(timeout_seconds=60)
)

import jax  # noqa: E402

from tests.failure_handling import _loop  # noqa: E402

workdir = sys.argv[1]
rank = jax.process_index()
with open(os.path.join(workdir, f"pid_{rank}"), "w") as f:
    f.write(str(os.getpid()))
handlers = []


def make(model):
    config = kd.TerminationConfig(
        save_fn=lambda: print(
            f"rank {rank} saved at run {handlers[0].total_run_calls}", flush=True
        )
    )
    local = {}
    if "KD_LOCAL" in os.environ:
        local["local_dir"] = os.path.join(workdir, "local")
        local["local_save_freq"] = int(os.environ["KD_LOCAL"])
    handlers.append(
        kd.PreemptionCheckpointHandler(
            strategy.cluster_resolver,
            model,
            os.environ.get("KD_CHECKPOINT_DIR", os.path.join(workdir, "ckpt")),
            config,
            **local,
        )
    )
    print(f"rank {rank} starts at run {handlers[0].total_run_calls}", flush=True)
    return handlers[0]


sigkill = None
if os.environ.get("KD_KILL_RANK") == str(rank):
    marker = os.path.join(workdir, "killed")
    sigkill = (int(os.environ["KD_KILL_RUN"]), marker, os.path.join(workdir, "local"))
weights = _loop.train(
    strategy,
    make,
    step_seconds=float(os.environ.get("KD_STEP_SECONDS", "0")),
    sigkill=sigkill,
)
with open(os.path.join(workdir, f"weights_{rank}.json"), "w") as f:
    json.dump([w.tolist() for w in weights], f)
print(f"rank {rank} done", flush=True)
