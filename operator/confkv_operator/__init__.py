"""CONF-KV Kubernetes operator (Kopf)."""
