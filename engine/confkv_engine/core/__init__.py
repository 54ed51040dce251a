"""The core room: the synchronous engine, its thread-owned async front, the scheduler, sequences,
sampling, stop handling, request parameters and result objects.

May import ``model``, ``cache``, ``attention`` and ``retention``; never ``http`` or ``control``.
"""
