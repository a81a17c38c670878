"""Benchmarks: the `kvboost bench` commands, their workloads (data/), random-weight model shapes (shapes.py),
the GPU side-by-side run (gpu/), the cost calculator and the plotting/table/JSON helpers.

transformers and matplotlib load inside the functions that use them, so registering the commands (and
`kvboost --help`) stays fast; shapes.py and the command modules can be imported without a model.
"""
