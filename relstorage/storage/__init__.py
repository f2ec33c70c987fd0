"""ZODB semantics on top of the adapters: MVCC, two-phase commit, history."""
from .storage import RelStorage  # noqa: F401
