"""Benchmarks of the operators against their standard implementations (``peakflat bench``)."""
