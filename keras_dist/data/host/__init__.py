"""The host path: batches read, checked, padded and laid out one by one.

The pipeline (`InputPass`, its prefetch thread), per-process input
(auto-sharding, process blocks, cross-process checks), tf.data and sparse
inputs.
"""
