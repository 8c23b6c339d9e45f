"""Every Keras callback has a rule for several processes.

Chief-only callbacks log or write for all (the others drop them); followers
save the model and write files of their own (the others follow the chief's
saves, `tests/cluster/test_saving_multi_process.py`); the rest write no
files, or coordinate every process themselves (`OrbaxCheckpoint`, run on 2
processes there too). A callback a new Keras adds fails here until it has
one.
"""

import keras

from keras_dist._seams._processes import rule_of

EXPECTED = {
    "BackupAndRestore": "follower",
    "CSVLogger": "chief",
    "EarlyStopping": "every",
    "History": "every",
    "LambdaCallback": "every",
    "LearningRateScheduler": "every",
    "ModelCheckpoint": "follower",
    "OrbaxCheckpoint": "every",
    "ProgbarLogger": "chief",
    "ReduceLROnPlateau": "every",
    "RemoteMonitor": "chief",
    "SwapEMAWeights": "every",
    "TensorBoard": "chief",
    "TerminateOnNaN": "every",
}


def test_every_keras_callback_has_a_rule_with_several_processes():
    found = {
        name: rule_of(kind)
        for name, kind in vars(keras.callbacks).items()
        if isinstance(kind, type)
        and issubclass(kind, keras.callbacks.Callback)
        and kind not in (keras.callbacks.Callback, keras.callbacks.CallbackList)
    }
    assert found == EXPECTED


def test_a_subclass_takes_its_parents_rule_and_keras_dist_callbacks_none():
    import keras_dist as kd

    class Mine(keras.callbacks.ModelCheckpoint):
        pass

    assert rule_of(Mine) == "follower"
    assert rule_of(kd.callbacks.BackupAndRestore) is None
    assert rule_of(kd.callbacks.PrintLR) is None
