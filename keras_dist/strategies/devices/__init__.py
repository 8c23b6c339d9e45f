"""A strategy's devices: device specs (`"gpu:0"`), the mesh, joining the cluster.

Also the layouts `keras.distribution` asks for (`_any_shape.py`) and a value
laid out across processes (`_lay_out.py`). Where data goes on these
devices is `strategies/placement/`; TPU device order is `keras_dist/tpu/`.
"""
