"""Where a strategy keeps variables and optimizer state.

The state layouts (replicated, split: FSDP, ZeRO-1, tf partitioners; host
memory), how a split variable is made and placed part by part, which
strategy a variable belongs to, and the memory report.
"""
