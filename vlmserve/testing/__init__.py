"""Small checkpoints built offline, for tests and benchmarks."""
