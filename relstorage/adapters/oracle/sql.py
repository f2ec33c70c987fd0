"""Oracle statements and schema (Oracle Database 19c and later).

Differences from the ANSI statements in ``..sql``:

- placeholders are numbered bind variables (``:1``, ``:2``, ...), rendered
  by ``OracleAdapter.q`` from the shared ``%s`` spelling;
- ``LIMIT n`` is ``FETCH FIRST n ROWS ONLY`` (12c row limiting);
- upserts are ``MERGE``;
- pickles, blob chunks and transaction metadata are ``BLOB``; their size is
  ``DBMS_LOB.GETLENGTH`` (``LENGTH`` does not accept a BLOB);
- Oracle stores a zero-length BLOB or RAW as NULL, so the byte columns that
  may legitimately be empty (metadata, an empty blob's single chunk) are
  nullable, and the adapter reads NULL back as ``b''`` there;
- there is no BOOLEAN column type before 23ai: flags are ``NUMBER(1)``, and
  the driver layer binds Python booleans as 0/1;
- row locks are ``SELECT ... FOR UPDATE WAIT n`` (or ``NOWAIT``), the wait
  taken from commit-lock-timeout when the adapter is built.  Oracle has no
  shared row lock, so rows read with readCurrent are locked ``FOR UPDATE``
  as well: stricter than needed, never wrong;
- ``temp_store`` and ``temp_blob_chunk`` are global temporary tables
  (``ON COMMIT DELETE ROWS``): created once with the schema, each session
  sees only its own rows, and a commit or rollback empties them;
- pack: its work tables are global temporary tables too, ``ON COMMIT
  PRESERVE ROWS``; rows that may exist already are skipped with ``NOT
  EXISTS``, reference rows go in as array DML (no multi-row ``VALUES``
  before 23ai), deletions are ``EXISTS`` semi-joins, and the pack lock is a
  ``SKIP LOCKED`` row lock.
"""
from ..sql import Statements

#: OIDs handed out per sequence value: ``zoid_seq`` counts in steps of
#: OID_BLOCK and a value ``v`` reserves the OIDs ``v - OID_BLOCK + 1 .. v``.
OID_BLOCK = 128

#: Sequence values drawn at most per round trip when the OID floor is raised.
MAX_DRAW = 10000

#: Moves the sequence on past a gap of more than MAX_DRAW values in one
#: step (Oracle 18c and later; DDL, so run on an autocommit session of its
#: own, and the value formatted in: DDL takes no binds).
RESTART_OID_SEQUENCE = "ALTER SEQUENCE zoid_seq RESTART START WITH %d"

#: The commit_lock row whose row lock is the pack lock (0 is the commit
#: lock, 1 the pack mark).
PACK_LOCK_ID = 2


def _fetch_first(stmt):
    """``stmt`` with its final ``LIMIT n`` written as Oracle (12c) has it."""
    head, sep, count = stmt.rpartition('LIMIT ')
    if not sep:
        raise ValueError('no LIMIT in %r' % stmt)
    return head + 'FETCH FIRST ' + count.strip() + ' ROWS ONLY\n'


