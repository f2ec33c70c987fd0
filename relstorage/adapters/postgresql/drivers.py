"""PostgreSQL drivers: psycopg (version 3) and psycopg2, behind one face.

Everything that differs between the two DB-API modules lives here: how a
connection is opened for each purpose, how a DSN is parsed, how rows are
streamed with COPY, and where an error keeps its SQLSTATE.  The adapter
never imports a driver itself.
"""
import binascii
import importlib
import re
import sys

from ...interfaces import RelStorageError
from .. import drivers

#: Canonical driver name -> other accepted spellings (case is ignored).
DRIVER_NAMES = {'auto': (), 'psycopg': ('psycopg3',), 'psycopg2': ()}

# SQLSTATEs (PostgreSQL manual, appendix A "Error Codes").
LOCK_NOT_AVAILABLE = '55P03'      # lock_timeout expired, or NOWAIT
DEADLOCK_DETECTED = '40P01'
READ_ONLY_TRANSACTION = '25006'
FEATURE_NOT_SUPPORTED = '0A000'
LOCK_STATES = frozenset((LOCK_NOT_AVAILABLE, DEADLOCK_DETECTED))
UNIQUE_VIOLATION = '23505'
INSUFFICIENT_PRIVILEGE = '42501'
UNDEFINED_TABLE = '42P01'
DISK_FULL = '53100'
#: serialization_failure: for a read-only snapshot (a load session), only
#: a hot standby's "conflict with recovery" (it replayed changes, e.g. a
#: pack's deletions and their vacuum, that the snapshot needed).
SERIALIZATION_FAILURE = '40001'
#: admin_shutdown, crash_shutdown, cannot_connect_now,
#: idle_session_timeout (PostgreSQL 14's, often set on managed servers and
#: behind poolers), idle_in_transaction_session_timeout (the server ended
#: the session: see hold_locks); class 08 is added below.
DISCONNECT_STATES = frozenset(('57P01', '57P02', '57P03', '57P05', '25P03'))


#: Server refusals at connect time that pass: (libpq reports them as text,
#: with no SQLSTATE, so the text is all there is to go by.)  "not yet
#: accepting connections": PostgreSQL 15 replaying its log after a crash;
#: "not accepting connections": a standby without hot_standby, or a
#: shutdown in progress.
_TRANSIENT_FATALS = ('starting up', 'shutting down', 'recovery mode',
                     'too many clients', 'terminating connection',
                     'remaining connection slots', 'not yet accepting connections',
                     'not accepting connections')


#: libpq's words for a DSN value it cannot use.
_BAD_DSN = re.compile(r'invalid [\w ]*(?:value|port number|connection option)')

#: ... and for a client's own configuration that the server or libpq
#: refused: no password to give (no passfile, or one it ignores for its
#: mode), certificates that do not verify or cannot be read.  Retrying
#: never helps (a helper agent's check found them retried as transient).
_CLIENT_CONFIG = re.compile(
    r'no password supplied|certificate verify failed|does not match host name'
    r'|root certificate file|could not (?:read|open|load) (?:certificate|private key)'
    r'|private key file|certificate present, but not private key|sslpassword')


def connect_error_is_transient(driver, exc):
    """Whether a failure to connect may go away by itself.

    The server not answering (down, refused, timed out, unknown host) or
    not accepting connections *yet* is transient; the server rejecting us
    (password, unknown database or role, pg_hba) or a malformed DSN is not.
    """
    state = driver.sqlstate(exc)
    if state is not None:
        # 25006, or 0A000 "cannot set transaction read-write mode during
        # recovery" (the read-write transaction a store connection begins
        # to set itself up; matched by its code, the text depends on the
        # server's language): a standby still in recovery, which may be
        # promoted in a moment (failover in progress).
        return (state.startswith('08') or state in DISCONNECT_STATES
                or state in ('53300', READ_ONLY_TRANSACTION, FEATURE_NOT_SUPPORTED))
    if not isinstance(exc, driver.OperationalError):
        return False
    text = str(exc)
    if _BAD_DSN.search(text) or _CLIENT_CONFIG.search(text):
        # libpq refusing a value of the DSN (port=99999, connect_timeout=abc,
        # sslmode=bogus), before any server is asked: a helper agent's
        # check found it a TransientError, which callers retry.
        return False
    if 'FATAL:' in text:
        return any(marker in text for marker in _TRANSIENT_FATALS)
    return True


