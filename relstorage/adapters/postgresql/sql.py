"""PostgreSQL statements and schema.

Integers are BIGINT (OIDs and TIDs are 64-bit; ZODB never uses the sign
bit), pickles BYTEA.  Upserts use ``INSERT ... ON CONFLICT``.  Row locks
are taken with ``SELECT ... FOR UPDATE / FOR SHARE`` in OID order.
"""
from ..sql import Statements

#: OIDs handed out per nextval(): the sequence counts in steps of this size
#: and each value ``v`` reserves the block ``v - OID_BLOCK + 1 .. v``.
OID_BLOCK = 16

#: Below this size len(storage) counts exactly (cheap); above, it is the
#: estimate PostgreSQL keeps in pg_class.reltuples.
SMALL_TABLE_BYTES = 32 << 20


class PostgreSQLStatements(Statements):

    LOCK_COMMIT = "SELECT tid FROM commit_lock WHERE id = 0 FOR UPDATE"

    UPDATE_CURRENT = """
        INSERT INTO current_object (zoid, tid)
        SELECT zoid, %s FROM temp_store
        ON CONFLICT (zoid) DO UPDATE SET tid = excluded.tid
    """

    MOVE_FROM_TEMP_HF = """
        INSERT INTO object_state (zoid, tid, state_size, state)
        SELECT zoid, %s, COALESCE(LENGTH(state), 0), state FROM temp_store
        ON CONFLICT (zoid) DO UPDATE SET
            tid = excluded.tid,
            state_size = excluded.state_size,
            state = excluded.state
    """

    # Row locks.  Objects that do not exist yet have no row to lock; their
    # OIDs are new and unique to this transaction anyway.
    LOCK_OBJECTS = """
        SELECT zoid FROM current_object WHERE zoid = ANY(%s::bigint[])
        ORDER BY zoid FOR UPDATE
    """
    LOCK_OBJECTS_HF = """
        SELECT zoid FROM object_state WHERE zoid = ANY(%s::bigint[])
        ORDER BY zoid FOR UPDATE
    """
    LOCK_READ_CURRENT = """
        SELECT zoid FROM current_object WHERE zoid = ANY(%s::bigint[])
        ORDER BY zoid FOR SHARE
    """
    LOCK_READ_CURRENT_HF = """
        SELECT zoid FROM object_state WHERE zoid = ANY(%s::bigint[])
        ORDER BY zoid FOR SHARE
    """

    COPY_TEMP = "COPY temp_store (zoid, prev_tid, state) FROM STDIN"

    # Commit lock, choice of the tid and its publication in one round trip.
    ADVANCE_TID = """
        UPDATE commit_lock SET tid = GREATEST(tid + 1, %s) WHERE id = 0 RETURNING tid
    """

    # Exact below SMALL_TABLE_BYTES, else the planner's estimate: an exact
    # count of a big table is a full scan.
    COUNT_ESTIMATE = """
        SELECT pg_relation_size(c.oid), c.reltuples::bigint
        FROM pg_class c WHERE c.oid = to_regclass(%s)
    """
    COUNT_OBJECTS_EXACT = "SELECT COUNT(*) FROM current_object"
    COUNT_OBJECTS_EXACT_HF = "SELECT COUNT(*) FROM object_state"
    COUNTED_TABLE = "current_object"
    COUNTED_TABLE_HF = "object_state"
    SIZE_OF_STATES = """
        SELECT COALESCE(pg_total_relation_size(to_regclass('object_state')), 0)
             + COALESCE(pg_total_relation_size(to_regclass('blob_chunk')), 0)
    """

    # Several sequence steps per round trip (each reserves OID_BLOCK OIDs).
    NEXT_OID_BLOCK = "SELECT nextval('zoid_seq') FROM generate_series(1, 8)"
    OID_SEQUENCE_STATE = "SELECT last_value, is_called FROM zoid_seq"
    SET_OID_FLOOR = "SELECT setval('zoid_seq', %s)"

    LIST_TABLES = """
        SELECT c.relname FROM pg_class c
        WHERE c.relkind IN ('r', 'p', 'S')
          AND c.relnamespace = to_regnamespace(current_schema())::oid
    """


_COMMON_HEAD = (
    "CREATE SEQUENCE zoid_seq INCREMENT BY %d START WITH %d MINVALUE 0"
    % (OID_BLOCK, OID_BLOCK),
    """CREATE TABLE commit_lock (
        id INTEGER PRIMARY KEY,
        tid BIGINT NOT NULL
    )""",
    "INSERT INTO commit_lock (id, tid) VALUES (0, 0)",
)

# Blob bytes, the same in both history modes.
_BLOB_CHUNK_TABLE = (
    """CREATE TABLE blob_chunk (
        zoid BIGINT NOT NULL,
        tid BIGINT NOT NULL,
        chunk_num BIGINT NOT NULL,
        chunk BYTEA NOT NULL,
        PRIMARY KEY (zoid, tid, chunk_num)
    )""",
    # Blobs are often compressed already: store chunks out of line as they
    # are instead of trying pglz on every megabyte.
    "ALTER TABLE blob_chunk ALTER COLUMN chunk SET STORAGE EXTERNAL",
)

HISTORY_PRESERVING_SCHEMA = _COMMON_HEAD + (
    """CREATE TABLE transaction_log (
        tid BIGINT PRIMARY KEY,
        packed BOOLEAN NOT NULL DEFAULT FALSE,
        is_empty BOOLEAN NOT NULL DEFAULT FALSE,
        username BYTEA NOT NULL,
        description BYTEA NOT NULL,
        extension BYTEA
    )""",
    """CREATE TABLE object_state (
        zoid BIGINT NOT NULL,
        tid BIGINT NOT NULL,
        prev_tid BIGINT NOT NULL,
        state_size BIGINT NOT NULL,
        state BYTEA,
        PRIMARY KEY (zoid, tid)
    )""",
    "CREATE INDEX object_state_tid ON object_state (tid)",
    """CREATE TABLE current_object (
        zoid BIGINT PRIMARY KEY,
        tid BIGINT NOT NULL
    )""",
    "CREATE INDEX current_object_tid ON current_object (tid)",
) + _BLOB_CHUNK_TABLE

HISTORY_FREE_SCHEMA = _COMMON_HEAD + (
    """CREATE TABLE object_state (
        zoid BIGINT PRIMARY KEY,
        tid BIGINT NOT NULL,
        state_size BIGINT NOT NULL,
        state BYTEA
    )""",
    "CREATE INDEX object_state_tid ON object_state (tid)",
) + _BLOB_CHUNK_TABLE

#: Private to each session; emptied at every commit (no dead rows pile up:
#: autovacuum never visits temporary tables).
TEMP_STORE = """
    CREATE TEMP TABLE IF NOT EXISTS temp_store (
        zoid BIGINT PRIMARY KEY,
        prev_tid BIGINT NOT NULL,
        state BYTEA
    ) ON COMMIT DELETE ROWS
"""

TEMP_BLOB_CHUNK = """
    CREATE TEMP TABLE IF NOT EXISTS temp_blob_chunk (
        zoid BIGINT NOT NULL,
        chunk_num BIGINT NOT NULL,
        chunk BYTEA NOT NULL,
        PRIMARY KEY (zoid, chunk_num)
    ) ON COMMIT DELETE ROWS
"""

DROP_ALL = (
    "DROP TABLE IF EXISTS blob_chunk, current_object, transaction_log, object_state, "
    "commit_lock CASCADE",
    "DROP SEQUENCE IF EXISTS zoid_seq",
)