class OracleStatements(Statements):
    """Statements for one history mode; ``lock_wait`` is the clause that
    bounds row-lock waits (``WAIT n`` or ``NOWAIT``)."""

    # (No INSERT ... ON CONFLICT: a key is deleted, then inserted.)
    PACK_INFO_SET = None

    DATABASE_IDENTITY = """
        SELECT SYS_CONTEXT('USERENV', 'DB_UNIQUE_NAME'), SYS_CONTEXT('USERENV', 'CON_NAME'),
               SYS_CONTEXT('USERENV', 'CURRENT_SCHEMA'), NULL
        FROM DUAL
    """

    def __init__(self, keep_history, lock_wait='WAIT 30'):
        super().__init__(keep_history)
        for name in ('LOCK_COMMIT', 'LOCK_OBJECTS'):
            setattr(self, name, getattr(self, name).replace('{lock_wait}', lock_wait))

    PING = "SELECT 1 FROM DUAL"

    # --- reads limited to the first rows ---------------------------------

    LOAD_BEFORE = _fetch_first(Statements.LOAD_BEFORE)
    RECENT_CHANGES = _fetch_first(Statements.RECENT_CHANGES)
    RECENT_CHANGES_HF = _fetch_first(Statements.RECENT_CHANGES_HF)
    HISTORY = """
        SELECT s.tid, s.state_size, t.username, t.description, t.extension
        FROM (SELECT tid, state_size FROM object_state
              WHERE zoid = %s ORDER BY tid DESC FETCH FIRST %s ROWS ONLY) s
        JOIN transaction_log t ON t.tid = s.tid
        ORDER BY s.tid DESC
    """
    UNDO_LOG = _fetch_first(Statements.UNDO_LOG)
    HISTORY_HF = _fetch_first(Statements.HISTORY_HF)
    RECORD_ITERNEXT = _fetch_first(Statements.RECORD_ITERNEXT)
    RECORD_ITERNEXT_HF = _fetch_first(Statements.RECORD_ITERNEXT_HF)
    RECORD_SIZES = _fetch_first(Statements.RECORD_SIZES)
    RECORD_SIZES_HF = _fetch_first(Statements.RECORD_SIZES_HF)
    TID_HAS_STATES = _fetch_first(Statements.TID_HAS_STATES)
    ALL_TRANSACTIONS_IN_RANGE = _fetch_first(Statements.ALL_TRANSACTIONS_IN_RANGE)
    TIDS_IN_RANGE_HF = _fetch_first(Statements.TIDS_IN_RANGE_HF)

    # --- commit ---------------------------------------------------------

    # The commit lock: the row of commit_lock, held until commit/rollback.
    LOCK_COMMIT = "SELECT tid FROM commit_lock WHERE id = 0 FOR UPDATE {lock_wait}"

    # Row locks taken during vote, in OID order (the sort runs below the
    # locking row source, so rows are locked in the order they come out).
    # Objects that do not exist yet have no row to lock; their OIDs are
    # new and unique to this transaction anyway.
    LOCK_OBJECTS = """
        SELECT zoid FROM current_object WHERE zoid IN ({in_list})
        ORDER BY zoid FOR UPDATE {lock_wait}
    """
    LOCK_OBJECTS_HF = """
        SELECT zoid FROM object_state WHERE zoid IN ({in_list})
        ORDER BY zoid FOR UPDATE {lock_wait}
    """

    MOVE_FROM_TEMP = """
        INSERT INTO object_state (zoid, tid, prev_tid, state_size, state)
        SELECT zoid, %s, prev_tid, COALESCE(DBMS_LOB.GETLENGTH(state), 0), state
        FROM temp_store
    """

    UPDATE_CURRENT = """
        MERGE INTO current_object c
        USING (SELECT zoid, %s AS tid FROM temp_store) t
        ON (c.zoid = t.zoid)
        WHEN MATCHED THEN UPDATE SET c.tid = t.tid
        WHEN NOT MATCHED THEN INSERT (zoid, tid) VALUES (t.zoid, t.tid)
    """

    INSERT_NEW_CURRENT_HF = """
        INSERT INTO object_state (zoid, tid, state_size, state)
        SELECT zoid, %s, COALESCE(DBMS_LOB.GETLENGTH(state), 0), state FROM temp_store
        WHERE prev_tid = 0
    """

    MOVE_FROM_TEMP_HF = """
        MERGE INTO object_state s
        USING (
            SELECT zoid, %s AS tid, COALESCE(DBMS_LOB.GETLENGTH(state), 0) AS state_size,
                   state
            FROM temp_store
        ) t
        ON (s.zoid = t.zoid)
        WHEN MATCHED THEN UPDATE SET
            s.tid = t.tid, s.state_size = t.state_size, s.state = t.state
        WHEN NOT MATCHED THEN INSERT (zoid, tid, state_size, state)
            VALUES (t.zoid, t.tid, t.state_size, t.state)
    """

    # --- pack -------------------------------------------------------------

    DELETE_TRANSACTIONS_WITHOUT_STATES = """
        DELETE FROM transaction_log
        WHERE tid > 0 AND tid <= %s AND packed = %s
          AND NOT EXISTS (SELECT 1 FROM object_state s WHERE s.tid = transaction_log.tid)
    """

    # The pack lock: a row lock on commit_lock row PACK_LOCK_ID, held by
    # the pack lock's own session in a transaction it never commits (no
    # grant needed, unlike DBMS_LOCK; a killed session's transaction is
    # rolled back by the server, which releases it).  SKIP LOCKED returns
    # no row, without waiting, while another pack holds it.
    TRY_PACK_LOCK = """
        SELECT 1 FROM commit_lock WHERE id = %d FOR UPDATE SKIP LOCKED
    """ % PACK_LOCK_ID
    # Closing the session rolls its transaction back before the logoff
    # returns: nothing to send.
    RELEASE_PACK_LOCK = None
    # The lock row, made by the first pack (a plain INSERT: it never
    # touches, so never waits for, the row another pack holds).
    PACK_LOCK_ROW = """
        INSERT INTO commit_lock (id, tid)
        SELECT %d, 0 FROM dual
        WHERE NOT EXISTS (SELECT 1 FROM commit_lock WHERE id = %d)
    """ % (PACK_LOCK_ID, PACK_LOCK_ID)

    # No INSERT ... ON CONFLICT / INSERT IGNORE: the two statements that
    # skip existing rows are written out with NOT EXISTS below, and the
    # shared template's markers must not be left in any statement.
    INSERT_IGNORE = None
    INSERT_IGNORE_END = None
    PACK_RESCUE_REFERENCED = """
        INSERT INTO temp_pack_frontier (zoid)
        SELECT DISTINCT p.zoid FROM temp_pack_next n
        JOIN pack_object p ON p.zoid = n.zoid
        WHERE p.garbage = 1
          AND NOT EXISTS (SELECT 1 FROM temp_pack_frontier x WHERE x.zoid = p.zoid)
    """
    PACK_RESCUE_STEP = """
        INSERT INTO temp_pack_next (zoid)
        SELECT DISTINCT p.zoid FROM temp_pack_frontier f
        JOIN pack_object pf ON pf.zoid = f.zoid
        JOIN object_ref r ON r.zoid = pf.zoid AND r.tid = pf.keep_tid
        JOIN pack_object p ON p.zoid = r.to_zoid
        WHERE p.garbage = 1
          AND NOT EXISTS (SELECT 1 FROM temp_pack_next x WHERE x.zoid = p.zoid)
    """
    # No multi-row VALUES before 23ai: one row per statement, sent as one
    # array DML (executemany) per batch.
    PACK_REFS_INSERT = "INSERT INTO object_ref (zoid, tid, to_zoid) VALUES (%s, %s, %s)"
    PACK_NEXT_INSERT = "INSERT INTO temp_pack_next (zoid) VALUES (%s)"
    PACK_SEED_INSERT = "INSERT INTO pack_seed (zoid) VALUES (%s)"
    PACK_SEED_DROPPED = """
        INSERT INTO temp_pack_dom (zoid)
        SELECT DISTINCT r.to_zoid FROM temp_pack_current c
        JOIN object_state p ON p.zoid = c.zoid AND p.tid <= %s
        JOIN object_ref r ON r.zoid = p.zoid AND r.tid = p.tid
        LEFT JOIN object_ref n ON n.zoid = c.zoid AND n.tid = c.tid AND n.to_zoid = r.to_zoid
        WHERE n.zoid IS NULL
          AND NOT EXISTS (SELECT 1 FROM temp_pack_dom x WHERE x.zoid = r.to_zoid)
    """
    PACK_SEED_NEW = """
        INSERT INTO temp_pack_dom (zoid)
        SELECT c.zoid FROM temp_pack_current c
        WHERE NOT EXISTS (SELECT 1 FROM object_state p WHERE p.zoid = c.zoid AND p.tid <= %s)
          AND NOT EXISTS (SELECT 1 FROM temp_pack_dom x WHERE x.zoid = c.zoid)
    """
    PACK_FILL_DOM = """
        INSERT INTO temp_pack_current (zoid, tid, revisions)
        SELECT s.zoid, MAX(s.tid), COUNT(*) FROM temp_pack_dom d
        JOIN object_state s ON s.zoid = d.zoid
        WHERE s.tid <= %s
          AND NOT EXISTS (SELECT 1 FROM temp_pack_current x WHERE x.zoid = d.zoid)
        GROUP BY s.zoid
    """
    PACK_LATE_REFS = """
        INSERT INTO temp_pack_seed (zoid)
        SELECT DISTINCT r.to_zoid FROM object_ref r
        JOIN temp_pack_current c ON c.zoid = r.to_zoid
        LEFT JOIN temp_pack_reach x ON x.zoid = r.to_zoid
        WHERE r.tid > %s AND x.zoid IS NULL
          AND NOT EXISTS (SELECT 1 FROM temp_pack_seed s WHERE s.zoid = r.to_zoid)
    """
    PACK_FILL_BATCH = _fetch_first(Statements.PACK_FILL_BATCH)
    # (Oracle's recursive queries need UNION ALL and a CYCLE clause: the
    # closure goes a step at a time instead.)
    PACK_EXTRA_CLOSURE = None
    # Semi-joins: Oracle has no DELETE ... USING / multi-table DELETE.
    PACK_DELETE_STATES = """
        DELETE FROM object_state s WHERE EXISTS (
            SELECT 1 FROM temp_pack_batch t WHERE t.zoid = s.zoid AND s.tid < t.below)
    """
    PACK_DELETE_BLOBS = """
        DELETE FROM blob_chunk b WHERE EXISTS (
            SELECT 1 FROM temp_pack_batch t WHERE t.zoid = b.zoid AND b.tid < t.below)
    """
    PACK_DELETE_REFS = """
        DELETE FROM object_ref r WHERE EXISTS (
            SELECT 1 FROM temp_pack_batch t WHERE t.zoid = r.zoid AND r.tid < t.below)
    """
    PACK_DELETE_CURRENT = """
        DELETE FROM current_object c WHERE EXISTS (
            SELECT 1 FROM temp_pack_batch t WHERE t.zoid = c.zoid AND t.garbage = 1)
    """

    # --- OIDs -------------------------------------------------------------

    # Draws %s values of the sequence in one round trip.
    NEXT_OID_BLOCKS = "SELECT zoid_seq.NEXTVAL FROM dual CONNECT BY LEVEL <= %s"
    # The sequence is NOCACHE, so this is where it stands: no value below
    # it can be handed out any more.
    OID_SEQUENCE_STATE = """
        SELECT last_number FROM user_sequences WHERE sequence_name = 'ZOID_SEQ'
    """

    # --- schema -----------------------------------------------------------

    # (Tables in the recycle bin are still listed, as dropped.)
    LIST_TABLES = """
        SELECT LOWER(table_name) FROM user_tables WHERE dropped = 'NO'
        UNION ALL
        SELECT LOWER(sequence_name) FROM user_sequences
    """


