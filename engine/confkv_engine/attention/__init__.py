"""The attention room: paged attention over the cache, and the retention variant of it.

Reads the cache's tensors and asks the cache to place a step's keys and values; never edits block
tables. May import ``cache`` (and ``model`` for the backend protocol); nothing above it.
"""
