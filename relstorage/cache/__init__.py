"""Caches of object states keyed by (oid, tid)."""