# NUMBER(20) holds every 64-bit OID and TID.  The sequence is NOCACHE:
# a cached sequence hands out values below its recorded position (per
# instance, on RAC), which would make raising the OID floor after a
# restore unreliable; one sequence value reserves OID_BLOCK OIDs, so the
# dictionary update per value costs little.
_COMMON_HEAD = (
    "CREATE SEQUENCE zoid_seq START WITH %d INCREMENT BY %d MINVALUE 0 NOCACHE"
    % (OID_BLOCK, OID_BLOCK),
    """CREATE TABLE commit_lock (
        id NUMBER(1) NOT NULL PRIMARY KEY,
        tid NUMBER(20) NOT NULL
    )""",
    # (A creation run again after one cut short: see OracleAdapter.create_schema.)
    "INSERT INTO commit_lock (id, tid) SELECT 0, 0 FROM dual "
    "WHERE NOT EXISTS (SELECT 1 FROM commit_lock WHERE id = 0)",
)

_TEMP_TABLES = (
    """CREATE GLOBAL TEMPORARY TABLE temp_store (
        zoid NUMBER(20) NOT NULL PRIMARY KEY,
        prev_tid NUMBER(20) NOT NULL,
        state BLOB
    ) ON COMMIT DELETE ROWS""",
    """CREATE GLOBAL TEMPORARY TABLE temp_blob_chunk (
        zoid NUMBER(20) NOT NULL,
        chunk_num NUMBER(20) NOT NULL,
        chunk BLOB,
        PRIMARY KEY (zoid, chunk_num)
    ) ON COMMIT DELETE ROWS""",
)

