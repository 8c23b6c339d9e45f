"""2 workers train with ModelCheckpoint; the evaluator (keras-dist-run
--evaluator) runs a SidecarEvaluator on their checkpoints.

Args: a work directory. The evaluator writes `evaluations.json` and `eval.csv`
(with KD_EVALUATOR_FAILS set it raises at once instead).
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

sys.modules["tensorflow"] = None  # type: ignore[assignment]  # No tf.data: kill_script.py
import keras  # noqa: E402

import keras_dist as kd  # noqa: E402

workdir = sys.argv[1]
resolver = kd.cluster.resolve()
if resolver.task_type == "evaluator":
    kd.cluster.initialize()  # Joins nothing: the evaluator runs locally.
    if os.environ.get("KD_EVALUATOR_FAILS"):
        raise RuntimeError("the evaluator fails on purpose")
    from tests.callbacks._sidecar import XV, YV, evaluator_model

    evaluator = kd.callbacks.SidecarEvaluator(
        evaluator_model(),
        (XV, YV),
        os.path.join(workdir, "ckpts"),
        callbacks=[keras.callbacks.CSVLogger(os.path.join(workdir, "eval.csv"))],
        idle_timeout=60,
        poll_interval=0.1,
    )
    evaluator.start()
    with open(os.path.join(workdir, "evaluations.json"), "w") as f:
        json.dump(evaluator.history, f)
else:
    strategy = kd.MultiWorkerMirroredStrategy()
    from tests._helpers import build_in_scope, initial_weights
    from tests.callbacks._sidecar import X, Y

    model = build_in_scope(strategy, initial_weights())
    checkpoint = kd.callbacks.ModelCheckpoint(
        os.path.join(workdir, "ckpts", "ckpt_{epoch}"), save_weights_only=True
    )
    model.fit(X, Y, batch_size=8, epochs=3, verbose=0, callbacks=[checkpoint])
    print(f"rank {strategy.process_id} trained", flush=True)
