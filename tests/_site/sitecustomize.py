"""Python's cyclic garbage collector, run less often in the tests' processes.

`tests/conftest.py` applies this in pytest's processes and puts this folder
first on the PYTHONPATH of the processes the tests start (clusters,
launchers, scripts, the notebooks' kernels; Python imports `sitecustomize`
at start-up), unless `KD_TEST_GC_DEFAULTS=1`. The docs' and examples' runs
set their own PYTHONPATH (most of them `tests/as_installed`, whose
`sitecustomize` hides what their install would not have), so they keep
Python's defaults, as a user runs them.

A collection of the youngest generation every 10,000 container allocations
rather than 700 (the older two as Python's defaults, every 10 of the one
below): importing JAX and Keras and tracing Keras's steps allocate millions
of objects, and with the defaults the collector took 12 % of a test
process's CPU time (`tests/test_fidelity.py`, the compilation cache warm:
2.9-3.3 of 23-27 CPU-seconds; 1.3-1.5 with this), and 0.55 of a small
`fit` script's 4.0-4.8 (0.18-0.21 with this). What is collected is the
same: garbage in reference cycles, a little later. (A test that needs an
object's finalizer to have run calls `gc.collect()`, as it must under
any threshold: `tests/callbacks/test_save_route.py`.)
"""

import gc

THRESHOLDS = (10_000, 10, 10)

gc.set_threshold(*THRESHOLDS)