# chunk is nullable: an empty blob is one zero-length chunk, which Oracle
# stores as NULL.
_BLOB_CHUNK_TABLE = (
    """CREATE TABLE blob_chunk (
        zoid NUMBER(20) NOT NULL,
        tid NUMBER(20) NOT NULL,
        chunk_num NUMBER(20) NOT NULL,
        chunk BLOB,
        PRIMARY KEY (zoid, tid, chunk_num)
    )""",
)

HISTORY_PRESERVING_SCHEMA = _COMMON_HEAD + (
    """CREATE TABLE transaction_log (
        tid NUMBER(20) NOT NULL PRIMARY KEY,
        packed NUMBER(1) DEFAULT 0 NOT NULL,
        is_empty NUMBER(1) DEFAULT 0 NOT NULL,
        username BLOB,
        description BLOB,
        extension BLOB
    )""",
    """CREATE TABLE object_state (
        zoid NUMBER(20) NOT NULL,
        tid NUMBER(20) NOT NULL,
        prev_tid NUMBER(20) NOT NULL,
        state_size NUMBER(20) NOT NULL,
        state BLOB,
        PRIMARY KEY (zoid, tid)
    )""",
    "CREATE INDEX object_state_tid ON object_state (tid)",
    """CREATE TABLE current_object (
        zoid NUMBER(20) NOT NULL PRIMARY KEY,
        tid NUMBER(20) NOT NULL
    )""",
    "CREATE INDEX current_object_tid ON current_object (tid)",
) + _BLOB_CHUNK_TABLE + _TEMP_TABLES

