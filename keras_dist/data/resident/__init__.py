"""The device-resident source: in-memory arrays laid out on the mesh once.

The dataset and its layout (a copy, blocks, rows), a pass over it
(`ResidentPass`), and the batch the step gathers (`ResidentBatch`).
"""
