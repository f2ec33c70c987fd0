"""SQLite driver selection (the standard library's sqlite3 is the only one)."""
from ...interfaces import RelStorageError

DRIVER_NAMES = ('auto', 'sqlite3')


def select_driver(name):
    name = name or 'auto'
    if name not in DRIVER_NAMES:
        raise RelStorageError(
            "Unknown SQLite driver %r; choose one of: %s" % (name, ', '.join(DRIVER_NAMES)))
    import sqlite3
    return sqlite3


def classify_error(exc):
    import sqlite3
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        if 'locked' in text or 'busy' in text:
            return 'lock'
    return None
