"""Tensor parallelism: the model split across ranks (sharding.py), the ranks' processes and the
commands rank 0 sends them each step (workers.py)."""
