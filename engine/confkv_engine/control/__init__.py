"""The control room: the gRPC ``confkv.v1.EngineControl`` servicer and the versioned policy store.

Talks to the engine only through ``core.control_api.EngineControlTarget`` (a typed protocol). May
import ``core`` and ``cache`` (device memory); never ``http``.
"""
