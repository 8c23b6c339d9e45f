"""The replica API: `run`, `reduce`, `gather`, `ReplicaContext`, `PerReplica`.

What a tf.distribute custom training loop calls, and the `StrategyParts`
protocol it reads a strategy through.
"""
