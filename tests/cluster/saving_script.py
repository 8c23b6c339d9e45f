"""One process of a `keras-dist-run -n 2` run of saves that every process calls.

    saving_script.py WORKDIR MODE STRATEGY

MODE `every`: every process calls `model.save_weights`, `model.save` and
`keras.saving.save_model` three times in a row, then fits with Keras's own
`ModelCheckpoint` (weights and `.keras`) and `BackupAndRestore`, and writes
`result_<rank>.json`: what each process found right after each call returned
(the file there, loadable, equal to the model). MODE `chief_save` /
`chief_predict`: only the chief calls `model.save` / `model.predict`; the
others end their program. STRATEGY: `mirrored`, `fsdp` or `zero1`.
"""

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

sys.modules["tensorflow"] = None  # type: ignore[assignment]  # No tf.data: kill_script.py
import keras_dist as kd  # noqa: E402

OPTIONS = kd.CommunicationOptions(timeout_seconds=90)
workdir, mode, name = sys.argv[1], sys.argv[2], sys.argv[3]
strategy = kd.MultiWorkerMirroredStrategy(
    communication_options=OPTIONS,
    shard_variables=name == "fsdp",
    shard_optimizer_state=name == "zero1",
)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests._helpers import build_in_scope, initial_weights, make_data  # noqa: E402

rank = jax.process_index()
x, y, _ = make_data(40)
model = build_in_scope(strategy, initial_weights())
model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def state(m) -> list:
    """Weights and optimizer variables, as host arrays."""
    return [np.asarray(v) for v in (*m.weights, *m.optimizer.variables)]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(p, q) for p, q in zip(a, b, strict=True)
    )


def saved_everywhere() -> dict:
    found: dict = {"weights": [], "model": [], "save_model": []}
    expected = state(model)
    for i in range(3):
        path = os.path.join(workdir, "final.weights.h5")
        model.save_weights(path)
        fresh = build_in_scope(kd.OneDeviceStrategy("cpu:0"), initial_weights())
        fresh.optimizer.build(fresh.trainable_variables)
        fresh.load_weights(path)
        found["weights"].append(
            same(
                [np.asarray(w) for w in fresh.weights],
                [np.asarray(w) for w in model.weights],
            )
        )
        for key, save in (("model", model.save), ("save_model", None)):
            path = os.path.join(workdir, f"final_{key}.keras")
            if save is None:
                keras.saving.save_model(model, path)
            else:
                save(path)
            loaded = keras.models.load_model(path)
            found[key].append(same(state(loaded), expected))
        time.sleep(0.01 * i)
    return found


def fit_with_keras_callbacks() -> list:
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(workdir, "keras_ckpt", "w_{epoch}.weights.h5"),
            save_weights_only=True,
        ),
        keras.callbacks.ModelCheckpoint(
            os.path.join(workdir, "keras_ckpt", "m_{epoch}.keras")
        ),
        keras.callbacks.BackupAndRestore(
            os.path.join(workdir, "keras_backup"), save_freq=2, delete_checkpoint=False
        ),
    ]
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=callbacks)
    return history.history["loss"]


def fit_with_orbax_checkpoint() -> list:
    """Keras's `OrbaxCheckpoint` (Orbax coordinates every process itself)."""
    folder = os.path.join(workdir, "orbax")
    callback = keras.callbacks.OrbaxCheckpoint(folder, save_freq="epoch")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[callback])
    return sorted(os.listdir(folder))


start = time.monotonic()
if mode == "every":
    result = {"saved": saved_everywhere(), "loss": fit_with_keras_callbacks()}
    # The weights the last epoch's checkpoint holds.
    result["weights"] = [w.tolist() for w in model.get_weights()]
    result["orbax"] = fit_with_orbax_checkpoint()
    with open(os.path.join(workdir, f"result_{rank}.json"), "w") as f:
        json.dump(result, f)
elif strategy.is_chief:
    try:
        if mode == "chief_save":
            model.save(os.path.join(workdir, "chief.keras"))
        else:
            model.predict(x, batch_size=8, verbose=0)
    except Exception as error:  # Reported to the test.
        print(
            f"chief: {type(error).__name__} after {time.monotonic() - start:.0f} s: "
            f"{error}",
            flush=True,
        )
        raise SystemExit(3) from error
    print("chief: no error", flush=True)