def select_driver(name):
    """The driver object for ``name`` ('auto', 'psycopg' or 'psycopg2').

    'auto' prefers psycopg2, then psycopg 3: with both installed (as
    ``relstorage[postgresql]`` installs them), psycopg2 was as fast or
    faster in every measure (zodbshootout's phases, within their spread;
    cold reads; random reads from 8 threads of one process, 5,300-5,600
    reads/s against 3,800-4,800 with psycopg 3, whose query path runs
    more Python under the interpreter lock: a helper agent's comparison
    with RelStorage 4.3, which uses psycopg2, confirmed here).  In a
    process gevent has patched, psycopg 3 first: it waits for the server
    through the (patched) selectors, where psycopg2 stops every greenlet
    (drivers.gevent_patched).  A driver named explicitly but not
    importable is an error that says so, rather than a silent fallback.
    """
    name = drivers.canonical_name(DRIVER_NAMES, name, 'PostgreSQL')
    if name == 'auto':
        order = (Psycopg2Driver, Psycopg3Driver)
        if drivers.gevent_patched() or _psycopg2_has_wait_callback():
            # (With a wait callback, psycopg2 uploads without COPY:
            # Psycopg2Driver._insert_rows.)
            order = order[::-1]
        driver, problems = drivers.first_importable(order, label='name')
        if driver is not None:
            return drivers.warn_if_blocking(driver, 'PostgreSQL', 'psycopg')
        raise RelStorageError(
            "No usable PostgreSQL driver is installed: tried %s. Install psycopg "
            "(pip install 'psycopg[binary]') or psycopg2." % '; '.join(problems))
    cls = Psycopg3Driver if name == 'psycopg' else Psycopg2Driver
    try:
        return drivers.warn_if_blocking(cls(), 'PostgreSQL', 'psycopg')
    except drivers.DriverUnusable as exc:
        raise RelStorageError(
            "The PostgreSQL driver %r was configured but cannot be used: %s"
            % (name, exc)) from None
    except ImportError as exc:
        raise RelStorageError(
            "The PostgreSQL driver %r was configured but cannot be imported "
            "(%s). Install it, or set driver to auto." % (name, exc)) from exc


def _psycopg2_has_wait_callback():
    """Whether psycopg2, if imported, has a wait callback installed
    (psycogreen's patch_psycopg, under gevent)."""
    ext = sys.modules.get('psycopg2.extensions')
    return ext is not None and ext.get_wait_callback() is not None


class Driver:
    """What the adapter needs from a driver module."""

    name = None
    module_name = None
    prepares_explicitly = False

    def __init__(self):
        self.module = importlib.import_module(self.module_name)
        self.Error = self.module.Error
        self.OperationalError = self.module.OperationalError
        self.InterfaceError = self.module.InterfaceError

    def __repr__(self):
        return '<PostgreSQL driver %s>' % self.name

    # --- errors -----------------------------------------------------------

    def sqlstate(self, exc):
        raise NotImplementedError

    def classify_error(self, exc):
        """'lock', 'disconnect', 'duplicate', 'permission', 'missing' (a
        table), 'snapshot' (the server cancelled a snapshot), 'full' (its
        disk) or None."""
        if not isinstance(exc, self.Error):
            return None
        state = self.sqlstate(exc)
        if state in LOCK_STATES:
            return 'lock'
        if state == UNIQUE_VIOLATION:
            return 'duplicate'
        if state == INSUFFICIENT_PRIVILEGE:
            return 'permission'
        if state == UNDEFINED_TABLE:
            return 'missing'
        if state == DISK_FULL:
            return 'full'
        if state == SERIALIZATION_FAILURE:
            return 'snapshot'
        if state is not None:
            if state.startswith('08') or state in DISCONNECT_STATES:
                return 'disconnect'
            return None
        # No SQLSTATE: the error comes from the client library, not the
        # server.  For these drivers that means the link is gone (server
        # closed the connection, connection already closed, ...).
        if isinstance(exc, (self.OperationalError, self.InterfaceError)):
            return 'disconnect'
        return None

    # --- DSNs -------------------------------------------------------------

    def parse_dsn(self, dsn):
        """libpq's reading of ``dsn`` (key=value or URI) as a dict."""
        raise NotImplementedError

    def make_dsn(self, params):
        raise NotImplementedError

    # --- connections ------------------------------------------------------

    def connect(self, dsn, purpose, writes=True):
        """A session for ``purpose`` ('load', 'store', 'oid').  A 'store'
        session of a storage that writes nothing (``writes`` false) keeps
        the server's default access mode: a standby refuses read-write
        transactions, and a read-only storage may use one."""
        raise NotImplementedError

    def to_last_result(self, cursor):
        """After a script of several statements, make ``cursor`` fetch the
        last one's result (psycopg2 keeps only that one)."""

    def copy_in(self, cursor, stmt, rows):
        """Stream ``rows`` of (int, int, bytes-or-None) with ``stmt`` (COPY)."""
        raise NotImplementedError

    def copy_new_objects(self, cursor, stmt, ints, rows):
        """Stream ``rows`` of ``ints`` ints then bytes with ``stmt`` (COPY)."""
        raise NotImplementedError


