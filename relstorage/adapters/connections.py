"""A thin wrapper around one DB-API connection and its cursor.

It exists so that every statement goes through one place where driver
errors are translated (``Adapter.translate_error``) and where we know whether
a transaction is open.  Nothing here knows a vendor.

A DBConnection collected while open (its storage instance, pool or adapter
dropped without release/close, e.g. a ZODB connection never closed) closes
its driver connection.  Not in ``__del__``: such an owner usually dies in a
reference cycle (ZODB connection, its objects, its storage instance), and
the collector finalizes the objects of a cycle in no set order, so the
driver's own finalizer could run first and find its connection open (psycopg
3 then warns "deleted while still open").  A ``weakref.finalize`` callback
runs before any finalizer of the cycle, and holds the driver connection
itself, which therefore is not part of the cycle.

A child process forked while connections were open (a web server that
opens the application, and with it ZODB.DB, before it forks its workers:
``gunicorn --preload``, pyramid_zodbconn at startup) inherits them.  Their
sockets (or, for SQLite, file handles and locks) are the parent's too: a
child that went on using them interleaved its statements with the
parent's on one session (seen: PostgreSQL "the last operation didn't
produce records", MySQL "Commands out of sync" and a last tid read as 0,
workers hanging).  So, in a child, every connection open at the fork is
marked broken and *inherited*: its owner replaces it the next time it
needs one, as it does for a connection the server dropped, and the
inherited one is never used again.  What happens to it depends on the
database (``Adapter.set_aside_inherited``): a server connection's socket
is pointed at /dev/null in the child, so that nothing the driver does
with it later (its goodbye to the server when it is freed, at the
child's exit: a helper agent's check saw a worker's normal exit end every
session of its parent, a commit past its vote among them) reaches the
parent's session, and the driver's objects are kept to the child's end;
an SQLite connection is closed at once, before the child opens any of its
own (its locks are per process: the parent's stay; left open, its
in-process record of the locks it held kept the child's log from
starting over), unless it was writing: see the SQLite adapter's
``set_aside_inherited``.
"""
import logging
import os
import weakref

log = logging.getLogger(__name__)


def as_bytes(value):
    """A binary column's value as bytes (drivers may give a memoryview)."""
    if value is None or isinstance(value, bytes):
        return value
    return bytes(value)


def _close_driver(raw, cursor):
    for obj in (cursor, raw):
        try:
            obj.close()
        except Exception:  # pylint:disable=broad-except
            pass


def _finalizer(conn):
    finalizer = weakref.finalize(conn, _close_driver, conn.raw, conn.cursor)
    # Not at interpreter exit: the process ending closes them anyway, and
    # the test suite's leak check looks for what is still open then.
    finalizer.atexit = False
    return finalizer


#: Every DBConnection of the process, for _after_fork_in_child.
_OPEN = weakref.WeakSet()
#: (driver connection, cursor) of the connections a forked child inherited
#: from its parent: never closed, never collected (see the module's doc).
_INHERITED = []


def _after_fork_in_child():
    for conn in list(_OPEN):
        conn.inherited_by_fork()


# (Registered before any adapter's hook, which runs after this one: see
# adapters/base.py.)
os.register_at_fork(after_in_child=_after_fork_in_child)