HISTORY_FREE_SCHEMA = _COMMON_HEAD + (
    """CREATE TABLE object_state (
        zoid NUMBER(20) NOT NULL PRIMARY KEY,
        tid NUMBER(20) NOT NULL,
        state_size NUMBER(20) NOT NULL,
        state BLOB
    )""",
    "CREATE INDEX object_state_tid ON object_state (tid)",
) + _BLOB_CHUNK_TABLE + _TEMP_TABLES

#: Whether a pack work table has a row (table name formatted in).
PACK_ANY_ROW = "SELECT zoid FROM %s FETCH FIRST 1 ROWS ONLY"

#: The pack's permanent tables, name -> DDL, created by the first pack
#: (the adapter checks the data dictionary: no CREATE ... IF NOT EXISTS
#: before 23ai).
PACK_TABLES = {
    'object_ref': (
        """CREATE TABLE object_ref (
            zoid NUMBER(20) NOT NULL,
            tid NUMBER(20) NOT NULL,
            to_zoid NUMBER(20) NOT NULL,
            PRIMARY KEY (zoid, tid, to_zoid)
        )""",
        "CREATE INDEX object_ref_tid ON object_ref (tid)",
    ),
    'pack_object': (
        """CREATE TABLE pack_object (
            zoid NUMBER(20) NOT NULL PRIMARY KEY,
            keep_tid NUMBER(20) NOT NULL,
            garbage NUMBER(1) NOT NULL
        )""",
    ),
    'pack_info': (
        """CREATE TABLE pack_info (
            name VARCHAR2(32) NOT NULL PRIMARY KEY,
            value NUMBER(20) NOT NULL
        )""",
    ),
    'pack_seed': (
        "CREATE TABLE pack_seed (zoid NUMBER(20) NOT NULL PRIMARY KEY)",
    ),
    'pack_removed_list': (
        # (Nullable: Oracle stores an empty BLOB as NULL.)
        """CREATE TABLE pack_removed_list (
            mark NUMBER(20) NOT NULL PRIMARY KEY,
            garbage BLOB,
            trimmed BLOB
        )""",
    ),
}

