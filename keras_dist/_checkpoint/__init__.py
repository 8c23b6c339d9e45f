"""Checkpoints: the one save pipeline and the callbacks that use it.

Every checkpoint keras_dist writes takes one road (`pipeline.py`):

    snapshot on the devices -> one background writer -> atomic commit -> keep policy

in three formats, each written by the library made for it:

- `.weights.h5` / `.keras`: Keras's own saving code (h5py, through Keras's
  `H5IOStore`) from a host snapshot, on `ModelCheckpoint`'s writer thread
  (`_keras_compat/_saving.py`); committed by a rename, kept by
  `max_to_keep` / `keep_period` and listed in the `checkpoint` index;
- Orbax checkpoints in `keras.callbacks.OrbaxCheckpoint`'s layout, for
  `BackupAndRestore`, `ModelCheckpoint(sharded=True)` and
  `PreemptionCheckpointHandler`, in one process or many (`orbax_store.py`):
  Orbax's save (on the writer thread; with several processes its own
  asynchronous save), commit and preservation policies;
- the `checkpoint` index (`lookup.py`), which `latest_checkpoint` and the
  `SidecarEvaluator` read.

The callbacks: `model_checkpoint.py`, `backup_and_restore.py`; both see a
step's end without making `fit` wait for it (`pipeline.StepEnd`).
"""
