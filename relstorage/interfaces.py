"""Exceptions raised by RelStorage, and the contract its adapters follow.

The exception classes sort failures into the three kinds a ZODB application
has to tell apart: retry the transaction (ConflictError subclasses and
DisconnectedError, all ``transaction.interfaces.TransientError``), fix the
configuration (SchemaMismatchError, ConfigurationError) or report a bug
(the rest of StorageError).
"""
import transaction.interfaces
from ZODB.POSException import ConflictError
from ZODB.POSException import ReadConflictError  # noqa: F401 re-exported
from ZODB.POSException import StorageError


class RelStorageError(StorageError):
    """Base class of errors specific to RelStorage."""


class UnableToAcquireLockError(ConflictError):
    """A lock could not be had within ``commit-lock-timeout``.

    A ConflictError, so transaction managers retry it.  The store
    transaction has already been rolled back: nothing stays locked.
    """

    def __init__(self, message, oids=()):
        ConflictError.__init__(self, message)
        self.oids = tuple(oids)
        self._message = message

    def __str__(self):
        return self._message


class UnableToLockRowsError(UnableToAcquireLockError):
    """Timed out or deadlocked while locking the objects being committed."""


class UnableToAcquireCommitLockError(UnableToAcquireLockError):
    """Timed out waiting for the database-wide commit lock."""


class DisconnectedError(RelStorageError, transaction.interfaces.TransientError):
    """The database connection was lost; the next transaction reconnects."""


class SchemaMismatchError(RelStorageError):
    """The database holds a schema other than the one configured."""


class StateTooLargeError(RelStorageError):
    """A pickle is larger than the database server accepts in one packet."""


def describe_oids(oids, limit=10):
    """A short, bounded text naming some OIDs (for error messages)."""
    oids = list(oids)
    shown = ', '.join('0x%x' % o for o in oids[:limit])
    if len(oids) > limit:
        shown += ' and %d more' % (len(oids) - limit)
    return shown
