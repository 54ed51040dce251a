"""The HTTP room: the FastAPI app, the OpenAI protocol models and formatting, Prometheus metrics.

May import ``core`` (and ``cache`` for device memory); never ``control`` (the server composition
root, ``confkv_engine.server``, wires the two together).
"""
