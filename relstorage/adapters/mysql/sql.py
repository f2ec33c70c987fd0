"""MySQL/MariaDB statements and schema.

Differences from the ANSI statements in ``..sql``:

- upserts are ``INSERT ... SELECT ... ON DUPLICATE KEY UPDATE`` (``VALUES()``
  is understood by MariaDB and by MySQL 8, where it is merely deprecated);
- MySQL (8.0 included) cannot open a TEMPORARY table twice in one statement
  and optimizes ``x IN (SELECT ...)`` in DELETE and UPDATE poorly, so
  statements touching ``temp_store`` or filtering by a subquery are written
  as multi-table UPDATE/DELETE joins;
- row locks: ``FOR UPDATE`` everywhere, shared locks spelled
  ``LOCK IN SHARE MODE`` on MariaDB (which has no ``FOR SHARE``) and
  ``FOR SHARE`` on MySQL 8.
"""
from ..sql import EarlierReleaseReads
from ..sql import Statements


def _object_ref_first(stmt):
    """``stmt`` (read from object_ref joined to temp_pack_current) with
    that join written STRAIGHT_JOIN: MySQL joins it in the order written."""
    return stmt.replace('JOIN temp_pack_current c', 'STRAIGHT_JOIN temp_pack_current c', 1)


# Per connection; InnoDB because MEMORY tables cannot hold BLOBs.
TEMP_STORE = """
    CREATE TEMPORARY TABLE IF NOT EXISTS temp_store (
        zoid BIGINT NOT NULL PRIMARY KEY,
        prev_tid BIGINT NOT NULL,
        state LONGBLOB
    ) ENGINE = InnoDB
"""

TEMP_BLOB_CHUNK = """
    CREATE TEMPORARY TABLE IF NOT EXISTS temp_blob_chunk (
        zoid BIGINT NOT NULL,
        chunk_num BIGINT NOT NULL,
        chunk LONGBLOB NOT NULL,
        PRIMARY KEY (zoid, chunk_num)
    ) ENGINE = InnoDB
"""


def _extra_delete(table):
    """Deleting every row of ``table`` about the objects of temp_pack_extra
    (a join)."""
    return "DELETE x FROM %s x JOIN temp_pack_extra t ON t.zoid = x.zoid" % table


