"""The cache room: the KV block pool and the paged cache that owns block tables and slot metadata.

The only writer of block tables, pool reference counts and slot positions. Imports torch and
``confkv_api`` only; nothing else of the engine imports it except through its public methods.
"""
