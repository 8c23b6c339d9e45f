"""What Keras's training arguments mean under a keras_dist strategy.

Where Keras's JAX backend does something other than its own documentation
says, a keras_dist strategy gives the documented meaning; the seams in
`keras_dist/_seams/` call into these modules.

- `_gradient_accumulation.py`: `gradient_accumulation_steps=N` makes one
  optimizer update per N micro-batches, computed once, with schedules and
  `optimizer.iterations` counted in updates.
- `_fused_steps.py`: `steps_per_execution=N` runs each group of N batches
  as one compiled program (Keras's JAX backend loops over N programs).
"""

__all__: list[str] = []
