"""Oracle adapter (Oracle Database 19c and later, 23ai included).

Connections, by purpose:

- ``load``: every transaction is one ``SET TRANSACTION READ ONLY``
  snapshot: Oracle gives a read-only transaction transaction-level read
  consistency, so every query sees the database as of its first statement;
- ``store``: Oracle's default READ COMMITTED, autocommit off.  Vote locks
  the current rows it changes, and those read with readCurrent, with
  ``SELECT ... FOR UPDATE WAIT n`` in OID order; finish locks the single
  ``commit_lock`` row the same way (a lock row rather than DBMS_LOCK: it
  needs no grant, is released by commit or rollback like every other
  lock, and lives in the storage's own schema, so storages in different
  schemas never share it, which is what commit-lock-id was for);
- ``oid``: autocommit; OIDs come from the NOCACHE sequence ``zoid_seq``,
  whose values are never rolled back.

``temp_store`` and ``temp_blob_chunk`` are global temporary tables created
with the schema (``ON COMMIT DELETE ROWS``).  The pack's tables and its
``temp_pack_*`` global temporary tables (``ON COMMIT PRESERVE ROWS``) are
created by the first pack; the pack lock is a row lock (see sql.py).
Statements are written with ``%s`` placeholders like every adapter's and
rendered here as numbered binds (``:1``, ``:2``, ...).  Values are bound through the driver layer
(drivers.py), which binds booleans as 0/1 and byte strings over 32 KB as
BLOBs, and fetches BLOBs as bytes.
"""
import logging
import math

from ...interfaces import DisconnectedError
from ...interfaces import RelStorageError
from ...options import redact_password
from ...options import redact_secrets
from ..base import Adapter
from ..base import _one_line
from ..base import chunks
from ..connections import DBConnection
from . import drivers
from . import sql

log = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT = 10


class OracleConnectError(DisconnectedError):
    """The database could not be reached (listener or service down, network).

    A DisconnectedError, hence a TransientError: retrying later may work.
    """


class OracleLoginError(RelStorageError):
    """The database refused the user name, password or account."""


def render_binds(stmt):
    """``stmt`` with each ``%s`` replaced by the next numbered bind."""
    parts = stmt.split('%s')
    out = [parts[0]]
    for number, part in enumerate(parts[1:], 1):
        out.append(':%d' % number)
        out.append(part)
    return ''.join(out)