class MySQLStatements(Statements):
    """Statements both MariaDB 10.6+ and MySQL 8 accept."""

    #: Fresh planner statistics of a table (Adapter.refresh_statistics);
    #: it answers with a row per table.
    ANALYZE_TABLE = "ANALYZE TABLE {table}"
    ANALYZE_RETURNS_ROWS = True

    # InnoDB's statistics: an estimate of the rows, which may be some
    # tens of percent off, and sizes and rows that MySQL 8 caches for
    # information_schema_stats_expiry (a day by default: after a pack or
    # an import, len() and getSize() may lag that long; both are
    # "approximate" in IStorage).
    COUNT_ESTIMATE = """
        SELECT data_length, table_rows FROM information_schema.TABLES
        WHERE table_schema = DATABASE() AND table_name = %s
    """
    SIZE_OF_STATES = """
        SELECT COALESCE(SUM(data_length + index_length), 0) FROM information_schema.TABLES
        WHERE table_schema = DATABASE() AND table_name IN ('object_state', 'blob_chunk')
    """

    PACK_INFO_SET = """
        INSERT INTO pack_info (name, value) VALUES (%s, %s)
        ON DUPLICATE KEY UPDATE value = VALUES(value)
    """

    #: Appended to a SELECT taking shared row locks.
    SHARE_LOCK_CLAUSE = 'LOCK IN SHARE MODE'

    # (MariaDB has no server_uuid.)  The start time tells apart servers
    # whose host name, port and data directory are the same (containers).
    DATABASE_IDENTITY = """
        SELECT @@hostname, @@port, @@datadir, DATABASE(),
               UNIX_TIMESTAMP() - (SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS
                                   WHERE VARIABLE_NAME = 'UPTIME')
    """

    def __init__(self, keep_history):
        super().__init__(keep_history)
        self.LOCK_CURRENT_SHARED = self.LOCK_CURRENT_SHARED.replace(
            '{share}', self.SHARE_LOCK_CLAUSE)

    UPDATE_CURRENT = """
        INSERT INTO current_object (zoid, tid)
        SELECT zoid, %s FROM temp_store
        ON DUPLICATE KEY UPDATE tid = VALUES(tid)
    """

    MOVE_FROM_TEMP_HF = """
        INSERT INTO object_state (zoid, tid, state_size, state)
        SELECT zoid, %s, COALESCE(LENGTH(state), 0), state FROM temp_store
        ON DUPLICATE KEY UPDATE
            tid = VALUES(tid),
            state_size = VALUES(state_size),
            state = VALUES(state)
    """

    # One reference to temp_store, joined rather than correlated.
    FIX_PREV_TIDS = """
        UPDATE temp_store t
        LEFT JOIN current_object c ON c.zoid = t.zoid
        SET t.prev_tid = COALESCE(c.tid, 0)
    """
    FIX_PREV_TIDS_HF = """
        UPDATE temp_store t
        LEFT JOIN object_state s ON s.zoid = t.zoid
        SET t.prev_tid = COALESCE(s.tid, 0)
    """

    # Blobs: replace the history-free blobs of what we write (a join, not
    # IN (SELECT ...)).
    # temp_store first (STRAIGHT_JOIN), then blob_chunk by its primary key:
    # a plan that scanned blob_chunk (chosen while it is small) locked the
    # rows of other objects, and deadlocked with a pack batch deleting
    # garbage chunks (a helper agent's check).
    DELETE_BLOBS_OF_WRITTEN_HF = """
        DELETE b FROM temp_store t STRAIGHT_JOIN blob_chunk b ON b.zoid = t.zoid
    """

    DELETE_TRANSACTIONS_WITHOUT_STATES = """
        DELETE t FROM transaction_log t
        LEFT JOIN object_state s ON s.tid = t.tid
        WHERE t.tid > 0 AND t.tid <= %s AND t.packed = %s
          AND s.zoid IS NULL
    """

    # The commit lock: one row, locked until commit or rollback.
    LOCK_COMMIT = "SELECT tid FROM commit_lock WHERE id = 0 FOR UPDATE"
    # ... and the pack mark (Adapter.lock_commit_marked), rows locked in
    # id order.
    LOCK_COMMIT_MARKED = ("SELECT id, tid FROM commit_lock WHERE id IN (0, 1) "
                          "ORDER BY id FOR UPDATE")

    # Row locks taken during vote (see MySQLAdapter.lock_objects).  A
    # locking read returns the newest committed tid of each row: the
    # conflict check needs no query of its own.
    LOCK_CURRENT_EXCLUSIVE = """
        SELECT zoid, tid FROM current_object WHERE zoid IN ({in_list})
        ORDER BY zoid FOR UPDATE
    """
    LOCK_CURRENT_EXCLUSIVE_HF = """
        SELECT zoid, tid FROM object_state WHERE zoid IN ({in_list})
        ORDER BY zoid FOR UPDATE
    """
    LOCK_CURRENT_SHARED = """
        SELECT zoid, tid FROM current_object WHERE zoid IN ({in_list})
        ORDER BY zoid {share}
    """
    LOCK_CURRENT_SHARED_HF = """
        SELECT zoid, tid FROM object_state WHERE zoid IN ({in_list})
        ORDER BY zoid {share}
    """

    # Multi-row upload; VALUES rows are appended by the adapter.
    INSERT_TEMP_MANY = "INSERT INTO temp_store (zoid, prev_tid, state) VALUES "
    # New objects straight into place (Adapter.insert_new_objects), idem.
    NEW_OBJECT_STATES = ("INSERT INTO object_state (zoid, tid, prev_tid, state_size, state) "
                         "VALUES ")
    NEW_OBJECT_STATES_HF = "INSERT INTO object_state (zoid, tid, state_size, state) VALUES "
    NEW_OBJECT_CURRENTS = "INSERT INTO current_object (zoid, tid) VALUES "
    APPEND_TEMP_STATE = """
        UPDATE temp_store SET state = CONCAT(state, %s) WHERE zoid = %s
    """

    CLEAR_TEMP = "DELETE FROM temp_store"
    # clear_temp's reset (Adapter.temp_garbage_rows).  Neither statement
    # commits for a TEMPORARY table, unlike TRUNCATE, which does.
    RESET_TEMP_STORE = ('DROP TEMPORARY TABLE IF EXISTS temp_store', TEMP_STORE)
    RESET_TEMP_BLOBS = ('DROP TEMPORARY TABLE IF EXISTS temp_blob_chunk', TEMP_BLOB_CHUNK)

    # OIDs: an AUTO_INCREMENT counter (never rolled back); each value n
    # stands for the block of OIDs ((n - 1) * OID_BLOCK, n * OID_BLOCK].
    # A multi-row insert draws several consecutive values (followed by
    # "()" once per value).
    NEW_OID_BLOCKS_PREFIX = "INSERT INTO new_oid VALUES "
    PRUNE_OID_BLOCKS = "DELETE FROM new_oid WHERE zoid < %s"
    RAISE_OID_BLOCK = "INSERT IGNORE INTO new_oid (zoid) VALUES (%s)"

    # Pack: every delete and update is a join against the temporary table
    # (IN (SELECT ...) made a 6-million-object pack take 17 s per batch).
    INSERT_IGNORE = 'INSERT IGNORE INTO'
    INSERT_IGNORE_END = ''
    # One scan of object_ref, probing the work tables by their keys (the
    # optimizer would start from the small table and scan object_ref,
    # which has no index on to_zoid, once per row).
    PACK_DOM_ENTRIES = _object_ref_first(Statements.PACK_DOM_ENTRIES)
    PACK_DOM_ENTRIES_AT = _object_ref_first(Statements.PACK_DOM_ENTRIES_AT)
    PACK_DELETE_STATES = """
        DELETE s FROM object_state s JOIN temp_pack_batch t ON t.zoid = s.zoid
        WHERE s.tid < t.below
    """
    PACK_DELETE_BLOBS = """
        DELETE b FROM blob_chunk b JOIN temp_pack_batch t ON t.zoid = b.zoid
        WHERE b.tid < t.below
    """
    PACK_DELETE_REFS = """
        DELETE r FROM object_ref r JOIN temp_pack_batch t ON t.zoid = r.zoid
        WHERE r.tid < t.below
    """
    PACK_DELETE_CURRENT = """
        DELETE c FROM current_object c JOIN temp_pack_batch t ON t.zoid = c.zoid
        WHERE t.garbage = 1
    """
    PACK_EXTRA_DELETE_BLOBS = _extra_delete('blob_chunk')
    PACK_EXTRA_DELETE_STATES = _extra_delete('object_state')
    PACK_EXTRA_DELETE_CURRENT = _extra_delete('current_object')
    PACK_EXTRA_DELETE_REFS = _extra_delete('object_ref')
    PACK_UNMARK = """
        UPDATE pack_object p JOIN temp_pack_frontier f ON f.zoid = p.zoid
        SET p.garbage = 0
    """
    # A named lock is server-wide: the database's name makes it ours.
    # (Lock names are at most 64 characters: a longer database name is
    # named by its MD5, not cut, where databases whose names began alike
    # shared one lock, a helper agent's check; shorter ones as earlier
    # releases named them.)
    _PACK_LOCK_NAME = ("CONCAT('relstorage.pack.', IF(CHAR_LENGTH(DATABASE()) <= 48, "
                       "DATABASE(), MD5(DATABASE())))")
    TRY_PACK_LOCK = "SELECT GET_LOCK(%s, 0)" % _PACK_LOCK_NAME
    RELEASE_PACK_LOCK = "SELECT RELEASE_LOCK(%s)" % _PACK_LOCK_NAME

    LIST_TABLES = """
        SELECT LOWER(table_name), engine FROM information_schema.tables
        WHERE table_schema = DATABASE()
    """


