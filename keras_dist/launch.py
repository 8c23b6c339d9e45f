"""`keras-dist-run` (its code is in the light `keras_dist_run` package).

`keras_dist_run` imports neither JAX nor Keras, so usage errors are reported
at once; `python -m keras_dist_run -n 2 train.py` does the same as
`keras-dist-run`. This module keeps the old import path working.
"""

from keras_dist_run import GRACE_SECONDS, POLL_SECONDS, free_port, main

__all__ = ["GRACE_SECONDS", "POLL_SECONDS", "free_port", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
