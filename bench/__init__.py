"""Benchmarks, not tests: five suites, each a folder of modules run with ``python -m`` from the
repository root (``bench/README.md`` lists what each measures, its peer, its command and its time).

Each suite's ``__init__`` lists its quick mode (``QUICK``); ``python -m bench`` runs every suite's
quick mode (``make bench``), ``python -m bench <suite> ...`` some of them. Shared helpers are in
``bench.common``; drivers the tests use too live in ``testkit`` (bench never imports ``tests``, and
``tests`` never imports ``bench``). Results go to ``bench/results/<suite>/``.
"""
