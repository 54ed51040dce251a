"""Contracts shared by the CONF-KV engine, agent and operator."""
