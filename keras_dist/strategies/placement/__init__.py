"""Data placement: where a batch goes on a strategy's mesh, and how far ahead.

The `Placement` the input pipeline talks to (through the declared
`InputTarget`): lays batches out over the mesh and paces the programs in
flight (`_placement.py`); device-resident datasets, placed once, their rows
taken in the step (`_resident_placement.py`, `_take_rows.py`), a shuffled
pass exchanged from rows split over the replicas (`_exchange.py`).
"""
