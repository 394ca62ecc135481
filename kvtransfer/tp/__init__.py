"""Tensor-parallel stages: a rank's share of the KV pools (:mod:`.shards`) and the agent that
serves it to rank 0's sender or receiver (:mod:`.agent`)."""
