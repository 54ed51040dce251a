"""Serving suite: this engine over HTTP (and in-process) against transformers ``generate`` and, when
installed, llama.cpp's ``llama-server``, on the same weights and workload (``throughput``); the peers
(``peers``); a locust load file (``locustfile``)."""

QUICK = [["bench.serving.throughput", "--quick"]]
