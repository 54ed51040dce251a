"""CONF-KV sidecar agent."""