class DBConnection:
    """One driver connection, used by one storage instance at a time."""

    def __init__(self, adapter, raw, purpose):
        self.adapter = adapter
        self.raw = raw
        self.purpose = purpose            # 'load', 'store' or 'oid': for messages
        self.cursor = raw.cursor()
        self.in_transaction = False
        self.broken = False
        # The parent process's, in a child forked while it was open.
        self.inherited = False
        # Whether the temporary tables may hold rows.  They are
        # transactional: a rollback returns them to their state at the last
        # commit (which may include rows, as the DELETE that emptied them is
        # rolled back too), so we remember that state.
        self.temp_dirty = False
        self._temp_dirty_at_commit = False
        # {temporary table: (rows, bytes) put into it since it was last
        # reset} (Adapter.temp_garbage_rows); as at the last commit, for a
        # rollback (PostgreSQL's TRUNCATE is rolled back too).
        self.temp_garbage = {}
        self._temp_garbage_at_commit = {}
        # Which server (see servers.py): None for the configured one.
        self.server = None
        self.replica = False            # a read-only replica (ro-replica-conf)
        # Whether a read-only replica may serve it (not the pack's reads:
        # Adapter.open_primary_load); kept when it follows a switch.
        self.replicas_allowed = True
        self.server_generation = 0
        # A store transaction left open after a conflict, keeping its row
        # locks for the retry (see storage/commit.py, "Fairness").
        self.holding_locks = False
        # Session settings a vendor hook changed from their configured
        # value and may change back ({name: value}): lost with the driver
        # connection.
        self.session_settings = {}
        self._finalizer = _finalizer(self)
        _OPEN.add(self)

    def inherited_by_fork(self):
        """(In a child process just forked.)  Never use the driver
        connection again (see the module's doc)."""
        if self.inherited:
            return
        self._finalizer.detach()
        self.inherited = self.broken = True
        self.in_transaction = self.holding_locks = False
        try:
            keep = self.adapter.set_aside_inherited(self.raw, self.cursor, self.purpose)
        except Exception:  # pylint:disable=broad-except
            log.debug("Could not set aside an inherited %s connection", self.purpose,
                      exc_info=True)
            keep = True
        if keep:
            _INHERITED.append((self.raw, self.cursor))

    def adopt(self, other):
        """Take over the driver connection of ``other`` (a new connection
        for the same purpose), closing ours: used to move to another
        server between transactions."""
        self.close()
        # Ours now: ``other``'s collection must not close it.
        other._finalizer.detach()
        self.raw, self.cursor = other.raw, other.cursor
        self._finalizer = _finalizer(self)
        self.server, self.replica = other.server, other.replica
        self.server_generation = other.server_generation
        self.in_transaction = self.broken = self.holding_locks = False
        self.inherited = False
        self.temp_dirty = self._temp_dirty_at_commit = False
        self.temp_garbage, self._temp_garbage_at_commit = {}, {}
        self.session_settings = {}

    def _run(self, func, *args):
        if self.inherited:
            # (Held by something that did not look at ``broken``.)
            from ..interfaces import DisconnectedError
            raise DisconnectedError(
                'The %s connection to %s was opened by the parent of this forked '
                'process: a new one is needed' % (self.purpose, self.adapter.describe()))
        try:
            return func(*args)
        except Exception as exc:
            translated = self.adapter.translate_error(exc, self)
            if translated is None:
                raise
            raise translated from exc

    def execute(self, sql, params=()):
        self.in_transaction = True
        return self._run(self.cursor.execute, sql, params)

    def executemany(self, sql, seq):
        self.in_transaction = True
        return self._run(self.cursor.executemany, sql, seq)

    def call(self, func, *args):
        """``func(*args)`` inside the transaction, with driver errors
        translated: for driver-specific calls such as COPY."""
        self.in_transaction = True
        return self._run(func, *args)

    def fetchone(self):
        return self._run(self.cursor.fetchone)

    def fetchall(self):
        return self._run(self.cursor.fetchall)

    def query_one(self, sql, params=()):
        self.execute(sql, params)
        return self.fetchone()

    def query_all(self, sql, params=()):
        self.execute(sql, params)
        return self.fetchall()

    def query_value(self, sql, params=()):
        row = self.query_one(sql, params)
        return None if row is None else row[0]

    def commit(self):
        if self.temp_dirty and self.adapter.temp_rows_survive_commit:
            # Set first: should the COMMIT reach the server and its answer
            # not reach us (an interrupt), the rollback that follows must
            # not believe the committed rows gone.  Clearing a table that
            # is empty costs only a statement.
            self._temp_dirty_at_commit = True
        self._run(self.raw.commit)
        self.in_transaction = self.holding_locks = False
        if not self.adapter.temp_rows_survive_commit:
            self.temp_dirty = False
        self._temp_dirty_at_commit = self.temp_dirty
        self._temp_garbage_at_commit = dict(self.temp_garbage)

    def rollback(self):
        """End the transaction, discarding it; never raises for a dead link."""
        if not self.broken:
            try:
                self.raw.rollback()
            except Exception:  # pylint:disable=broad-except
                # A connection that cannot even roll back is useless: mark it
                # so that its owner replaces it instead of reusing it.
                log.debug("rollback failed on %s connection", self.purpose, exc_info=True)
                self.broken = True
            except BaseException:
                # Interrupted (Ctrl-C, gevent.Timeout): the transaction may
                # still be open on the server, holding its locks.  (The
                # flags below were cleared first: such a session went back
                # to the pool in its transaction, and every writer of the
                # database waited for its locks: a helper agent's check.)
                self.broken = True
                raise
        # (Only now: see above.)
        self.in_transaction = self.holding_locks = False
        self.temp_dirty = self._temp_dirty_at_commit
        self.temp_garbage = dict(self._temp_garbage_at_commit)

    def close(self):
        self.in_transaction = self.holding_locks = False
        self._finalizer.detach()
        if not self.inherited:
            _close_driver(self.raw, self.cursor)
        self.broken = True
