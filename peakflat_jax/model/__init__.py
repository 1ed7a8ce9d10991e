"""The MoP decoder (flax.nnx): layers, attention, the weights' placement on the mesh, its size."""