class MariaDBStatements(MySQLStatements):
    SHARE_LOCK_CLAUSE = 'LOCK IN SHARE MODE'
    # A recursive query stops at max_recursive_iterations (1000 by
    # default): a chain of garbage deeper than that failed every pack (a
    # helper agent's check: a BTree of 40,000 keys inserted in descending
    # order, unlinked, has a chain of 2,519 buckets).
    PACK_EXTRA_CLOSURE = ("SET STATEMENT max_recursive_iterations = 4294967295 FOR"
                          + Statements.PACK_EXTRA_CLOSURE)


class MySQL8Statements(MySQLStatements):
    SHARE_LOCK_CLAUSE = 'FOR SHARE'
    # Its recursive queries stop at cte_max_recursion_depth (1000 by
    # default; see MariaDBStatements): the closure goes a step at a time.
    PACK_EXTRA_CLOSURE = None

    # MySQL 8 has no information_schema.GLOBAL_STATUS; it names each server
    # (server_uuid), where MariaDB goes by the host name.
    DATABASE_IDENTITY = """
        SELECT @@server_uuid, @@port, @@datadir, DATABASE(),
               UNIX_TIMESTAMP() - (SELECT VARIABLE_VALUE FROM performance_schema.global_status
                                   WHERE VARIABLE_NAME = 'Uptime')
    """


