"""Benchmark support: workload loaders (data in data/), the cost calculator and plotting/table/JSON helpers.

Nothing here imports torch or transformers, so these modules load fast and are testable without a model.
"""