class OracleAdapter(Adapter):
    vendor = 'oracle'
    full_hint = 'extend the tablespace named above, or let it grow'
    # ORA-01795: at most 1000 expressions in a list.
    max_in_list = 1000
    upload_batch = 1000
    statements_class = sql.OracleStatements
    # The schema earlier releases created on Oracle is not known here.
    earlier_release_reads = None
    temp_rows_survive_commit = False
    has_host = True
    # A server list names whole DSNs (Easy Connect strings, TNS aliases,
    # descriptors).
    server_lines_are_host_port = False
    # New objects go through temp_store as before: Oracle binds states
    # larger than a RAW as BLOBs (upload), and no Oracle server was at
    # hand to measure or test a path straight into place.
    new_rows_direct_bytes = 0
    # A zero-length BLOB or RAW is NULL: read back as a deleted object.
    empty_state_is_null = True
    # Each DDL statement commits on its own, and create_schema skips what
    # is there: a creation cut short after object_state is completed too.
    schema_creation_resumable = True

    def __init__(self, user=None, password=None, dsn=None, options=None, driver=None,
                 commit_lock_id=None, twophase=False):
        super().__init__(options)
        self.driver = drivers.select_driver(driver or getattr(self.options, 'driver', 'auto'))
        dsn = (dsn or '').strip()
        if not dsn:
            raise RelStorageError("The oracle adapter needs a dsn (an Easy Connect "
                                  "string such as host:1521/service, or a TNS alias).")
        if not user and '@' not in dsn and '/' in dsn and not dsn.startswith('('):
            # oracledb reads such a DSN as user/password, with no connect
            # string, when no user is given (a helper agent's check: it was
            # described as a service named like the password).
            raise RelStorageError(
                "The oracle dsn holds a user name and password (user/password) but "
                "no connect string: write user/password@host:1521/service, or give "
                "user and password with dsn host:1521/service")
        dsn_user, dsn_password, dsn = self.driver.split_credentials(dsn)
        self.user = user or dsn_user
        self._password = password if password is not None else dsn_password
        self.dsn = dsn
        self._where = self.driver.parse_dsn(dsn)
        self.sql = self.statements_class(self.keep_history, lock_wait=self._lock_wait())
        self._oid_floor_seen = 0
        lock_id = commit_lock_id if commit_lock_id is not None else \
            getattr(self.options, 'commit_lock_id', 0)
        if lock_id:
            log.info("commit-lock-id %s has no effect on Oracle: the commit lock is "
                     "the row of this schema's commit_lock table.", lock_id)
        if twophase:
            log.info("twophase is accepted for compatibility and has no effect: "
                     "RelStorage commits the Oracle transaction itself.")

    # --- description and errors ------------------------------------------

    def describe(self, server=None):
        server = self.described_server(server)
        dsn = self.dsn if server is None else server.text
        parsed = self._where if server is None else self.driver.parse_dsn(dsn)
        if parsed is not None:
            host, port, service = parsed
            where = 'service %r at %s:%s' % (service, host, port)
        else:
            # (A server list's line may begin with user/password@.)
            shown = ('...@' + dsn.rsplit('@', 1)[1]) if '@' in dsn else dsn
            where = 'TNS alias %r' % redact_secrets(shown)
        return "Oracle database %s as user %r" % (where, self.user)

    def classify_error(self, exc):
        return drivers.classify_error(self.driver, exc)

    def _connect_error(self, exc, server=None):
        kind = drivers.classify_connect_error(self.driver, exc)
        detail = redact_password(_one_line(exc), self._password, self.describe(server))
        if kind == 'login':
            return OracleLoginError(
                "Cannot log in to %s: the user name or password was refused, or the "
                "account cannot log in (%s)" % (self.describe(server), detail))
        message = "Cannot connect to %s (driver %s): %s" % (
            self.describe(server), self.driver.name, detail)
        if kind == 'unreachable':
            return OracleConnectError(message)
        return RelStorageError(message)

    # --- placeholders -------------------------------------------------------

    def q(self, stmt):
        try:
            return self._q_cache[stmt]
        except KeyError:
            rendered = self._q_cache[stmt] = render_binds(stmt)
            return rendered

    # --- connections ------------------------------------------------------

    def connect_to(self, server, purpose):
        # A replica-conf line is a whole DSN (Easy Connect or TNS alias).
        dsn = self.dsn if server is None else server.text
        try:
            return self.driver.connect(self.user, self._password, dsn, purpose,
                                       DEFAULT_CONNECT_TIMEOUT)
        except (self.driver.Error, OSError) as exc:
            # Not chained: the driver's text is summarised (redacted) in ours.
            raise self._connect_error(exc, server) from None

    # --- pack -----------------------------------------------------------

    # The pack lock is a row lock (sql.TRY_PACK_LOCK) held by a session of
    # its own, in a transaction that stays open until PackLock.close().
    pack_lock_purpose = 'store'

    def prepare_pack_lock(self, raw):
        cur = raw.cursor()
        try:
            cur.execute(self.sql.PACK_LOCK_ROW)
            raw.commit()
        except self.driver.Error:
            # Two first packs at once: the other one made the row.
            raw.rollback()
        finally:
            cur.close()

    def open_pack(self):
        # Created only when missing from the data dictionary: 19c has no
        # CREATE ... IF NOT EXISTS, and the global temporary tables cannot
        # be re-created while a session uses them.  storage/pack.py holds
        # the pack lock here, so no other pack creates them at the same
        # time.  (DDL commits.)
        conn = self.open_store()
        try:
            tables = self.list_tables(conn)
            for stmt in self.pack_schema(tables):
                conn.execute(stmt)
            for name, stmt in self.pack_temp_tables().items():
                if name not in tables:
                    conn.execute(stmt)
            conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn

    def pack_schema(self, existing=()):
        return [stmt for name, ddl in sql.PACK_TABLES.items() if name not in existing
                for stmt in ddl]

    def pack_temp_tables(self):
        return sql.PACK_TEMP_TABLES

    def _insert_values(self, conn, prefix, width, rows):
        # One row per statement (no multi-row VALUES before 23ai), sent as
        # array DML.
        for chunk in chunks(rows, self.upload_batch):
            conn.executemany(self.q(prefix), chunk)

    def _any(self, conn, name):
        return conn.query_one(sql.PACK_ANY_ROW % name) is not None

    def start_snapshot(self, conn):
        # SET TRANSACTION must be the first statement of a transaction
        # (ORA-01453): end one a failed earlier attempt may have left open.
        if conn.in_transaction:
            conn.rollback()
        conn.execute('SET TRANSACTION READ ONLY')

    def _lock_wait(self):
        # WAIT takes whole seconds; 0 means do not wait at all.
        seconds = int(math.ceil(float(self.options.commit_lock_timeout)))
        return 'WAIT %d' % seconds if seconds > 0 else 'NOWAIT'

    # --- schema -------------------------------------------------------------

    def schema_statements(self):
        return sql.HISTORY_PRESERVING_SCHEMA if self.keep_history else sql.HISTORY_FREE_SCHEMA

    def create_schema(self, conn):
        # Each DDL statement commits on its own here: a creation cut short
        # (ORA-01950 at the first INSERT, for a user without a quota on
        # the tablespace) left some of the schema, and every later start
        # ran the script again and failed on the first object already
        # there (ORA-00955), for good; two processes opening a new schema
        # at once failed the same way (a review finding).  What is
        # already there is skipped (the INSERT is one a second run
        # leaves alone: sql.py).
        for stmt in self.schema_statements():
            try:
                conn.execute(stmt)
            except self.driver.Error as exc:
                code = drivers.error_codes(exc)[0]
                if code not in (drivers.NAME_IN_USE_ERROR, drivers.DUPLICATE_ERROR):
                    raise
                log.info("Schema creation at %s: %s is there already",
                         self.describe(), _one_line(stmt)[:60])

    def list_tables(self, conn):
        return {row[0] for row in conn.query_all(self.sql.LIST_TABLES)}

    def required_tables(self):
        return super().required_tables() | {'zoid_seq', 'temp_store', 'temp_blob_chunk'}

    def drop_all(self):
        self.close()
        self._oid_floor_seen = 0
        with self._oid_lock:
            self._oid_block = []
        conn = DBConnection(self, self.connect('store'), 'store')
        try:
            for stmt in sql.drop_statements(self.list_tables(conn)):
                conn.execute(stmt)
            conn.commit()
        finally:
            conn.close()

    # --- OIDs -------------------------------------------------------------

    def forget_oid_floor(self):
        self._oid_floor_seen = 0

    def allocate_oid_block(self, conn):
        (last,) = conn.query_one(self.q(self.sql.NEXT_OID_BLOCKS), (1,))
        self._oid_floor_seen = max(self._oid_floor_seen, last)
        return list(range(last - sql.OID_BLOCK + 1, last + 1))

    def raise_oid_floor(self, conn, max_oid):
        # Every OID we handed out is <= a sequence value we drew: the usual
        # commit needs no query at all.
        if max_oid <= self._oid_floor_seen:
            return
        # Restore and copy store OIDs nobody allocated: draw sequence values
        # until one reaches max_oid.  Every later value, and so every later
        # block, then lies above it.  (Drawing rather than ALTER SEQUENCE:
        # no DDL, no implicit commit, no cursor invalidation.)
        # No value below the NOCACHE sequence's recorded position will be
        # drawn again, so the blocks still to come start above position - B.
        position = conn.query_value(self.q(self.sql.OID_SEQUENCE_STATE)) or 0
        if position - sql.OID_BLOCK >= max_oid:
            # (A process that commits only existing objects: no draw.)
            self._oid_floor_seen = max(self._oid_floor_seen, position - sql.OID_BLOCK)
            return
        drawn = self._oid_floor_seen
        if -(-(max_oid - position) // sql.OID_BLOCK) > sql.MAX_DRAW:
            # A gap of more than one round trip's draws (a copy whose OIDs
            # jump): each NOCACHE value is a dictionary update, and
            # drawing up to 2**40 went on for ever under the commit lock
            # (a review finding).  The sequence is restarted above it
            # instead, on a session of its own (the DDL commits at once,
            # which does no harm: the gap is left unused if this commit
            # fails).  No process can draw past the new start meanwhile:
            # the gap is larger than the draws of a round trip.
            self._restart_oid_sequence(max_oid + sql.OID_BLOCK)
            # (The next value is that start: one draw.  A review finding:
            # the loop below, from the old position, drew 10,000 more.)
            position = max_oid + sql.OID_BLOCK
        while drawn < max_oid:
            wanted = max(1, -(-(max_oid - max(position, drawn)) // sql.OID_BLOCK) + 1)
            values = [row[0] for row in conn.query_all(
                self.q(self.sql.NEXT_OID_BLOCKS), (min(wanted, sql.MAX_DRAW),))]
            drawn = max([drawn] + values)
        self._oid_floor_seen = drawn

    def _restart_oid_sequence(self, start):
        conn = DBConnection(self, self.connect('oid'), 'oid')
        try:
            conn.execute(sql.RESTART_OID_SEQUENCE % int(start))
        finally:
            conn.close()

    # --- commit -----------------------------------------------------------

    def upload(self, conn, rows):
        # Small states bind as RAW in one array DML; the few above the RAW
        # limit go in batches of their own, bound as BLOB (drivers.py).
        small, large = [], []
        for row in rows:
            state = row[2]
            (large if state is not None and len(state) > drivers.LOB_BIND_LIMIT
             else small).append(row)
        super().upload(conn, small)
        super().upload(conn, large)

    def lock_objects(self, conn, oids, read_current_oids):
        # No shared row locks in Oracle: readCurrent rows are locked
        # exclusively too, all in one OID order.
        for chunk in chunks(sorted(set(oids) | set(read_current_oids)), self.max_in_list):
            conn.query_all(self.in_list(self.sql.LOCK_OBJECTS, len(chunk)), chunk)

    def lock_commit(self, conn):
        return conn.query_value(self.q(self.sql.LOCK_COMMIT)) or 0

    # --- blobs --------------------------------------------------------------

    def load_blob_chunk(self, conn, oid, tid, chunk_num):
        # An empty chunk was stored as NULL (see sql.py); no row is no
        # chunk (None: a revision a pack removed since its chunks were
        # counted, see stream_blob_chunk), not an empty one (a review
        # finding: the blob came back cut short).
        row = conn.query_one(self.q(self.sql.LOAD_BLOB_CHUNK), (oid, tid, chunk_num))
        if row is None:
            return None
        return bytes(row[0]) if row[0] is not None else b''
