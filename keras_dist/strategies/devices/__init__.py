"""The devices of a strategy and what goes onto them.

Device specs (`"gpu:0"`), TPU device order, joining the cluster; the
`Placement` that lays data out on the mesh and paces the programs in flight,
and device-resident datasets (placed once, rows taken in the step, a
shuffled pass exchanged from split rows).
"""
