"""Backends of dedupstore: one module per database, reached through the registry."""