OID_BLOCK = 128
#: Most counter values one allocation draws (16 blocks: 2048 OIDs).
OID_VALUES_MAX = 16
#: The new_oid table keeps at most about this many rows (see
#: MySQLAdapter.allocate_oid_block).
OID_PRUNE_EVERY = 16

#: Tables RelStorage owns (dropped by drop_all).
ALL_TABLES = ('commit_lock', 'new_oid', 'transaction_log', 'current_object',
              'object_state', 'blob_chunk', 'object_ref', 'pack_object', 'pack_info',
              'pack_removed_list', 'pack_removed', 'pack_seed')

PACK_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS object_ref (
        zoid BIGINT NOT NULL,
        tid BIGINT NOT NULL,
        to_zoid BIGINT NOT NULL,
        PRIMARY KEY (zoid, tid, to_zoid),
        KEY object_ref_tid (tid)
    ) ENGINE = InnoDB""",
    """CREATE TABLE IF NOT EXISTS pack_object (
        zoid BIGINT NOT NULL PRIMARY KEY,
        keep_tid BIGINT NOT NULL,
        garbage SMALLINT NOT NULL
    ) ENGINE = InnoDB""",
    """CREATE TABLE IF NOT EXISTS pack_info (
        name VARCHAR(32) NOT NULL PRIMARY KEY,
        value BIGINT NOT NULL
    ) ENGINE = InnoDB""",
    """CREATE TABLE IF NOT EXISTS pack_seed (
        zoid BIGINT NOT NULL PRIMARY KEY
    ) ENGINE = InnoDB""",
    """CREATE TABLE IF NOT EXISTS pack_removed_list (
        mark BIGINT NOT NULL PRIMARY KEY,
        garbage LONGBLOB NOT NULL,
        trimmed LONGBLOB NOT NULL
    ) ENGINE = InnoDB""",
)

#: The pack's work tables, named -> DDL.
PACK_TEMP_TABLES = {
    'temp_pack_current': """CREATE TEMPORARY TABLE IF NOT EXISTS temp_pack_current (
        zoid BIGINT NOT NULL PRIMARY KEY, tid BIGINT NOT NULL,
        revisions BIGINT NOT NULL) ENGINE = InnoDB""",
    'temp_pack_reach': """CREATE TEMPORARY TABLE IF NOT EXISTS temp_pack_reach (
        zoid BIGINT NOT NULL PRIMARY KEY) ENGINE = InnoDB""",
    'temp_pack_frontier': """CREATE TEMPORARY TABLE IF NOT EXISTS temp_pack_frontier (
        zoid BIGINT NOT NULL PRIMARY KEY) ENGINE = InnoDB""",
    'temp_pack_next': """CREATE TEMPORARY TABLE IF NOT EXISTS temp_pack_next (
        zoid BIGINT NOT NULL PRIMARY KEY) ENGINE = InnoDB""",
    'temp_pack_dom': """CREATE TEMPORARY TABLE IF NOT EXISTS temp_pack_dom (
        zoid BIGINT NOT NULL PRIMARY KEY) ENGINE = InnoDB""",
    'temp_pack_seed': """CREATE TEMPORARY TABLE IF NOT EXISTS temp_pack_seed (
        zoid BIGINT NOT NULL PRIMARY KEY) ENGINE = InnoDB""",
    'temp_pack_batch': """CREATE TEMPORARY TABLE IF NOT EXISTS temp_pack_batch (
        zoid BIGINT NOT NULL PRIMARY KEY, below BIGINT NOT NULL,
        garbage SMALLINT NOT NULL) ENGINE = InnoDB""",
    'temp_pack_edges': """CREATE TEMPORARY TABLE IF NOT EXISTS temp_pack_edges (
        to_zoid BIGINT NOT NULL, zoid BIGINT NOT NULL,
        PRIMARY KEY (to_zoid, zoid)) ENGINE = InnoDB""",
    'temp_pack_extra': """CREATE TEMPORARY TABLE IF NOT EXISTS temp_pack_extra (
        zoid BIGINT NOT NULL PRIMARY KEY) ENGINE = InnoDB""",
}

# MySQL commits each DDL statement by itself: a creation cut short (a
# helper agent's check: binlog_format STATEMENT refused the INSERT below)
# left commit_lock, and every later open failed on "Table 'commit_lock'
# already exists".  So the statements can be run again over what they made
# (IF NOT EXISTS, INSERT IGNORE), processes starting at once on a new
# database run them side by side, and object_state, whose presence says
# the schema exists (Adapter.prepare_schema), comes last: a process that
# sees it sees the other tables (one saw object_state before
# current_object and called the schema history-free).
_BLOB_CHUNK = """CREATE TABLE IF NOT EXISTS blob_chunk (
        zoid BIGINT NOT NULL,
        tid BIGINT NOT NULL,
        chunk_num BIGINT NOT NULL,
        chunk LONGBLOB NOT NULL,
        PRIMARY KEY (zoid, tid, chunk_num)
    ) ENGINE = InnoDB"""

_COMMON = (
    """CREATE TABLE IF NOT EXISTS commit_lock (
        id TINYINT NOT NULL PRIMARY KEY,
        tid BIGINT NOT NULL
    ) ENGINE = InnoDB""",
    "INSERT IGNORE INTO commit_lock (id, tid) VALUES (0, 0)",
    """CREATE TABLE IF NOT EXISTS new_oid (
        zoid BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY
    ) ENGINE = InnoDB""",
    _BLOB_CHUNK,
)

HISTORY_PRESERVING_SCHEMA = _COMMON + (
    """CREATE TABLE IF NOT EXISTS transaction_log (
        tid BIGINT NOT NULL PRIMARY KEY,
        packed BOOLEAN NOT NULL DEFAULT FALSE,
        is_empty BOOLEAN NOT NULL DEFAULT FALSE,
        username MEDIUMBLOB NOT NULL,
        description MEDIUMBLOB NOT NULL,
        extension MEDIUMBLOB
    ) ENGINE = InnoDB""",
    """CREATE TABLE IF NOT EXISTS current_object (
        zoid BIGINT NOT NULL PRIMARY KEY,
        tid BIGINT NOT NULL,
        KEY current_object_tid (tid)
    ) ENGINE = InnoDB""",
    """CREATE TABLE IF NOT EXISTS object_state (
        zoid BIGINT NOT NULL,
        tid BIGINT NOT NULL,
        prev_tid BIGINT NOT NULL,
        state_size BIGINT NOT NULL,
        state LONGBLOB,
        PRIMARY KEY (zoid, tid),
        KEY object_state_tid (tid)
    ) ENGINE = InnoDB""",
)

HISTORY_FREE_SCHEMA = _COMMON + (
    """CREATE TABLE IF NOT EXISTS object_state (
        zoid BIGINT NOT NULL PRIMARY KEY,
        tid BIGINT NOT NULL,
        state_size BIGINT NOT NULL,
        state LONGBLOB,
        KEY object_state_tid (tid)
    ) ENGINE = InnoDB""",
)


class MySQLEarlierReleaseReads(EarlierReleaseReads):
    # Without ANSI_QUOTES, MySQL quotes identifiers with backticks.
    TRANSACTION_TABLE = '`transaction`'
