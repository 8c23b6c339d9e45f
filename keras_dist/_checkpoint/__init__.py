"""The checkpoint wing, read top to bottom: the save pipeline, the engines.

`pipeline.py` takes a callback's save (`keras_dist/callbacks/`: the
callbacks are where a reader looks for them) through one writer to one of
two engines, one a format: `keras_files.py` (Keras's `.weights.h5` /
`.keras`, written by Keras's own `H5IOStore` through h5py) and
`orbax_store.py` (Orbax checkpoints in `keras.callbacks.OrbaxCheckpoint`'s
layout). Both take their snapshot on the devices with `freeze.py`. One keep
policy, Orbax's, serves both.
"""
