"""The in-memory store: every operation of the store, held by one process (policy tests,
and a server's contract checked without a database)."""

from gpufleet.store.memory.store import MemoryStore

__all__ = ["MemoryStore"]
