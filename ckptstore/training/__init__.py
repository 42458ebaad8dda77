"""Training-loop integration: CheckpointManager (retention, async saves, many ranks),
collective saves under torch.distributed, RNG state, and the Lightning plugin."""
