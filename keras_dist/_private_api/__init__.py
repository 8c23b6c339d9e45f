"""Other packages' private names, behind public ones: the fence's ground floor.

What Keras, JAX, TensorFlow and Orbax offer no public route for, read or
written behind functions with public names, and the tables that list every
private name keras_dist uses (`_private.py`, `_jax_seams.py`; checked at
import, the release a name moved to found by `_releases.py`): `_access.py`
(Keras's optimizer, trainer and compile state), `_jax_private.py` (JAX's
cluster state), `_tf_private.py` (tf.data's pipeline), `_orbax_private.py`,
`_keras_saving.py` (Keras's saving walk and file store), `_hooks.py` (Keras
classes whose private steps are overridden, as public hooks). It imports
nothing of keras_dist, so every layer may call it; the seams
(`keras_dist/_seams/`) sit on the top floor.
"""
