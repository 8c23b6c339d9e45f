"""The checkpoint wing: the save pipeline (`pipeline.py`) and its engines,
one a format (`keras_files.py`, `orbax_store.py`), both snapshotting with
`freeze.py`. The callbacks that use it are in `keras_dist/callbacks/`."""