class Psycopg3Driver(Driver):
    name = 'psycopg'
    module_name = 'psycopg'
    gevent_advice = ("patch with gevent before psycopg is first imported: it chooses "
                     "how it waits then")

    @property
    def blocks_gevent(self):
        """psycopg 3 waits through the (patched) selectors when gevent
        patched the process before psycopg was imported; imported before,
        it waits in C or through the unpatched epoll (a review finding: a
        commit waiting for the commit lock then stopped the process)."""
        waiting = importlib.import_module('psycopg.waiting')
        return getattr(getattr(waiting, 'wait', None), '__name__', '') in ('wait_c',
                                                                             'wait_epoll')

    def sqlstate(self, exc):
        return getattr(exc, 'sqlstate', None)

    def parse_dsn(self, dsn):
        from psycopg.conninfo import conninfo_to_dict
        return conninfo_to_dict(dsn)

    def make_dsn(self, params):
        from psycopg.conninfo import make_conninfo
        return make_conninfo('', **params)

    def connect(self, dsn, purpose, writes=True):
        psycopg = self.module
        conn = psycopg.connect(dsn, autocommit=(purpose == 'oid'))
        if conn.info.parameter_status('client_encoding') == 'SQL_ASCII':
            # psycopg 3 gives the text of such a database as bytes (a helper
            # agent's check: the table names read back as bytes, the schema
            # was taken for missing and made again, "zoid_seq already
            # exists", at every open after the first).  Our text is ASCII.
            conn.execute("SET client_encoding TO 'UTF8'")
            if not conn.autocommit:
                conn.commit()
        if purpose == 'load':
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            conn.read_only = True
        elif purpose == 'store':
            conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
            conn.read_only = False if writes else None
        return conn

    def to_last_result(self, cursor):
        # psycopg 3 keeps every result, the first one current.
        while cursor.nextset():
            pass

    def copy_in(self, cursor, stmt, rows):
        self._copy(cursor, stmt, ['int8', 'int8', 'bytea'], rows)

    def copy_new_objects(self, cursor, stmt, ints, rows):
        self._copy(cursor, stmt, ['int8'] * ints + ['bytea'], rows)

    def _copy(self, cursor, stmt, types, rows):
        with cursor.copy(stmt + ' (FORMAT BINARY)') as copy:
            copy.set_types(types)
            for row in rows:
                copy.write_row(row)


