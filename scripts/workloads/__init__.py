"""Generators of the benchmark workloads (not part of the installed package).

``generate`` builds every file from the hand-written vocabularies beside it (``chat_domains_a``/``_b``,
``chat_pastes``, ``policy_manual``, ``rag_docs``); ``scripts/make_workloads.py`` writes or checks the shipped
copy in ``src/kvboost/bench/data/``. The benchmarks only read that data, through ``kvboost.bench.workloads``.
"""