#: The pack's work tables, name -> DDL: global temporary tables, created
#: once like temp_store (DDL on a global temporary table a session is
#: using fails with ORA-14450, so they are never re-created per pack).
#: ON COMMIT PRESERVE ROWS: the pack commits between its steps and
#: batches and keeps reading them; it empties them itself.
PACK_TEMP_TABLES = {
    'temp_pack_current': """CREATE GLOBAL TEMPORARY TABLE temp_pack_current (
        zoid NUMBER(20) NOT NULL PRIMARY KEY,
        tid NUMBER(20) NOT NULL,
        revisions NUMBER(20) NOT NULL
    ) ON COMMIT PRESERVE ROWS""",
    'temp_pack_reach': """CREATE GLOBAL TEMPORARY TABLE temp_pack_reach (
        zoid NUMBER(20) NOT NULL PRIMARY KEY
    ) ON COMMIT PRESERVE ROWS""",
    'temp_pack_frontier': """CREATE GLOBAL TEMPORARY TABLE temp_pack_frontier (
        zoid NUMBER(20) NOT NULL PRIMARY KEY
    ) ON COMMIT PRESERVE ROWS""",
    'temp_pack_next': """CREATE GLOBAL TEMPORARY TABLE temp_pack_next (
        zoid NUMBER(20) NOT NULL PRIMARY KEY
    ) ON COMMIT PRESERVE ROWS""",
    'temp_pack_dom': """CREATE GLOBAL TEMPORARY TABLE temp_pack_dom (
        zoid NUMBER(20) NOT NULL PRIMARY KEY
    ) ON COMMIT PRESERVE ROWS""",
    'temp_pack_seed': """CREATE GLOBAL TEMPORARY TABLE temp_pack_seed (
        zoid NUMBER(20) NOT NULL PRIMARY KEY
    ) ON COMMIT PRESERVE ROWS""",
    'temp_pack_batch': """CREATE GLOBAL TEMPORARY TABLE temp_pack_batch (
        zoid NUMBER(20) NOT NULL PRIMARY KEY,
        below NUMBER(20) NOT NULL,
        garbage NUMBER(1) NOT NULL
    ) ON COMMIT PRESERVE ROWS""",
    'temp_pack_edges': """CREATE GLOBAL TEMPORARY TABLE temp_pack_edges (
        to_zoid NUMBER(20) NOT NULL,
        zoid NUMBER(20) NOT NULL,
        PRIMARY KEY (to_zoid, zoid)
    ) ON COMMIT PRESERVE ROWS""",
    'temp_pack_extra': """CREATE GLOBAL TEMPORARY TABLE temp_pack_extra (
        zoid NUMBER(20) NOT NULL PRIMARY KEY
    ) ON COMMIT PRESERVE ROWS""",
}

#: Every table RelStorage owns, in an order that can be dropped.
ALL_TABLES = ('blob_chunk', 'current_object', 'transaction_log', 'object_state',
              'commit_lock', 'temp_store', 'temp_blob_chunk') \
    + tuple(PACK_TABLES) + tuple(PACK_TEMP_TABLES) \
    + ('pack_removed',)     # (the removal lists of earlier versions)
SEQUENCES = ('zoid_seq',)


def drop_statements(existing):
    """DDL dropping what of ours exists (19c has no DROP ... IF EXISTS)."""
    stmts = ['DROP TABLE %s PURGE' % name for name in ALL_TABLES if name in existing]
    stmts += ['DROP SEQUENCE %s' % name for name in SEQUENCES if name in existing]
    return stmts