class Psycopg2Driver(Driver):
    name = 'psycopg2'
    module_name = 'psycopg2'
    # psycopg2 never prepares on its own (psycopg 3 does after a few
    # executions), so the per-object load is prepared explicitly.
    prepares_explicitly = True

    @property
    def blocks_gevent(self):
        # libpq's waits, in C (drivers.gevent_patched), unless a wait
        # callback (psycogreen's) waits instead.
        return not _psycopg2_has_wait_callback()

    def __init__(self):
        super().__init__()
        import psycopg2.extensions
        ext = psycopg2.extensions

        binary = self.module.BINARY
        fromhex = bytes.fromhex

        def cast_bytes(value, cursor):
            if value is None:
                return None
            if value[:2] == '\\x' and len(value) < _LARGE_HEX:
                # The hex output (bytea_output's default) decoded in one
                # call: a prefetch of 1000 states spent 0.3 ms less than
                # through psycopg2's BINARY and a copy of its buffer.
                return fromhex(value[2:])
            # (A large value is not sliced: a copy of its text, twice the
            # state's size, came on top of the text and the result.)
            return bytes(binary(value, cursor))
        # bytea columns come back as bytes, as with psycopg 3, not memoryview.
        self._bytes_type = ext.new_type(self.module.BINARY.values, 'RS_BYTEA', cast_bytes)
        self._inserts = {}

    def sqlstate(self, exc):
        return getattr(exc, 'pgcode', None)

    def parse_dsn(self, dsn):
        from psycopg2.extensions import parse_dsn
        return parse_dsn(dsn)

    def make_dsn(self, params):
        from psycopg2.extensions import make_dsn
        return make_dsn('', **params)

    def connect(self, dsn, purpose, writes=True):
        ext = self.module.extensions
        conn = self.module.connect(dsn)
        ext.register_type(self._bytes_type, conn)
        if purpose == 'load':
            conn.set_session(isolation_level=ext.ISOLATION_LEVEL_REPEATABLE_READ,
                             readonly=True, autocommit=False)
        elif purpose == 'store':
            conn.set_session(isolation_level=ext.ISOLATION_LEVEL_READ_COMMITTED,
                             readonly=False if writes else 'default', autocommit=False)
        else:
            conn.autocommit = True
        return conn

    def copy_in(self, cursor, stmt, rows):
        if _psycopg2_has_wait_callback():
            return self._insert_rows(cursor, stmt, rows)
        _copy_expert(cursor, stmt, _CopyTextReader(rows))

    def copy_new_objects(self, cursor, stmt, ints, rows):
        if _psycopg2_has_wait_callback():
            return self._insert_rows(cursor, stmt, rows)
        _copy_expert(cursor, stmt, _CopyTextReader(rows, _new_object_line))

    def _insert_rows(self, cursor, stmt, rows):
        """``COPY table (columns) FROM STDIN`` as multi-row INSERTs, for a
        wait callback (psycogreen's patch_psycopg, for gevent), with which
        psycopg2 refuses COPY: helper agents' checks saw every commit fail
        with "copy_expert cannot be used with an asynchronous callback",
        first with the callback installed before the storage opened, then
        (once that was refused) after, in a worker forked from a process
        that opened it, as gunicorn's --preload does.

        psycopg2 spells every value out in the statement (a state in
        hexadecimal, twice its size), and PostgreSQL takes no statement of
        1 GB or more: an INSERT carries at most _INSERT_BYTES of states,
        and a larger state goes in pieces of _INSERT_CHUNK, the first
        inserted, the others appended (a review finding: a commit of 300
        MB failed with "invalid memory alloc request", one of 3 x 180 MB
        took 7.6 GB of client memory and lost its connection)."""
        from psycopg2.extras import execute_values
        plan = self._inserts.get(stmt)
        if plan is None:
            plan = self._inserts[stmt] = _insert_plan(stmt)
        insert, append, key_columns = plan
        page = []
        size = 0
        for row in rows:
            state = row[-1]
            length = 0 if state is None else len(state)
            if page and (size + length > _INSERT_BYTES or len(page) >= _INSERT_PAGE):
                execute_values(cursor, insert, page, page_size=len(page))
                page, size = [], 0
            if length <= _INSERT_CHUNK:
                page.append(row)
                size += length
                continue
            view = memoryview(state)
            execute_values(cursor, insert, [tuple(row[:-1]) + (view[:_INSERT_CHUNK],)])
            key = tuple(row[i] for i in key_columns)
            for start in range(_INSERT_CHUNK, length, _INSERT_CHUNK):
                cursor.execute(append, (view[start:start + _INSERT_CHUNK],) + key)
        if page:
            execute_values(cursor, insert, page, page_size=len(page))


