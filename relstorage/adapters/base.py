"""The vendor-neutral half of every adapter.

The storage layer talks to an adapter through the verbs below; each verb
runs statements from ``self.sql`` (see sql.py) on a ``DBConnection``.  A
vendor package subclasses ``Adapter`` and supplies only what differs: how to
connect, its DDL, statement overrides, how to lock rows, and feature flags
such as ``temp_rows_survive_commit``.  There is no ``if vendor ==`` anywhere.
"""
import itertools
import logging
import os
import random
import threading
import weakref


import zope.interface

from ..interfaces import IRelStorageAdapter
from ..interfaces import NewObjectExistsError
from ..interfaces import DatabaseFullError
from ..interfaces import PermissionDeniedError
from ..interfaces import RelStorageError
from ..interfaces import EarlierSchemaError
from ..interfaces import SchemaMismatchError
from ..interfaces import UnableToAcquireCommitLockError
from ..interfaces import UnableToLockRowsError
from ..interfaces import describe_oids
from ..options import BLOB_CHUNK_MAX
from ..options import Options
from .connections import DBConnection
from .connections import as_bytes as _bytes
from ..messages import one_line as _one_line
from .servers import ServerChooser
from .sessions import SessionPool
from .packing import PackVerbs
from .packing import TEMP_TABLE_PRIVILEGE
from .sql import EarlierReleaseReads
from .sql import Statements
from .. import locks
from . import drivers

log = logging.getLogger(__name__)


def chunks(seq, size):
    """Lists of up to ``size`` items of ``seq``, read lazily: a big
    transaction's rows never sit in memory all at once."""
    it = iter(seq)
    while True:
        chunk = list(itertools.islice(it, size))
        if not chunk:
            return
        yield chunk


#: A run of OIDs is read as a range when it has at least RANGE_MIN_OIDS
#: OIDs and its range holds at most RANGE_MAX_SPREAD times as many.
RANGE_MIN_OIDS = 16
RANGE_MAX_SPREAD = 2


def oid_runs(oids):
    """Split ``oids`` into ranges worth reading with BETWEEN and the rest.

    Returns ([(low, high, count)], rest): objects created together have
    neighbouring OIDs and are prefetched together (a container's items, a
    read-ahead), and the server reads such a run as one index range,
    more than twice as fast as looking up each OID of a list (1000 OIDs
    on PostgreSQL: 1.3 ms against 3.3 ms)."""
    ordered = sorted(set(oids))
    runs, rest = [], []
    start = 0
    for i in range(1, len(ordered) + 1):
        if i < len(ordered) and ordered[i] - ordered[i - 1] <= RANGE_MAX_SPREAD:
            continue
        count = i - start
        low, high = ordered[start], ordered[i - 1]
        if count >= RANGE_MIN_OIDS and high - low + 1 <= RANGE_MAX_SPREAD * count:
            runs.append((low, high, count))
        else:
            rest.extend(ordered[start:i])
        start = i
    return runs, rest


def same_database(one, other):
    """Whether two database_identity values name the same database: the
    same names, and start times a second or two apart at most (one read
    from an uptime counter ticks apart from the clock)."""
    if one[:-1] != other[:-1]:
        return False
    if one[-1] is None or other[-1] is None:
        return one[-1] is None and other[-1] is None
    return abs(one[-1] - other[-1]) <= 2



#: Bytes per statement reading a blob chunk in parts (stream_blob_chunk).
BLOB_PART = 16 << 20

#: Tables of the schema RelStorage 3.x and 4.x created that ours never has.
EARLIER_RELEASE_TABLES = frozenset(['commit_row_lock', 'transaction', 'object_refs_added',
                                    'pack_state', 'pack_state_tid'])


def earlier_release_schema(tables):
    """The earlier release's tables among ``tables`` (sorted) when they
    hold the schema RelStorage 3.x or 4.x created, else None.  (Whether
    or not they also have a ``commit_lock``: releases before 3.0 made one,
    without our columns, and a database upgraded since may keep it.)"""
    if 'object_state' not in tables:
        return None
    return sorted(EARLIER_RELEASE_TABLES & tables) or None


