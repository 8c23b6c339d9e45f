"""`python -m keras_dist_run`: the same as `keras-dist-run`."""

import sys

from keras_dist_run import main

sys.exit(main())
