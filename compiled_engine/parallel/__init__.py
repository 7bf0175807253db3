"""Process groups and the TP ranks' parallel state (below the layers that shard weights)."""
