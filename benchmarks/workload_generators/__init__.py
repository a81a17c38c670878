"""Generators of the benchmark workloads and of the package's system-prompt sample.

``generate`` builds every file from the hand-written vocabularies beside it (``chat_domains_a``/``_b``,
``chat_pastes``, ``policy_manual``, ``rag_docs``, ``spec_tasks``); ``python -m benchmarks.make_workloads``
writes or checks the committed copies (``benchmarks/data/`` and ``src/kvboost/data/system_prompt.jsonl``).
The benchmarks only read that data, through ``benchmarks.workloads``.
"""
