"""Drivers and fixtures both the tests and the benchmarks use, so neither imports the other: the
offline retention drivers (``drivers``), the in-process retention runs (``kv_runs``), prefix-cache
traces and their replay through the cache manager (``traces``, ``prefix_replay``), budget shapes
(``budget_shapes``), the Kubernetes API emulator (``k8s_emulator``) and the operator harness
(``operator_harness``), GPT-2's byte table (``gpt2_bytes``).

May import the shipped packages (``confkv_api``, ``confkv_engine``, ``confkv_agent``,
``confkv_operator``); never ``tests`` or ``bench``.
"""
