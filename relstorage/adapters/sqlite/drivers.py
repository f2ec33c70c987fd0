"""SQLite driver selection (the standard library's sqlite3 is the only one)."""
from .. import drivers

#: Canonical driver name -> other accepted spellings (case is ignored).
DRIVER_NAMES = {'auto': (), 'sqlite3': ()}


def select_driver(name):
    drivers.canonical_name(DRIVER_NAMES, name, 'SQLite')
    import sqlite3
    return sqlite3


def classify_error(exc):
    """'lock', 'duplicate', 'full' (no room on the disk) or None."""
    import sqlite3
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        if 'locked' in text or 'busy' in text:
            return 'lock'
        # SQLITE_FULL (sqlite_errorcode from Python 3.11 on).
        if getattr(exc, 'sqlite_errorcode', None) == 13 or 'database or disk is full' in text:
            return 'full'
    elif isinstance(exc, sqlite3.IntegrityError) and 'UNIQUE constraint failed' in str(exc):
        return 'duplicate'
    return None
