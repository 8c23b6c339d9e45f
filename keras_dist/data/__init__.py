"""The input layer of keras_dist: global-batch semantics for every input."""
