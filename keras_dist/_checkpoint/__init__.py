"""Checkpoints: the one save pipeline (`pipeline.py`) and the callbacks that
use it (`model_checkpoint.py`, `backup_and_restore.py`), writing three
formats through the libraries made for them: `.weights.h5` / `.keras` by
Keras's own saving code (`_keras_compat/_saving.py`), Orbax checkpoints in
`keras.callbacks.OrbaxCheckpoint`'s layout (`orbax_store.py`), and the
`checkpoint` index (`lookup.py`).
"""
