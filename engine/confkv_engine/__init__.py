"""CONF-KV inference engine."""