def _insert_plan(stmt):
    """(INSERT with a VALUES list, UPDATE appending to the state, the
    positions of the row's key columns) for a COPY statement of ours,
    whose last column is the state."""
    match = _COPY_STATEMENT.match(stmt)
    table, columns = match.group(1), [c.strip() for c in match.group(2).split(',')]
    keys = [columns.index(name) for name in ('zoid', 'tid') if name in columns]
    state = columns[-1]
    append = 'UPDATE %s SET %s = %s || %%s WHERE %s' % (
        table, state, state, ' AND '.join('%s = %%s' % columns[i] for i in keys))
    return 'INSERT INTO %s (%s) VALUES %%s' % (table, ', '.join(columns)), append, keys


#: A COPY statement of ours: its table and columns.
_COPY_STATEMENT = re.compile(r'^\s*COPY\s+(\w+)\s*\(([^)]*)\)\s+FROM\s+STDIN\s*$', re.I)
#: When COPY cannot be used: rows per INSERT statement, bytes of states
#: per statement, and the pieces a larger state goes in.
_INSERT_PAGE = 100
_INSERT_BYTES = 16 << 20
_INSERT_CHUNK = 64 << 20

#: A bytea value this long in hexadecimal (psycopg2's results), or a
#: state this long (COPY lines), is handled in pieces.
_LARGE_HEX = 2 << 20
_LARGE_STATE = 1 << 20


def _copy_expert(cursor, stmt, reader):
    """psycopg2's COPY from ``reader``.  psycopg2 turns an exception raised
    in the reader into the server's QueryCanceled ("COPY from stdin failed:
    error in .read() call"): a Ctrl-C or a gevent.Timeout during a large
    upload reached the application as that driver error, the interrupt
    itself lost (a helper agent's check).  It is raised as it was."""
    try:
        cursor.copy_expert(stmt, reader)
    except Exception:
        if reader.interrupted is not None:
            raise reader.interrupted from None
        raise


class _CopyTextReader:
    """A file-like object producing COPY text format lazily (for psycopg2).

    bytea values are written in hex (``\\x...``) with the backslash doubled,
    as COPY's text format treats backslash as an escape.  The last value
    of a row is its state: a large one is written a piece at a time as it
    is read (a line made whole held the hex text three times over: 1.2 GB
    for a 200 MB state, in a helper agent's check).
    """

    _pending = None        # (memoryview of a large state, offset written)
    #: An exception (not an Exception: KeyboardInterrupt, gevent.Timeout)
    #: raised while reading, for _copy_expert.
    interrupted = None

    def __init__(self, rows, line=None):
        self._rows = iter(rows)
        self._buf = bytearray()
        if line is not None:
            self._line = line

    @staticmethod
    def _line(row):
        oid, prev_tid, state = row
        if state is None:
            data = b'\\N'
        else:
            data = b'\\\\x' + binascii.hexlify(state)
        return b'%d\t%d\t%s\n' % (oid, prev_tid, data)

    def read(self, size=-1):
        try:
            return self._read(size)
        except Exception:
            raise
        except BaseException as exc:
            self.interrupted = exc
            raise

    def _read(self, size):
        if size is None or size < 0:
            size = 1 << 62
        while len(self._buf) < size:
            if self._pending is not None:
                state, at = self._pending
                self._buf += binascii.hexlify(state[at:at + _LARGE_STATE])
                at += _LARGE_STATE
                if at >= len(state):
                    self._buf += b'\n'
                    self._pending = None
                else:
                    self._pending = state, at
                continue
            row = next(self._rows, None)
            if row is None:
                break
            state = row[-1]
            if state is not None and len(state) > _LARGE_STATE:
                # The line up to its state, then the state in pieces.
                self._buf += self._line(tuple(row[:-1]) + (b'',))[:-1]
                self._pending = memoryview(state), 0
            else:
                self._buf += self._line(row)
        out = bytes(self._buf[:size])
        del self._buf[:size]
        return out


def _new_object_line(row):
    return b'%s\t\\\\x%s\n' % (b'\t'.join([b'%d' % value for value in row[:-1]]),
                                binascii.hexlify(row[-1]))
