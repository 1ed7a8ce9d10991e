"""The training loop's parts: data batches, checkpoints, metrics."""