@zope.interface.implementer(IRelStorageAdapter)
class Adapter(PackVerbs):
    """Base class of the database adapters."""

    #: Name used in messages and URIs.
    vendor = 'abstract'
    #: What quotes an identifier in the database's SQL ("transaction",
    #: which an earlier release's schema has, is a keyword).
    identifier_quote = '"'
    #: The database's name for people.
    display_name = 'a relational database'
    #: What to do when it has no room left (DatabaseFullError).
    full_hint = 'free disk space on the database server'
    #: zodbconvert into a history-free database copies only the current
    #: records (one ``record_iternext`` per object) instead of replaying
    #: every transaction when the source holds at least this many records
    #: per object, by kind of source.  Measured on the 2-core development
    #: machine with sources of 100,000 objects: a FileStorage's
    #: record_iternext is a random read (about 8 us) where replaying reads
    #: sequentially (about 3 us a record), and PostgreSQL and MariaDB spend
    #: 10 to 20 us writing a record; through ZEO both ways cost about a
    #: round trip per record or object; a history-preserving RelStorage
    #: answers record_iternext with a query per object (about 360 us) where
    #: its iterator reads a whole transaction per query.
    copy_fast_path_thresholds = {'file': 1.5, 'zeo': 1.2, 'relstorage': 30.0}
    #: Paramstyle marker the driver wants instead of ``%s``.
    placeholder = '%s'
    #: How many values one IN (...) list may hold.
    max_in_list = 500
    #: How many values one multi-row INSERT of the pack's analysis may
    #: bind (with placeholders); None: max_in_list.
    max_insert_values = None
    #: Whether IN lists of OIDs are written into the statement's text
    #: (``%d``, integers only) rather than bound one placeholder each: a
    #: driver that binds client-side (mysqlclient, PyMySQL) costs a Python
    #: call per value, several times the formatting.
    oid_lists_as_text = False
    #: Rows per multi-row INSERT when uploading a transaction.
    upload_batch = 200
    #: Whether committers lock the rows they change (lock_objects); False
    #: where a store transaction holds the whole database (SQLite):
    #: lock_objects_checked then has nothing to sort and send.
    locks_rows = True
    statements_class = Statements
    #: Whether rows in the temporary tables outlive a commit (Oracle's
    #: global temporary tables are ON COMMIT DELETE ROWS; elsewhere
    #: clear_temp deletes them).
    temp_rows_survive_commit = True
    #: Where set: once this many rows (or ``temp_garbage_bytes`` bytes)
    #: were put into a temporary table since it was last reset, clear_temp
    #: resets it with the statements ``sql.RESET_TEMP_STORE`` /
    #: ``RESET_TEMP_BLOBS`` instead of deleting its rows.  Neither InnoDB
    #: nor PostgreSQL gives the room of rows deleted from a temporary table
    #: to new rows while the session lives: the table only grows.  Counted
    #: when the rows go in, so that a large commit is followed by a reset,
    #: not by a DELETE of all its rows in the next (small) commit.
    temp_garbage_rows = None
    temp_garbage_bytes = None
    #: A commit's new objects (OIDs this process handed out, stored as new)
    #: go straight into place with insert_new_objects, not through
    #: temp_store, when their states total at most this many bytes (0:
    #: never).  They need no lock and no conflict check, so uploading them
    #: early buys nothing: going straight costs one upload instead of an
    #: upload, a move and the clearing of temp_store (PostgreSQL, 1000
    #: objects of 128 bytes: 8.2 ms against 12.6 with the COMMIT).  But it
    #: runs after the commit lock is taken, which every other commit then
    #: waits for: hence the bound, past which the upload goes before the lock
    #: as for other objects.
    new_rows_direct_bytes = 1 << 20
    #: The largest piece a blob is kept in (blob-chunk-size is brought
    #: down to it): what one value of the database can carry there and
    #: back (see PostgreSQL's).
    blob_chunk_max = BLOB_CHUNK_MAX
    #: A commit whose states total at most this many bytes uploads them
    #: to temp_store once its row locks are taken and its conflicts
    #: resolved (a resolved state goes up once); a larger one uploads
    #: before taking them, so that its upload does not hold the locks of
    #: objects other commits change too (see Commit._vote).
    upload_after_locks_bytes = 1 << 20
    #: The statements creating a session's temp_store and temp_blob_chunk
    #: (IF NOT EXISTS); None where the schema holds them (Oracle's global
    #: temporary tables).
    temp_table_statements = (None, None)
    #: The statements reading the schema of RelStorage 3.x and 4.x (a
    #: mixin over ``statements_class``, see read_earlier_schema); None
    #: where that is not supported.
    earlier_release_reads = EarlierReleaseReads
    #: The largest state (bytes) the database can store and give back, or
    #: None; a larger one is refused when it is stored (Commit._refuse_size),
    #: with ``max_state_reason`` saying why.  (MySQL's limit is the
    #: server's max_allowed_packet, checked as states are uploaded.)
    max_state_bytes = None
    max_state_reason = None
    #: Whether an empty state would be stored as NULL, which reads as "no
    #: object" (Oracle: a zero-length value is NULL): then it is refused
    #: when it is stored (Commit._refuse_size).
    empty_state_is_null = False
    #: Set by prepare_schema: whether the schema has the blob_chunk table.
    has_blob_chunk = False
    #: The database lives on a server (not in a file): replica-conf and
    #: ro-replica-conf apply, and the vendor implements ``connect_to``.
    has_host = False
    #: A line of those files is ``host[:port]``, checked when read (else
    #: it is the vendor's own text, kept whole: an Oracle DSN).
    server_lines_are_host_port = True
    #: The server can end a session that keeps a transaction idle for too
    #: long (``hold_locks``), so a store transaction may stay open after a
    #: conflict to keep its row locks for the retry.  Not where writers
    #: serialize on the whole database (SQLite) or where nothing bounds
    #: an idle transaction.
    holds_locks_for_retry = False

    def __init__(self, options=None):
        self.options = options if options is not None else Options()
        self.keep_history = self.options.keep_history
        self.sql = self.statements_class(self.keep_history)
        self._q_cache = {}
        self._locks_made_with = locks.made_now(self)
        self._oid_lock = threading.Lock()
        self._oid_conn = None
        self._oid_block = []          # preallocated, descending (pop() gives lowest)
        self._fresh_oids = set()      # see claim_fresh_oids
        _ADAPTERS.add(self)
        # Sessions shared by the storage instances (see sessions.py).
        size = self.options.session_pool_size
        self.store_sessions = SessionPool(
            self.open_store, self.session_alive, size, 'store',
            timeout=float(self.options.commit_lock_timeout), describe=self.describe)
        # (Unchecked: a snapshot that finds its session dead begins again
        # on a new one, see RelStorage._ensure_snapshot.)
        self.load_sessions = SessionPool(self.open_load, None, size, 'load',
                                         describe=self.describe)
        if self.has_host:
            # Reads the replica files now: a missing or empty one fails the open.
            self.servers = ServerChooser(self.options, self.describe,
                                         host_port=self.server_lines_are_host_port)
        else:
            for option in ('replica_conf', 'ro_replica_conf'):
                if getattr(self.options, option, None):
                    raise RelStorageError("%s is not supported by the %s adapter"
                                          % (option.replace('_', '-'), self.vendor))
            self.servers = None

    # ------------------------------------------------------------------
    # What a vendor must provide.

    def connect_to(self, server, purpose):
        """Return a new raw driver connection for ``purpose`` to ``server``
        (a ``servers.Server``; None: the configured one).

        'load' connections must give one consistent read-only snapshot
        per transaction; 'store' connections commit at READ COMMITTED (or
        the vendor's equivalent); 'oid' connections autocommit-ish.  A
        server that does not answer raises DisconnectedError (the next
        one is tried), a refusal (password, unknown database) another
        RelStorageError.  Vendors with ``has_host``; others override
        ``connect`` instead.
        """
        raise NotImplementedError

    def connect(self, purpose):
        """A new raw driver connection for ``purpose``, to the server
        chosen for it (see servers.py)."""
        return self._choose(purpose)[0]

    def _choose(self, purpose, replicas=True):
        if self.servers is None:
            return self.connect_to(None, purpose), None, False, 0
        return self.servers.connect(purpose, self.connect_to, replicas)

    def describe(self):
        """Where we connect, for messages (never including a password)."""
        raise NotImplementedError

    def back_after_timeout(self, server):
        """With replica-conf: whether ``server`` is in use again because
        replica-timeout passed on another (not because that one failed)."""
        return self.servers is not None and self.servers.returned_to(server)

    def step_off_server(self, server, reason):
        """With replica-conf: stop using ``server`` (the one in use) for
        the next of the list, until replica-timeout passes; False when
        there is none."""
        return self.servers is not None and self.servers.step_off(server, reason)

    def described_server(self, server):
        """The server a vendor's ``describe(server)`` names: ``server``,
        else, with replica-conf, the one in use (the configured host is
        then not used), else None (the configured one)."""
        if server is None and self.servers is not None:
            return self.servers.current_rw()
        return server

    def schema_statements(self):
        """DDL creating every table for the configured history mode."""
        raise NotImplementedError

    def list_tables(self, conn):
        """Lower-case names of the tables that exist."""
        raise NotImplementedError

    def classify_error(self, exc):
        """'lock', 'disconnect', 'duplicate' (a unique key refused a row) or
        None for an exception raised by the driver."""
        return None

    def ensure_temp_table(self, conn, store=True, blobs=True):
        """Create the per-connection ``temp_store`` (``store``) and
        ``temp_blob_chunk`` (``blobs``) tables if needed."""
        store_sql, blobs_sql = self.temp_table_statements
        if store and store_sql:
            conn.execute(store_sql)
        if blobs and blobs_sql:
            conn.execute(blobs_sql)

    def allocate_oid_block(self, conn):
        """Reserve a block of new OIDs durably; return them as a list of ints."""
        raise NotImplementedError

    def raise_oid_floor(self, conn, max_oid):
        """Make sure OIDs at or below ``max_oid`` are never handed out."""
        raise NotImplementedError

    def lock_objects(self, conn, oids, read_current_oids):
        """Lock the current rows of ``oids`` exclusively and those of
        ``read_current_oids`` shared, in OID order, bounded by
        commit-lock-timeout.  Single-writer vendors need nothing.
        Returns {oid: current tid} of the rows locked when the locking
        statements read it (saving vote the queries of detect_conflicts
        and current_tids), else None."""
        raise NotImplementedError

    def lock_commit(self, conn):
        """Take the database-wide commit lock; return the last committed tid."""
        raise NotImplementedError

    def drop_all(self):
        """Remove every table (tests and ``zodbconvert --clear``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------
    # Hooks with a generic default.

    def begin_snapshot(self, conn):
        """Start the read-only snapshot transaction on a load connection
        (on the server chosen now: see ``follow_server``)."""
        self.follow_server(conn)
        if conn.in_transaction:
            # The last one was not ended (an interrupt in its rollback: a
            # helper agent's check; on PostgreSQL the old snapshot would
            # have gone on, on SQLite BEGIN failed).
            conn.rollback()
        self.start_snapshot(conn)

    def start_snapshot(self, conn):
        """Vendor hook of ``begin_snapshot``."""

    def snapshot_ended(self, conn):
        """Vendor hook: a load connection's snapshot just ended (rolled
        back); called often, so it must cost next to nothing."""

    def begin_store(self, conn, writes_data=True, durable=True):
        """Start the write transaction on a store connection.

        ``writes_data`` is false for a commit that stores no object and no
        blob (an empty transaction or one that only checks readCurrent).
        ``durable`` false: losing this transaction to a power loss (not to
        a process's death) loses nobody's data, so its commit need not wait
        for the disk (a pack's deletion batch); vendors may ignore it."""

    def q(self, sql):
        """``sql`` converted to the driver's paramstyle (cached)."""
        try:
            return self._q_cache[sql]
        except KeyError:
            converted = sql if self.placeholder == '%s' else sql.replace('%s', self.placeholder)
            self._q_cache[sql] = converted
            return converted

    def in_list(self, sql, count):
        return self.q(sql.format(in_list=','.join(['%s'] * count)))

    def oid_statements(self, sql, oids):
        """(statement, params) pairs that run ``sql`` over the OIDs
        ``oids``.  A statement written with ``IN ({in_list})`` runs once
        per ``max_in_list`` OIDs with one placeholder each; one written
        with a single ``%s`` (PostgreSQL's ``= ANY(%s::bigint[])``) runs
        once, with every OID in one array parameter (``oid_array``): the
        server and the driver then parse one short statement instead of a
        long one per chunk.  With ``oid_lists_as_text`` the params are
        None: the statement holds the OIDs."""
        if '{in_list}' not in sql:
            yield self.q(sql), (self.oid_array(oids),)
            return
        for chunk in chunks(oids, self.max_in_list):
            if self.oid_lists_as_text:
                yield sql.format(in_list=','.join(['%d' % oid for oid in chunk])), None
            else:
                yield self.in_list(sql, len(chunk)), chunk

    def oid_array(self, oids):
        """``oids`` as the one parameter of an array statement (see
        oid_statements); vendors whose statements take arrays override."""
        raise NotImplementedError

    def link_lost(self, conn, exc):
        """Whether ``exc``, which classify_error does not place, came with
        the link to the server gone (the driver says ``conn`` is closed)."""
        return False

    def translate_error(self, exc, conn):
        kind = self.classify_error(exc)
        if kind is None and self.link_lost(conn, exc):
            kind = 'disconnect'
        if kind == 'snapshot' and conn.purpose == 'load':
            # A helper agent's check: a hot standby cancelled a snapshot
            # whose rows its replay (a pack's deletions, vacuumed) removed
            # ("conflict with recovery"; max_standby_streaming_delay), and
            # the driver's error reached the application, which
            # transaction managers do not retry.  The session may be gone
            # too: a new one, and the transaction is retried.
            kind = 'disconnect'
        if kind == 'missing' and conn.replica:
            # A helper agent's check: a new database opened with
            # ro-replica-conf before its replica had the schema failed
            # with the driver's "no such table".  The replica is behind:
            # loads go to the primary for a while, as when it does not
            # answer, and this one fails with a transient error (a
            # snapshot about to begin is begun again, there).
            self.servers.replicas_unusable(
                '%s lacks a table of the schema (%s)' % (conn.server, _one_line(exc)))
            kind = 'disconnect'
        if kind in ('disconnect', 'permission', 'full'):
            where = self.describe() if conn.server is None else self.describe(conn.server)
        if kind == 'disconnect':
            from ..interfaces import DisconnectedError
            conn.broken = True
            return DisconnectedError('Lost the %s connection to %s: %s'
                                     % (conn.purpose, where, _one_line(exc)))
        if kind == 'permission':
            # A helper agent's check: a user without rights on the tables
            # got the driver's bare error, naming neither database nor user.
            return PermissionDeniedError(
                '%s refused a statement: %s (a storage needs the rights to read and '
                'write RelStorage\'s tables; a read-only one, to read them)'
                % (where, _one_line(exc)))
        if kind == 'full':
            # A helper agent's check: the driver's bare "database or disk
            # is full" (SQLite, at the move or an OID block), or a line of
            # PostgreSQL's naming a file of its own, told neither which
            # database nor that it was out of room.
            return DatabaseFullError(
                '%s has no room left (%s: %s): %s'
                % (where, type(exc).__name__, _one_line(exc), self.full_hint))
        return None

    def refusal(self, exc):
        """The driver's error if ``exc`` is the database refusing this
        user a statement (raw, or as translate_error gives it), else None."""
        if isinstance(exc, PermissionDeniedError):
            return exc.__cause__ or exc
        if isinstance(exc, self.driver.Error) and self.classify_error(exc) == 'permission':
            return exc
        return None

    # ------------------------------------------------------------------
    # Connections and schema.

    def open_connection(self, purpose, replicas=True):
        """A new DBConnection for ``purpose`` on the server chosen for it
        (for a load, a read-only replica only if ``replicas``)."""
        if self.servers is None:
            return DBConnection(self, self.connect(purpose), purpose)
        raw, server, replica, generation = self._choose(purpose, replicas)
        conn = DBConnection(self, raw, purpose)
        conn.server, conn.replica, conn.server_generation = server, replica, generation
        conn.replicas_allowed = replicas
        return conn

    def open_load(self):
        return self.open_connection('load')

    def open_primary_load(self):
        """A connection for snapshots on the server commits go to, never a
        read-only replica: the pack reads there, as a replica's snapshot
        may be behind what it must see (a pack to now would pack to the
        replica's last transaction)."""
        return self.open_connection('load', replicas=False)

    def database_identity(self):
        """What tells this database apart from every other, as its server
        names it (two spellings of one address give the same), asked of
        the server commits go to: names, then the server's start time in
        seconds or None (see same_database).  zodbconvert refuses to copy a
        database onto itself."""
        conn = self.open_connection('store')
        try:
            row = conn.query_one(self.sql.DATABASE_IDENTITY)
            conn.rollback()
        finally:
            conn.close()
        started = row[-1]
        return ((self.vendor,) + tuple(str(value) for value in row[:-1])
                + (None if started is None else float(started),))

    def refresh_statistics(self):
        """Fresh planner statistics for this release's tables, after a bulk
        load (zodbconvert): until the server's own upkeep gets to them, a
        new database's planner knows nothing of their size (a helper
        agent's check on PostgreSQL: record_iternext scanned the whole
        state table per page, 40 times slower than with statistics).  Where
        the vendor has no ANALYZE_TABLE, nothing."""
        stmt = self.sql.ANALYZE_TABLE
        if not stmt:
            return
        conn = self.open_connection('store')
        try:
            wanted = self.required_tables() | {'blob_chunk'}
            for table in sorted(self.list_tables(conn) & wanted):
                if self.sql.ANALYZE_RETURNS_ROWS:
                    conn.query_all(stmt.format(table=table))
                else:
                    conn.execute(stmt.format(table=table))
            conn.commit()
        finally:
            conn.close()

    def database_key(self, create=True):
        """A random number this database keeps for its life (commit_lock
        row 3), written by the first storage that opens it able to write
        (``create``); None where none is written yet and ``create`` is
        false or the user may not write.  What tells this database's
        entries in a shared cache from every other's (StorageCache): its
        replicas share it, a copy made by zodbconvert or a new database at
        the same place does not."""
        conn = self.open_connection('store')
        try:
            key = conn.query_value(self.q(self.sql.GET_DATABASE_KEY))
            if key is None and create:
                candidate = random.SystemRandom().getrandbits(62) + 1
                try:
                    conn.execute(self.q(self.sql.INSERT_DATABASE_KEY), (candidate,))
                    conn.commit()
                    return candidate
                except Exception as exc:  # pylint:disable=broad-except
                    # Another process wrote it first, or no right to write.
                    conn.rollback()
                    key = conn.query_value(self.q(self.sql.GET_DATABASE_KEY))
                    if key is None:
                        log.warning("Could not write the database key to %s (%s): this "
                                    "process shares the shared cache only with those "
                                    "that could not either", self.describe(),
                                    _one_line(exc))
            conn.rollback()
            return key
        finally:
            conn.close()

    def open_store(self):
        # Its temporary tables come with its first transaction that
        # writes (begin_store_checked): a connection that only ever makes
        # empty or readCurrent-only commits never needs them.
        return self.open_connection('store')

    def prepare_temp_tables(self, conn, blobs=True):
        # (temp_blob_chunk only for blobs kept in the database: each
        # CREATE TEMP TABLE costs PostgreSQL about 3 ms.)
        settings = conn.session_settings
        store = not settings.get('temp_store')
        blobs = blobs and not settings.get('temp_blob_chunk')
        if not (store or blobs):
            return
        own = not conn.in_transaction
        try:
            self.ensure_temp_table(conn, store=store, blobs=blobs)
        except (self.driver.Error, PermissionDeniedError) as exc:
            refused = self.refusal(exc)
            if refused is None:
                raise
            # MySQL's refusal names the database, not the privilege.
            raise RelStorageError(
                "A commit cannot create its temporary tables at %s (%s): the user "
                "needs %s." % (self.describe(), _one_line(refused),
                               TEMP_TABLE_PRIVILEGE)) from refused
        if own:
            # Committed before the caller's transaction begins: DDL is
            # transactional on PostgreSQL and SQLite, and a vote that
            # rolls back must not take the tables with it.
            conn.commit()
            if store:
                settings['temp_store'] = True
            if blobs:
                settings['temp_blob_chunk'] = True
        # (Else, created in the caller's transaction, which may roll them
        # back: the next begin_store_checked makes sure again.)

    def server_moved(self, conn):
        """Whether the server chosen now is not the one ``conn`` is on (a
        failover elsewhere, a replica file edited, replica-timeout over)."""
        servers = self.servers
        return servers is not None and servers.configured and not servers.current(conn)

    def follow_server(self, conn):
        """Between transactions: move ``conn`` to the server chosen now if
        that changed since it connected (``server_moved``).  Nothing is in
        flight on it."""
        if not self.server_moved(conn):
            return
        if conn.purpose == 'store':
            fresh = self.open_store()
        else:
            fresh = self.open_connection(conn.purpose, conn.replicas_allowed)
        conn.adopt(fresh)

    def prepare_schema(self, create=True, read_only=False):
        """Create the schema (when allowed) or verify it; refuse a mode mismatch.

        A mismatch is detected before anything is written, so the database is
        left exactly as it was.
        """
        conn = self.open_connection('store')
        try:
            if not read_only:
                self.check_can_write(conn)
            tables = self.list_tables(conn)
            if 'object_state' not in tables and create and not read_only \
                    and self.begin_schema_creation(conn):
                # Another process may have made it while this one waited.
                tables = self.list_tables(conn)
            earlier = earlier_release_schema(tables)
            if earlier is not None and self._holds_own_schema(conn, tables):
                self._refuse_earlier_additions(conn, tables, earlier)
            if earlier is not None:
                raise EarlierSchemaError(self.describe(), earlier,
                                         'current_object' in tables,
                                         self.earlier_release_reads is not None)
            if 'object_state' in tables:
                if 'commit_lock' not in tables:
                    # (A helper agent's check: another application's table
                    # named object_state was called a history-free schema,
                    # "set keep-history to match".)
                    raise SchemaMismatchError(
                        "The database at %s has a table object_state but no commit_lock "
                        "table: an incomplete RelStorage schema (a creation that was "
                        "interrupted), or another application's database. Nothing was "
                        "changed." % self.describe())
                is_hp = 'current_object' in tables
                if is_hp != self.keep_history:
                    found = 'history-preserving' if is_hp else 'history-free'
                    wanted = 'history-preserving' if self.keep_history else 'history-free'
                    raise SchemaMismatchError(
                        "The database at %s holds a %s RelStorage schema, but this "
                        "storage is configured %s (keep-history %s). Nothing was "
                        "changed. Set keep-history to match, or copy the data into "
                        "a new database with zodbconvert.%s"
                        % (self.describe(), found, wanted,
                           'true' if self.keep_history else 'false',
                           self.hidden_tables_hint('current_object')
                           if self.keep_history else ''))
                missing = self.required_tables() - tables
                if missing and create and not read_only and self.schema_creation_resumable:
                    # A creation cut short, or under way in another process
                    # (Oracle: a review finding).
                    self.create_schema(conn)
                    conn.commit()
                    tables = self.list_tables(conn)
                    missing = self.required_tables() - tables
                if missing:
                    raise SchemaMismatchError(
                        "The RelStorage schema at %s is incomplete (missing: %s).%s"
                        % (self.describe(), ', '.join(sorted(missing)),
                           self.hidden_tables_hint(sorted(missing)[0])))
            elif create and not read_only:
                self.create_schema(conn)
                conn.commit()
            else:
                # (Naming what the configuration says: a helper agent's
                # check saw create-schema blamed where only read-only
                # true was set.)
                raise SchemaMismatchError(
                    "No RelStorage schema at %s, and %s: nothing to read."
                    % (self.describe(), 'the storage is read-only (read-only true)'
                       if read_only else 'create-schema is false'))
            # Blob rows live in blob_chunk; an adapter whose schema predates
            # it still works without blobs.
            self.has_blob_chunk = 'blob_chunk' in self.list_tables(conn)
            conn.rollback()
        finally:
            conn.close()

    def _holds_own_schema(self, conn, tables):
        """Whether ``tables`` (which hold an earlier release's) are this
        release's schema too: ``transaction_log`` (history-preserving), or
        a ``commit_lock`` with this release's rows (releases before 3.0
        made a commit_lock of their own)."""
        if 'transaction_log' in tables:
            return True
        if 'commit_lock' not in tables:
            return False
        try:
            return conn.query_value(self.q(self.sql.LOCK_COMMIT_EXISTS)) is not None
        except Exception:  # pylint:disable=broad-except
            conn.rollback()
            return False

    def _refuse_earlier_additions(self, conn, tables, earlier):
        """A database of this release that a process of RelStorage 3.x or
        4.x opened: it took the tables it knew for its own and added the
        rest (a helper agent's check: this build then called it an earlier
        release's database, and a zodbconvert copy, as the message said,
        copied the earlier release's empty transaction table: nothing, and
        said it succeeded).  Nothing is changed: what to drop is said."""
        added = list(earlier)
        if 'pack_object' in tables:
            try:
                conn.execute('SELECT garbage FROM pack_object WHERE 1 = 0')
            except Exception:  # pylint:disable=broad-except
                conn.rollback()
                # (Made by the earlier release, with its columns: the
                # next pack makes it again.)
                added.append('pack_object')
        triggers = self.foreign_triggers(conn)
        leftovers = self.earlier_leftovers(conn)
        quote = self.identifier_quote
        # (Views first: one may read the tables; triggers before the
        # functions they call.)
        drops = [drop for what, drop in leftovers if what.startswith('view ')]
        drops += ['DROP TABLE %s%s%s;' % (quote, table, quote) for table in added]
        drops += ['DROP TRIGGER %s ON %s;' % (name, table) for name, table in triggers]
        drops += [drop for what, drop in leftovers if not what.startswith('view ')]
        raise SchemaMismatchError(
            "The database at %s holds this release's RelStorage schema and tables an "
            "earlier release (3.x or 4.x) added when one of its processes opened it: %s%s%s. "
            "Nothing was changed, and this release's data is intact. Stop every process "
            "of the earlier release (it reads this database wrongly and cannot commit to "
            "it), then remove what it added: %s"
            % (self.describe(), ', '.join(added),
               ''.join('; trigger %s on %s' % item for item in triggers),
               ''.join('; %s' % what for what, _ in leftovers), ' '.join(drops)))

    def foreign_triggers(self, conn):
        """(trigger, table) of the triggers on this release's tables that it
        did not make (an earlier release's)."""
        return []

    #: The views RelStorage 3.x and 4.x make (seen in databases of this
    #: release a process of 4.3 opened); this release makes none.
    EARLIER_VIEWS = ('current_object_state',)

    def earlier_leftovers(self, conn):
        """(what, DROP statement) of the views and stored routines an
        earlier release added to this database when it took the database
        for its own (a review finding: the refusal's message said only "and
        its functions", naming none)."""
        return []

    #: Whether the database lists to a user only the tables it has some
    #: privilege on (MySQL's information_schema).
    lists_usable_tables_only = False

    def hidden_tables_hint(self, table):
        """What a message about a missing ``table`` adds where the
        database hides tables the user may not use (a helper agent's check:
        a user granted every table but current_object was told the
        database was history-free, "set keep-history to match")."""
        if not self.lists_usable_tables_only:
            return ''
        return (" If the table %s is there, this user has no privilege on it: the "
                "server lists to a user only the tables it may use; check the grants."
                % table)

    def check_can_write(self, conn):
        """Vendor hook, at the opening of a storage that may write, on a
        store session: raise RelStorageError, naming the setting, where
        the server is set up so that its commits would fail."""

    #: Whether create_schema may run again over a part of the schema (it
    #: skips what is there), so that an incomplete one is completed.
    schema_creation_resumable = False

    def create_schema(self, conn):
        """Run the schema's statements on ``conn`` (committed by the caller)."""
        for stmt in self.schema_statements():
            conn.execute(stmt)

    def begin_schema_creation(self, conn):
        """Vendor hook: make the creation of the schema one transaction
        that processes starting at once on a new database take in turn;
        True if it did (the tables are listed again in it)."""
        return False

    def read_earlier_schema(self, keep_history):
        """From now on, read the schema of RelStorage 3.x / 4.x that
        prepare_schema found (``EarlierSchemaError``), in its history mode:
        for a read-only storage that zodbconvert copies from (see
        storage/earlier.py).  Nothing this adapter writes works after it."""
        if self.earlier_release_reads is None:
            raise RelStorageError(
                "Reading the schema of an earlier RelStorage release is not "
                "supported on %s; copy that database with the earlier release's "
                "zodbconvert (into a FileStorage, for example), then from there."
                % self.display_name)
        self.keep_history = keep_history
        vendor = type(self.sql)
        reads = type('EarlierRelease' + vendor.__name__,
                     (self.earlier_release_reads, vendor), {})
        self.sql = reads(keep_history)
        self._q_cache = {}
        self.has_blob_chunk = True

    def required_tables(self):
        names = {'commit_lock', 'object_state'}
        if self.keep_history:
            names |= {'current_object', 'transaction_log'}
        return names

    def session_alive(self, conn):
        """Whether the idle session ``conn`` still answers (one round
        trip); it is left outside any transaction."""
        try:
            conn.query_value(self.sql.PING)
            conn.rollback()
        except Exception:  # pylint:disable=broad-except
            # Whatever the driver says, a session that cannot answer this
            # is no use to a commit.
            return False
        return not conn.broken

    def close(self):
        self.store_sessions.close()
        self.load_sessions.close()
        with self._oid_lock:
            # drop_all closes first: a new schema restarts the counters.
            self._fresh_oids.clear()
            if self._oid_conn is not None:
                self._oid_conn.close()
                self._oid_conn = None

    # ------------------------------------------------------------------
    # OIDs: allocated in durable blocks on a connection of their own, so
    # that allocation never waits for (or rolls back with) a commit.

    def new_oid(self):
        with self._oid_lock:
            if not self._oid_block:
                block = self._on_oid_conn(self.allocate_oid_block)
                self._oid_block = sorted(block, reverse=True)
            oid = self._oid_block.pop()
            fresh = self._fresh_oids
            if len(fresh) >= FRESH_OIDS_MAX:
                # OIDs allocated and never stored (or a huge transaction):
                # forgetting them only costs their commit a lock and a check.
                fresh.clear()
            fresh.add(oid)
            return oid

    def forget_oids(self):
        """Drop the OIDs reserved and not handed out (the database was
        restored from a backup: its counter may hand them out again); the
        next ``new_oid`` reserves a block from the counter as it is now."""
        with self._oid_lock:
            self._oid_block = []
            self._fresh_oids.clear()
            # (A review finding: with the floor kept, an OID drawn before
            # and committed after the restore raised the restored counter
            # past it no more, and it was drawn again.)
            self.forget_oid_floor()

    def forget_oid_floor(self):
        """Vendor hook (under the OID lock): forget how far this process
        knows the counter to be past (which spares ``raise_oid_floor`` its
        query)."""

    def socket_fd(self, raw):
        """The file descriptor of driver connection ``raw``'s socket, or
        None (not known, or no socket)."""
        return None

    #: Whether a process forked while its parent was in a commit (a write
    #: transaction open) may write to the database.
    child_of_a_writer_may_write = True

    def set_aside_inherited(self, raw, cursor, purpose):
        """(In a child process just forked.)  Make the parent's driver
        connection ``raw`` (opened for ``purpose``) harmless to the parent
        (see connections.py); return whether the child must keep it
        referenced to its end.  Here: its socket, in this process,
        becomes /dev/null."""
        fd = self.socket_fd(raw)
        if fd is not None and fd >= 0:
            null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, fd)
            finally:
                os.close(null)
        return True

    def renew_locks(self):
        """Make the locks shared by the storage's instances again, if
        gevent patched the process since (see relstorage/locks.py)."""
        if locks.stale(self):
            self._make_locks()
            # The driver was chosen before (gunicorn's master with
            # --preload): if it waits without letting other greenlets run,
            # say so now (a helper agent's check: a worker froze for
            # commit-lock-timeout, silently).
            label = getattr(getattr(self, 'driver', None), 'gevent_label', None)
            if label is not None:
                drivers.warn_if_blocking(self.driver, *label)
        for name in ('store_sessions', 'load_sessions', 'servers'):
            part = getattr(self, name, None)
            if part is not None:
                part.renew_locks()

    def _make_locks(self):
        """The adapter's own locks, made again after a fork (one may have
        been held by another thread of the parent) and once gevent has
        patched the process (renew_locks)."""
        self._oid_lock = threading.Lock()

    def after_fork_in_child(self):
        """In a child process just forked (os.register_at_fork): forget
        what is the parent's.  The OIDs the parent reserved
        are the parent's (a helper agent's check: two children forked
        from a process that used its database both created objects under
        one OID).  Its connections, the OID connection among them, are
        marked inherited by then (connections.py): replaced at their next
        use, never closed."""
        self._make_locks()
        self._oid_block = []
        self._fresh_oids = set()
        for name in ('store_sessions', 'load_sessions'):
            pool = getattr(self, name, None)     # (an adapter half made)
            if pool is not None:
                pool.after_fork_in_child()

    def claim_fresh_oids(self, oids):
        """The OIDs of ``oids`` that ``new_oid`` handed out in this process
        and that no vote has claimed since, removed from that set.

        OIDs are unique to the allocation: no other transaction can have a
        row for one of them, so a transaction storing such an object as new
        needs neither its row lock nor its conflict check (on an add, that
        is every object).  Claimed once: a later store of the same OID is
        checked like any other."""
        with self._oid_lock:
            fresh = self._fresh_oids
            claimed = fresh.intersection(oids)
            fresh.difference_update(claimed)
        return claimed

    def check_commit_room(self, conn, rows, nbytes):
        """At the end of a vote that wrote ``rows`` rows holding ``nbytes``
        bytes of states and blobs: raise RelStorageError if the COMMIT
        that finish runs could not be written.  A server has written
        everything by then (nothing to check); SQLite has not."""

    def note_oids_used(self, max_oid):
        """Called at commit with the highest OID stored (restore may store
        OIDs we never handed out): no later allocation may reuse it."""
        with self._oid_lock:
            self._on_oid_conn(self.raise_oid_floor, max_oid)
            self._oid_block = [o for o in self._oid_block if o > max_oid]

    def _on_oid_conn(self, func, *args):
        # The OID connection idles between uses: if the server dropped it
        # meanwhile (restart, terminated backend), nothing was in flight on
        # it, so one retry on a new connection is safe.
        from ..interfaces import DisconnectedError
        for attempt in (1, 2):
            conn = self._get_oid_conn()
            try:
                return func(conn, *args)
            except DisconnectedError:
                self._drop_oid_conn()
                if attempt == 2:
                    raise
            except Exception:
                self._drop_oid_conn()
                raise

    def _get_oid_conn(self):
        if (self._oid_conn is not None and self.servers is not None
                and self.servers.configured and not self.servers.current(self._oid_conn)):
            self._drop_oid_conn()
        if self._oid_conn is None or self._oid_conn.broken:
            self._oid_conn = self.open_connection('oid')
        return self._oid_conn

    def _drop_oid_conn(self):
        if self._oid_conn is not None:
            self._oid_conn.close()
            self._oid_conn = None

    # ------------------------------------------------------------------
    # Snapshot reads (load connection).

    def get_last_tid(self, conn):
        return conn.query_value(self.q(self.sql.GET_LAST_TID)) or 0

    @property
    def snapshot_witnesses(self):
        """How many objects snapshot_marks can check (see its statement)."""
        return self.sql.WITNESSES

    def snapshot_marks(self, conn, witnesses=(), seen_tid=0):
        """(last tid, pack mark, {oid: tid} of the objects ``witnesses``
        that exist, whether transaction ``seen_tid`` is there) in the
        snapshot, in one query (at most ``snapshot_witnesses`` objects).
        The last is None where it is not known: history-free, without
        witnesses.  (History-preserving, a restored backup brings a
        witness back with a newer tid when the objects the lost commits
        created are created again under the same OIDs, as the restored
        counter hands them out: a helper agent's check; the transaction
        the witness came from is gone all the same.)"""
        if not witnesses:
            rows = [row + (None,) for row in
                    conn.query_all(self.q(self.sql.GET_SNAPSHOT_MARKS))]
        else:
            count = self.snapshot_witnesses
            oids = list(witnesses)[:count]
            oids += oids[:1] * (count - len(oids))
            if self.keep_history:
                oids.append(seen_tid)
            rows = conn.query_all(self.q(self.sql.GET_SNAPSHOT_MARKS_WITNESS), oids)
        last = mark = 0
        found = {}
        seen_there = False if witnesses and self.keep_history else None
        for row_id, tid, oid in rows:
            if row_id == 0:
                last = tid or 0
            elif row_id == 1:
                mark = tid or 0
            elif row_id == 5:
                seen_there = True
            else:
                found[oid] = tid
        return last, mark, found, seen_there

    def pack_mark(self, conn):
        """The pack mark as the transaction of ``conn`` sees it (0 before
        the first pack)."""
        return conn.query_value(self.q(self.sql.GET_PACK_MARK)) or 0

    def zap_mark(self, conn):
        """The pack mark zap_all last moved the database to, as the
        transaction of ``conn`` sees it (0 if never): the shared cache's
        namespace of states (StorageCache._use_namespace_of)."""
        return conn.query_value(self.q(self.sql.GET_ZAP_MARK)) or 0

    def copy_mark(self, conn):
        """When (seconds since the epoch) a copy into this database began
        that has not finished (set_copy_mark), or None."""
        return conn.query_value(self.q(self.sql.GET_COPY_MARK))

    def unfinished_copy(self, conn):
        """``(began, copied)``: when a copy that has not finished began
        (copy_mark), or None; and the tid of the last transaction
        committed with a tid of its own (note_copied_tid) when none has
        committed after it, or None.  One statement: the pack asks in each
        of its batches."""
        rows = dict(conn.query_all(self.q(self.sql.GET_COPY_STATE)))
        copied = rows.get(7)
        if copied is not None and copied < (rows.get(0) or 0):
            copied = None
        return rows.get(6), copied

    def note_copied_tid(self, conn, tid):
        """In the vote of a transaction begun with a tid of its own (a
        copy's: ZODB's copyTransactionsFromTo, a ZEO client's copy), under
        the commit lock: record ``tid`` as the last one copied
        (unfinished_copy).  Removed with the copy mark (set_copy_mark)."""
        conn.execute(self.q(self.sql.CLEAR_COPIED_TID))
        conn.execute(self.q(self.sql.INSERT_COPIED_TID), (tid,))

    def set_copy_mark(self, conn, started, copied_too=True):
        """Record that a copy into this database began at ``started``
        (seconds since the epoch), unless the mark of an earlier copy not
        finished is there (kept: the refusal says when the copy began, not
        when it was last resumed); return that earlier mark, or None.  With
        ``started`` None, remove the mark, and with ``copied_too`` the tid
        of the last transaction copied (note_copied_tid).  The caller
        commits."""
        if started is None:
            conn.execute(self.q(self.sql.CLEAR_COPY_MARK if copied_too
                                else self.sql.CLEAR_COPY_BEGAN))
            return None
        earlier = self.copy_mark(conn)
        if earlier is None:
            conn.execute(self.q(self.sql.INSERT_COPY_MARK), (int(started),))
        return earlier

    def bump_pack_mark(self, conn):
        """Increment the pack mark, inside the pack's store transaction
        (which holds the commit lock, so two packs cannot race)."""
        old = conn.query_value(self.q(self.sql.GET_PACK_MARK))
        if old is None:
            conn.execute(self.q(self.sql.INSERT_PACK_MARK), (1,))
            return 1
        conn.execute(self.q(self.sql.SET_PACK_MARK), (old + 1,))
        return old + 1

    def poll_changes(self, conn, after_tid, upto_tid, known=None):
        """The newest (oid, tid) change of every object changed in
        (after_tid, upto_tid].

        ``known``: {tid: [oid]} of transactions whose every changed object
        the caller knows (its process's own commits).  The usual poll after
        a commit spans exactly one of them: its rows are then not read
        back (a 1000-object commit's poll read 1000 rows), only the
        ranges of tids on either side of it, where other processes' commits
        would be."""
        mine = [tid for tid in known or () if after_tid < tid <= upto_tid]
        if len(mine) != 1:
            return conn.query_all(self.q(self.sql.POLL_CHANGES), (after_tid, upto_tid))
        tid = mine[0]
        rows = conn.query_all(self.q(self.sql.POLL_CHANGES_AROUND),
                              (after_tid, tid, tid, upto_tid, tid))
        others = [row for row in rows if row[0] is not None]
        # One row (NULL, tid) when the database has transaction tid.
        if not any(oid is None and other == tid for oid, other in rows):
            # The database does not have our transaction (lost in a
            # failover, or a restored backup), or no longer any row of it
            # (history-free, every object changed or removed since): what
            # we stored is not what it holds.  Read every row.
            return conn.query_all(self.q(self.sql.POLL_CHANGES), (after_tid, upto_tid))
        # Another transaction's row is newer than ours for its object
        # (ours would be the row otherwise).
        newest = dict.fromkeys(known[tid], tid)
        for oid, other in others:
            if other > newest.get(oid, 0):
                newest[oid] = other
        return list(newest.items())

    def recent_changes(self, conn, upto_tid, limit):
        """The ``limit`` newest (oid, tid) changes with tid <= upto_tid,
        newest first (one row per object)."""
        return conn.query_all(self.q(self.sql.RECENT_CHANGES), (upto_tid, limit))

    def load_current(self, conn, oid):
        """(state, tid) of the current revision or None; state None = deleted."""
        return conn.query_one(self.q(self.sql.LOAD_CURRENT), (oid,))

    def load_current_many(self, conn, oids):
        result = {}
        runs, rest = oid_runs(oids)
        wanted = None
        for low, high, count in runs:
            rows = conn.query_all(self.q(self.sql.LOAD_CURRENT_RANGE), (low, high))
            if high - low + 1 > count:
                # The range may hold objects not asked for: only those asked.
                if wanted is None:
                    wanted = set(oids)
                rows = [row for row in rows if row[0] in wanted]
            self._add_states(result, rows)
        if rest:
            for stmt, params in self.oid_statements(self.sql.LOAD_CURRENT_MANY, rest):
                self._add_states(result, conn.query_all(stmt, params))
        return result

    @staticmethod
    def _add_states(result, rows):
        for zoid, state, tid in rows:
            # _bytes, inlined: called for every row of a prefetch.
            result[zoid] = (state if state is None or type(state) is bytes
                            else bytes(state), tid)

    def load_revision(self, conn, oid, tid):
        """(True, state) when the revision exists, else (False, None)."""
        row = conn.query_one(self.q(self.sql.LOAD_REVISION), (oid, tid))
        if row is None:
            return False, None
        return True, _bytes(row[0])

    def load_before(self, conn, oid, tid):
        """(state, tid, end_tid) of the revision current just before ``tid``."""
        if self.keep_history:
            row = conn.query_one(self.q(self.sql.LOAD_BEFORE), (oid, tid, oid, tid))
            if row is None:
                return None
            return _bytes(row[0]), row[1], row[2]
        row = self.load_current(conn, oid)
        if row is None or row[1] >= tid:
            return None
        return _bytes(row[0]), row[1], None

    def current_tids(self, conn, oids):
        result = {}
        for stmt, params in self.oid_statements(self.sql.CURRENT_TIDS, oids):
            result.update(conn.query_all(stmt, params))
        return result

    def count_objects(self, conn):
        """len(storage): exact, or the vendor's estimate for a large table
        (see COUNT_ESTIMATE)."""
        sql = self.sql
        if sql.COUNT_ESTIMATE is not None:
            row = conn.query_one(self.q(sql.COUNT_ESTIMATE), (sql.COUNTED_TABLE,))
            if row is not None and row[0] is not None and row[1] is not None \
                    and row[0] >= sql.SMALL_TABLE_BYTES and row[1] >= 0:
                return int(row[1])
        return int(conn.query_value(self.q(sql.COUNT_OBJECTS)) or 0)

    def count_history(self, conn):
        """(revisions, objects), both exact, in the snapshot of ``conn``
        (zodbconvert's estimate of how much history a source holds)."""
        return (conn.query_value(self.q(self.sql.COUNT_REVISIONS)) or 0,
                conn.query_value(self.q(self.sql.COUNT_OBJECTS)) or 0)

    def database_size(self, conn):
        # (MySQL's SUM is a DECIMAL: Zope's control panel divides it by a
        # float.)
        return int(conn.query_value(self.q(self.sql.SIZE_OF_STATES)) or 0)

    # ------------------------------------------------------------------
    # Commit (store connection).

    def upload(self, conn, rows):
        """Put ``(oid, prev_tid, state)`` rows into temp_store in bulk."""
        stmt = self.q(self.sql.INSERT_TEMP)
        for chunk in chunks(rows, self.upload_batch):
            conn.executemany(stmt, chunk)

    def detect_conflicts(self, conn, rows, current=None):
        """(oid, committed_tid, prev_tid) for each ``(oid, prev_tid)`` of
        ``rows`` whose current revision is another one.  The current tids
        come from one primary-key lookup per OID (``current_tids``), not a
        join with temp_store: the planner never analyses a temporary table,
        and its guess made PostgreSQL scan the whole object table, a cost
        growing with the database.  ``current``: {oid: tid} already read
        by ``lock_objects_checked`` (then no query at all)."""
        rows = list(rows)
        if not rows:
            return []
        if current is None:
            current = self.current_tids(conn, [oid for oid, _ in rows])
        return [(oid, current[oid], prev_tid) for oid, prev_tid in rows
                if oid in current and current[oid] != prev_tid]

    def lock_objects_checked(self, conn, oids, read_current_oids):
        """``lock_objects`` with its lock failures reported by OID; returns
        what it returns ({oid: current tid} of the locked rows, or None)."""
        if not self.locks_rows:
            return None
        current = {}
        try:
            for exclusive, run in lock_runs(oids, read_current_oids):
                if exclusive:
                    found = self.lock_objects(conn, run, ())
                else:
                    found = self.lock_objects(conn, (), run)
                if found is None:
                    current = None
                elif current is not None:
                    current.update(found)
        except Exception as exc:
            if self.classify_error(exc) != 'lock':
                raise
            conn.rollback()
            all_oids = sorted(set(oids) | set(read_current_oids))
            raise UnableToLockRowsError(
                "Could not lock objects %s of %s within %ss (lock timeout or deadlock: %s)"
                % (describe_oids(all_oids), self.describe(), self.options.commit_lock_timeout,
                   _one_line(exc)),
                all_oids) from exc
        return current

    def lock_commit_checked(self, conn):
        try:
            return self.lock_commit(conn)
        except Exception as exc:
            self._raise_commit_lock_error(conn, exc)

    def _raise_commit_lock_error(self, conn, exc):
        if self.classify_error(exc) != 'lock':
            raise exc
        conn.rollback()
        # (Not "within N s" alone: a helper agent's check saw a deadlock,
        # broken by the database at once, reported as a 30 s wait.)
        raise UnableToAcquireCommitLockError(
            "Could not acquire the commit lock of %s (commit-lock-timeout %ss, or a "
            "deadlock the database broke): %s"
            % (self.describe(), self.options.commit_lock_timeout, _one_line(exc))) from exc

    def advance_tid(self, conn, now_tid, requested=None):
        """Take the commit lock and publish a new last tid; return it and
        the pack mark as a read after the lock was taken sees it:
        (tid, mark).

        The new tid is ``requested`` (restore) when that is after the last
        committed one, else the later of ``now_tid`` and last + 1: strictly
        greater than every committed tid, whatever the clock says.  Vendors
        with ``ADVANCE_TID`` (a script whose last result is (tid, mark),
        ``now_tid`` written into it) do it in one round trip
        (query_script).  The mark is read after the lock because a pack
        batch moves it on under that lock (see Commit._check_not_removed):
        a read in the statement that waited for the lock could miss the
        batch it waited for.
        """
        try:
            if requested is None and getattr(self.sql, 'ADVANCE_TID', None):
                tid, mark = self.query_script(
                    conn, self.sql.ADVANCE_TID.format(now=int(now_tid)))
                return tid, mark or 0
            last, mark = self.lock_commit_marked(conn)
        except Exception as exc:
            self._raise_commit_lock_error(conn, exc)
        if requested is not None:
            if requested <= last:
                from ZODB.POSException import StorageTransactionError
                raise StorageTransactionError(
                    "Cannot commit transaction %016x: it is not after the last "
                    "committed transaction %016x" % (requested, last))
            tid = requested
        else:
            tid = max(now_tid, last + 1)
        self.set_last_tid(conn, tid)
        return tid, mark

    def lock_commit_marked(self, conn):
        """lock_commit, and the pack mark as a statement run once the lock
        is held sees it: (last tid, mark)."""
        last = self.lock_commit(conn)
        return last, self.pack_mark(conn)

    def query_script(self, conn, script):
        """The first row of the last result of ``script``, statements run
        in one round trip without parameters (vendors whose statements
        include such scripts)."""
        raise NotImplementedError

    def set_last_tid(self, conn, tid):
        """Publish ``tid`` as the last committed one (commit lock held)."""
        conn.execute(self.q(self.sql.SET_LAST_TID), (tid,))

    def commit_outcome(self, tid, has_data):
        """Whether transaction ``tid``, whose COMMIT lost its connection,
        was committed: True, False, or None when that cannot be told.

        History-preserving databases record every transaction.  A
        history-free one has only its rows (which a later commit may
        already have replaced) and the last tid: when that is below
        ``tid``, nothing as late as ours was committed.

        Asked of the server commits go to (a store connection): a replica
        that lags would say no when the primary did commit.  And only once
        this holds the commit lock (waiting up to commit-lock-timeout;
        failing to get it leaves the outcome unknown): the lost session
        holds it until its transaction ends, which may be after the link
        went (its COMMIT still in flight, waiting for a synchronous
        standby or a slow disk).  A helper agent's check: read at once,
        the answer was "not committed" for a transaction PostgreSQL
        committed 0.7 s later.
        """
        lock = self.open_connection('store')
        try:
            self.begin_store(lock, writes_data=False)
            self.lock_commit_checked(lock)
            conn = self.open_connection('store')
            try:
                self.begin_snapshot(conn)
                if self.keep_history:
                    return self.transaction_packed(conn, tid) is not None
                if has_data and conn.query_one(self.q(self.sql.TID_HAS_STATES), (tid,)):
                    return True
                if self.get_last_tid(conn) < tid:
                    return False
                return None
            finally:
                conn.rollback()
                conn.close()
        finally:
            lock.rollback()
            lock.close()

    def lock_hold_seconds(self):
        """How long a store transaction that lost a conflict keeps its
        row locks for the retry (0: not at all)."""
        if not self.holds_locks_for_retry:
            return 0
        return float(getattr(self.options, 'keep_locks_on_conflict', 0) or 0)

    def hold_locks(self, conn, seconds):
        """Leave the store transaction of ``conn`` open with its row locks,
        and have the server end it (rolling back, releasing the locks) when
        it stays idle more than ``seconds``."""
        raise NotImplementedError

    def end_hold(self, conn):
        """Undo ``hold_locks``'s idle limit: the held transaction goes on
        (a retry votes in it) or is about to be rolled back."""
        raise NotImplementedError

    #: Whether the server ends a store session idle in a transaction for
    #: store_idle_seconds.
    ends_idle_store_transactions = False

    def store_idle_seconds(self):
        """How long the server may let a store session sit idle in a
        transaction before it ends the session, which rolls it back and
        releases the commit lock and the row locks it holds (servers that
        can: see set in their store sessions' setup).

        A helper agent's check: a client whose network went silently dead
        after its vote left the commit lock held on the server until the
        server noticed the dead peer (PostgreSQL's keepalives: 2 hours by
        default; MariaDB's wait_timeout: 8 hours), every writer of the
        database failing meanwhile; so does a client that froze.  Between
        its vote and finish a live commit waits for the other participants
        of the transaction: other databases, each waiting at most
        commit-lock-timeout for its lock, but also whatever else joined it
        (a review finding: a data manager slower than the first bound, 60
        s, had the session ended under a voted commit, whose finish then
        failed after the others had committed).  So the bound is long:
        it is for frozen clients and, where the server cannot probe its
        peers (MariaDB), dead networks; PostgreSQL's own keepalives end a
        session whose network died within minutes (connect_to)."""
        return max(STORE_IDLE_MIN, 10 * float(self.options.commit_lock_timeout))

    def begin_store_checked(self, conn, writes_data=True, durable=True, blobs=True):
        """``begin_store`` (on the server chosen now: see
        ``follow_server``); on single-writer databases this waits for the lock."""
        self.follow_server(conn)
        if writes_data:
            self.prepare_temp_tables(conn, blobs)
        try:
            self.begin_store(conn, writes_data, durable)
        except Exception as exc:
            if self.classify_error(exc) != 'lock':
                raise
            conn.rollback()
            raise UnableToAcquireCommitLockError(
                "Could not begin a write transaction on %s within %ss: %s"
                % (self.describe(), self.options.commit_lock_timeout, _one_line(exc))) from exc

    def fix_prev_tids(self, conn):
        """For restore: record each object's current tid as its prev_tid."""
        conn.execute(self.q(self.sql.FIX_PREV_TIDS))

    def move_into_place(self, conn, tid, has_data, user, description, extension,
                        packed=False, all_new=False, some_new=False, new_rows=()):
        """Publish the transaction: states, current pointers, metadata
        (``advance_tid`` has already published the tid itself).
        ``has_data``: temp_store holds rows; ``all_new``: every one of them
        is an object stored as new (prev_tid 0); ``some_new``: some are.
        ``new_rows``: (oid, state) of new objects that skipped temp_store
        (insert_new_objects).  A new object's OID was handed out by this
        process, or the conflict check found no row for it (see
        ``sql.INSERT_NEW_CURRENT``); a row found for one of them after all
        raises NewObjectExistsError."""
        sql = self.sql
        # (History-free, UPDATE_CURRENT is MOVE_FROM_TEMP: see
        # sql.INSERT_NEW_CURRENT.)
        moves = ()
        if has_data:
            moves = (sql.MOVE_FROM_TEMP,) if self.keep_history else ()
            if all_new:
                moves += (sql.INSERT_NEW_CURRENT,)
            elif some_new:
                moves += (sql.INSERT_NEW_CURRENT, sql.UPDATE_OLD_CURRENT)
            else:
                moves += (sql.UPDATE_CURRENT,)
        try:
            if new_rows:
                self.insert_new_objects(conn, tid, new_rows)
            for statement in moves:
                conn.execute(self.q(statement), (tid,))
        except Exception as exc:
            if ((new_rows or all_new or some_new)
                    and self.classify_error(exc) == 'duplicate'):
                raise NewObjectExistsError(
                    "Cannot commit new objects to %s: an object with one of their "
                    "OIDs is already there (were objects copied into the database "
                    "with OIDs it did not allocate?); nothing was written. %s"
                    % (self.describe(), _one_line(exc))) from exc
            raise
        if self.keep_history:
            self.check_metadata_room(user, description, extension)
            conn.execute(self.q(self.sql.INSERT_TRANSACTION),
                         (tid, packed, not (has_data or new_rows), self.binary(user),
                          self.binary(description), self.binary(extension)))

    def check_metadata_room(self, user, description, extension):
        """Vendor hook: raise StateTooLargeError when the transaction's
        metadata (bytes) cannot go to the server in one statement."""

    def insert_new_objects(self, conn, tid, rows):
        """Insert ``(oid, state)`` rows (states are bytes) as objects
        created by transaction ``tid`` (see new_rows_direct_bytes)."""
        binary = self.binary
        states = [(oid, tid, len(state), binary(state)) for oid, state in rows]
        for chunk in chunks(states, self.upload_batch):
            conn.executemany(self.q(self.sql.NEW_OBJECT_STATE), chunk)
        if self.keep_history:
            current = [(oid, tid) for oid, _ in rows]
            for chunk in chunks(current, self.upload_batch):
                conn.executemany(self.q(self.sql.NEW_OBJECT_CURRENT), chunk)

    def binary(self, data):
        """Wrap bytes as the driver wants them bound to a binary column."""
        return data

    def clear_temp(self, conn):
        self._clear_temp_table(conn, 'temp_store', self.sql.CLEAR_TEMP,
                               self.sql.RESET_TEMP_STORE)

    def _clear_temp_table(self, conn, name, delete, reset):
        # See temp_garbage_rows.  A rollback after a reset finds the table
        # as it was at the last commit, rows included (PostgreSQL's TRUNCATE
        # is transactional) or empty (MySQL's DROP of a TEMPORARY table is
        # not): either is fine, the connection clears before it fills.
        if self.temp_garbage_rows is not None and reset:
            rows, size = conn.temp_garbage.get(name, (0, 0))
            if rows >= self.temp_garbage_rows or (
                    self.temp_garbage_bytes is not None and size >= self.temp_garbage_bytes):
                for statement in reset:
                    conn.execute(statement)
                conn.temp_garbage[name] = (0, 0)
                return
        conn.execute(self.q(delete))

    def note_temp_rows(self, conn, rows, nbytes, name='temp_store'):
        """Count ``rows`` rows of ``nbytes`` bytes put into a temporary
        table (temp_garbage_rows)."""
        if self.temp_garbage_rows is not None:
            old_rows, old_bytes = conn.temp_garbage.get(name, (0, 0))
            conn.temp_garbage[name] = (old_rows + rows, old_bytes + nbytes)

    # ------------------------------------------------------------------
    # Blobs kept in the database (blob_chunk rows).

    def clear_temp_blobs(self, conn):
        self._clear_temp_table(conn, 'temp_blob_chunk', self.sql.CLEAR_TEMP_BLOBS,
                               self.sql.RESET_TEMP_BLOBS)

    def upload_blob_chunk(self, conn, oid, chunk_num, data):
        self.note_temp_rows(conn, 1, len(data), 'temp_blob_chunk')
        conn.execute(self.q(self.sql.INSERT_TEMP_BLOB_CHUNK),
                     (oid, chunk_num, self.binary(data)))

    def move_blobs_into_place(self, conn, tid, has_uploads, has_data=True):
        if not self.keep_history and has_data:
            # (Without a row in temp_store, no object with a blob was
            # changed: only new ones, which have no old blob, went straight
            # into place; and temp_store may not exist, see open_store.)
            conn.execute(self.q(self.sql.DELETE_BLOBS_OF_WRITTEN_HF))
        if has_uploads:
            conn.execute(self.q(self.sql.MOVE_BLOBS_FROM_TEMP), (tid,))

    def copy_blob(self, conn, oid, from_tid, to_tid):
        conn.execute(self.q(self.sql.COPY_BLOB), (to_tid, oid, from_tid))

    def any_blob_chunk(self, conn):
        """Does the database hold the bytes of any blob?"""
        return self._any(conn, 'blob_chunk')

    def blob_chunk_count(self, conn, oid, tid):
        return conn.query_value(self.q(self.sql.BLOB_CHUNK_COUNT), (oid, tid)) or 0

    def load_blob_chunk(self, conn, oid, tid, chunk_num):
        return _bytes(conn.query_value(self.q(self.sql.LOAD_BLOB_CHUNK), (oid, tid, chunk_num)))

    def stream_blob_chunk(self, conn, oid, tid, chunk_num, write):
        """Write blob chunk ``chunk_num`` to ``write``; return its size,
        or None when there is no such chunk (a read outside a snapshot
        may find the revision replaced since it counted the chunks: a
        helper agent's check saw a bare TypeError).  Where one chunk may
        be too large to read as one value (the large objects of earlier
        releases on PostgreSQL, which hold a whole blob:
        ``sql.LOAD_BLOB_CHUNK_PART``), it is read in parts of BLOB_PART."""
        part_sql = self.sql.LOAD_BLOB_CHUNK_PART
        if part_sql is None:
            data = self.load_blob_chunk(conn, oid, tid, chunk_num)
            if data is None:
                return None
            write(data)
            return len(data)
        size = 0
        while True:
            value = conn.query_value(self.q(part_sql), (size, BLOB_PART, oid, tid, chunk_num))
            if value is None:
                return None
            data = _bytes(value)
            write(data)
            size += len(data)
            if len(data) < BLOB_PART:
                return size

    # ------------------------------------------------------------------
    # History.

    def history(self, conn, oid, size):
        return conn.query_all(self.q(self.sql.HISTORY), (oid, size))

    def record_iternext(self, conn, start_oid, count=2):
        """The current records (oid, tid, state) of the ``count`` objects
        from OID ``start_oid`` up, in OID order."""
        return conn.query_all(self.q(self.sql.RECORD_ITERNEXT),
                              self._record_range_params(start_oid, count))

    def record_sizes(self, conn, start_oid, count):
        """(oid, state size) of the ``count`` rows from ``start_oid`` up
        whose records record_iternext reads, and of the rows without a
        state among them (size 0)."""
        return conn.query_all(self.q(self.sql.RECORD_SIZES),
                              self._record_range_params(start_oid, count))

    def _record_range_params(self, start_oid, count):
        # (History-preserving, the start bounds both tables of the join.)
        return ((start_oid, start_oid) if self.keep_history else (start_oid,)) + (count,)

    def transactions_in_range(self, conn, start, stop, limit):
        if self.keep_history:
            return conn.query_all(
                self.q(self.sql.ALL_TRANSACTIONS_IN_RANGE), (start, stop, limit))
        return [(row[0], b'', b'', b'', False)
                for row in conn.query_all(
                    self.q(self.sql.TIDS_IN_RANGE_HF), (start, stop, limit))]

    def records_in_transaction(self, conn, tid):
        return conn.query_all(self.q(self.sql.RECORDS_IN_TRANSACTION), (tid,))

    def undo_log(self, conn, upto_tid, limit):
        """The newest ``limit`` transactions up to ``upto_tid``, newest
        first: (tid, user, description, extension)."""
        # Empty transactions too (a commit that only called readCurrent,
        # say), as FileStorage and RelStorage 4.3 list them: undoing one
        # changes nothing.
        return conn.query_all(self.q(self.sql.UNDO_LOG), (False, upto_tid, limit))

    def transaction_packed(self, conn, tid):
        """True/False for a transaction that exists, None when it does not."""
        row = conn.query_one(self.q(self.sql.TRANSACTION_EXISTS), (tid,))
        return None if row is None else bool(row[0])

    def undo_states(self, conn, tid, oids):
        """{oid: (before_found, before_state, current_state, undone_state)}
        for the objects ``oids`` that ``tid`` changed; the last two are None
        for an object not changed since."""
        result = {}
        for stmt, params in self.oid_statements(self.sql.UNDO_STATES, oids):
            # (The tid first; params are None where the OIDs are written
            # into the statement.)
            params = (tid,) + tuple(params or ())
            for oid, before_tid, before, current_tid, current, undone in \
                    conn.query_all(stmt, params):
                changed = current_tid != tid
                result[oid] = (before_tid is not None, _bytes(before),
                               _bytes(current) if changed else None,
                               _bytes(undone) if changed else None)
        return result

    def undo_sources(self, conn, tid):
        """(oid, prev_tid, current_tid) of every object ``tid`` changed."""
        return conn.query_all(self.q(self.sql.UNDO_SOURCES), (tid,))

    # ------------------------------------------------------------------
    # Pack (more verbs in packing.py).

    def stream_rows(self, conn, cursor, sql, batch=1000, params=None):
        """Yield the rows of ``sql`` run on ``cursor`` (a driver cursor that
        does not hold the whole result in memory), batch by batch, with
        driver errors translated; the cursor is closed at the end."""
        try:
            if params is None:
                conn.call(cursor.execute, sql)
            else:
                conn.call(cursor.execute, sql, params)
            while True:
                rows = conn.call(cursor.fetchmany, batch)
                if not rows:
                    break
                yield from rows
        finally:
            try:
                cursor.close()
            except Exception:  # pylint:disable=broad-except
                # A cursor that cannot close leaves the connection unusable.
                conn.broken = True

    def pack_delete(self, conn, removed_oids, kept_revisions, pack_tid):
        """Delete the objects in ``removed_oids`` entirely and, for each
        (oid, tid) in ``kept_revisions``, every revision older than tid."""
        for chunk in chunks(removed_oids, self.upload_batch):
            rows = [(o,) for o in chunk]
            conn.executemany(self.q(self.sql.DELETE_OBJECT), rows)
            if self.has_blob_chunk:
                conn.executemany(self.q(self.sql.DELETE_BLOBS_OF_OBJECT), rows)
            if self.keep_history:
                conn.executemany(self.q(self.sql.DELETE_CURRENT), rows)
        if self.keep_history:
            for chunk in chunks(kept_revisions, self.upload_batch):
                conn.executemany(self.q(self.sql.DELETE_OLDER_REVISIONS), chunk)
                if self.has_blob_chunk:
                    conn.executemany(self.q(self.sql.DELETE_OLDER_BLOBS), chunk)
            conn.execute(self.q(self.sql.MARK_PACKED), (True, pack_tid))
            conn.execute(self.q(self.sql.DELETE_TRANSACTIONS_WITHOUT_STATES), (pack_tid, True))

    # ------------------------------------------------------------------
    # zap_all.

    def zap_all(self):
        """Remove every object and transaction, keeping the schema.

        One store transaction holding the commit lock: no commit lands half
        way.  The last tid goes back to 0 (the database is as new, so that
        history with any tids can be copied in again), and the pack mark
        moves on in the same transaction, so that every process learns with
        its next snapshot that what it cached is gone (see
        StorageCache.note_pack_mark).  DELETE rather than TRUNCATE: readers
        in older snapshots keep seeing their rows and are never waited for.
        Returns (the last tid before, the new pack mark).
        """
        conn = self.open_store()
        try:
            self.begin_store_checked(conn)
            old_last = self.lock_commit_checked(conn)
            for stmt in self.sql.ZAP_ALL:
                conn.execute(stmt)
            if self.has_blob_chunk:
                conn.execute(self.sql.ZAP_BLOBS)
            existing = self.list_tables(conn)
            for table in self.sql.ZAP_PACK_TABLES:
                if table in existing:
                    conn.execute('DELETE FROM %s' % table)
            self.set_last_tid(conn, 0)
            mark = self.bump_pack_mark(conn)
            conn.execute(self.q(self.sql.CLEAR_ZAP_MARK))
            conn.execute(self.q(self.sql.INSERT_ZAP_MARK), (mark,))
            # (Nor a copy left unfinished: a helper agent's check saw
            # every pack of the emptied database refused.)
            self.set_copy_mark(conn, None)
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        finally:
            conn.close()
        return old_last, mark


#: The shortest idle time in a store transaction that a server ends
#: (seconds; see Adapter.store_idle_seconds).
STORE_IDLE_MIN = 600.0

#: At most this many OIDs handed out and not yet stored are remembered
#: (see Adapter.claim_fresh_oids); about 6 MB.
FRESH_OIDS_MAX = 100000

#: Every adapter of the process, for _after_fork_in_child.
_ADAPTERS = weakref.WeakSet()


def _after_fork_in_child():
    for adapter in list(_ADAPTERS):
        adapter.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def lock_runs(oids, read_current_oids):
    """Split the rows to lock into runs of one lock mode, in OID order.

    Locking run after run takes every lock in one global order (ascending
    OID), whatever the mix of exclusive and shared locks, so two committers
    can never wait for each other in a cycle.  Usually there is one run
    (no readCurrent) or a few.
    """
    marked = sorted([(oid, True) for oid in oids] +
                    [(oid, False) for oid in read_current_oids])
    runs = []
    for oid, exclusive in marked:
        if runs and runs[-1][0] == exclusive:
            runs[-1][1].append(oid)
        else:
            runs.append((exclusive, [oid]))
    return runs
