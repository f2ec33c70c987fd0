"""PostgreSQL statements and schema.

Integers are BIGINT (OIDs and TIDs are 64-bit; ZODB never uses the sign
bit), pickles BYTEA.  Upserts use ``INSERT ... ON CONFLICT``.  Row locks
are taken with ``SELECT ... FOR UPDATE / FOR SHARE`` in OID order.
"""
from ..sql import EarlierReleaseReads
from ..sql import Statements

#: OIDs handed out per nextval(): the sequence counts in steps of this size
#: and each value ``v`` reserves the block ``v - OID_BLOCK + 1 .. v``.
OID_BLOCK = 16

#: Sequence values drawn by a process's first OID allocation (128 OIDs);
#: each later allocation draws twice as many as the one before, up to
#: OID_DRAWS_MAX (2048 OIDs a round trip).
OID_DRAWS_FIRST = 8
OID_DRAWS_MAX = 128

#: The schema the session's tables are made in (search_path's first): by
#: its name as it is, where current_schema()::regnamespace folds it to
#: lower case (a review finding: a schema named in mixed case was not
#: found, and every open after the first made the schema again).
CURRENT_SCHEMA_OID = "(SELECT oid FROM pg_namespace WHERE nspname = current_schema())"

def _extra_delete(table):
    """Deleting every row of ``table`` about the objects of temp_pack_extra
    (a join, with their range of OIDs said: otherwise a merge join read
    the table's key from its start to the highest of them, 56 ms a batch
    at a million objects)."""
    return """
        DELETE FROM %s x USING temp_pack_extra t WHERE x.zoid = t.zoid
        AND x.zoid BETWEEN (SELECT MIN(zoid) FROM temp_pack_extra)
                       AND (SELECT MAX(zoid) FROM temp_pack_extra)
    """ % table


class PostgreSQLStatements(Statements):

    PACK_REFS_MAY_VANISH = True     # object_ref is UNLOGGED (see PACK_SCHEMA)
    PACK_ANY_REF = "SELECT 1 FROM object_ref LIMIT 1"
    # The history-preserving candidates join a million pack-time
    # revisions to object_state by (zoid, tid), a join the planner
    # guesses 100 times too small: it then probes temp_pack_reach and
    # current_object once per object (4.7 s at a million objects, 2.7 s
    # with hash joins).  Whenever the candidates cover every object (not
    # after an incremental reachability, whose few objects are best
    # probed); history-free, the plan is the same either way.
    PACK_LARGE_JOINS_BEGIN = "SET LOCAL enable_nestloop = off"
    PACK_LARGE_JOINS_END = "SET LOCAL enable_nestloop TO DEFAULT"
    # The closure of a deletion batch follows a few thousand references
    # at most a step, each by the keys of the tables it joins; the
    # planner guesses each step ten times its first, and from a few
    # thousand objects (the children of a batch's containers, which
    # reference them back) it hash-joined whole tables at every step:
    # 0.9 s for 9,000 objects, 13 of the 17 s of a 480,000-object
    # deletion.  Past jit_above_cost it also compiled each closure (3 ms
    # for one that ran in 0.3).
    PACK_CLOSURE_BEGIN = ("SET LOCAL enable_hashjoin = off", "SET LOCAL enable_mergejoin = off",
                          "SET LOCAL jit = off")
    PACK_CLOSURE_END = ("SET LOCAL enable_hashjoin TO DEFAULT",
                        "SET LOCAL enable_mergejoin TO DEFAULT", "SET LOCAL jit TO DEFAULT")

    LOCK_COMMIT = "SELECT tid FROM commit_lock WHERE id = 0 FOR UPDATE"

    # A cluster's identifier is shared by its physical copies (replicas, a
    # restored backup): its start time tells them apart.
    DATABASE_IDENTITY = """
        SELECT system_identifier::text, current_database(), current_schema(),
               EXTRACT(EPOCH FROM pg_postmaster_start_time())
        FROM pg_control_system()
    """

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

    # Lists of OIDs are one array parameter (see Adapter.oid_statements):
    # one short statement for any number of OIDs.
    LOAD_CURRENT_MANY = """
        SELECT s.zoid, s.state, s.tid
        FROM current_object c
        JOIN object_state s ON s.zoid = c.zoid AND s.tid = c.tid
        WHERE c.zoid = ANY(%s::bigint[])
    """
    LOAD_CURRENT_MANY_HF = """
        SELECT zoid, state, tid FROM object_state WHERE zoid = ANY(%s::bigint[])
    """
    CURRENT_TIDS = "SELECT zoid, tid FROM current_object WHERE zoid = ANY(%s::bigint[])"
    UNDO_STATES = Statements.UNDO_STATES.replace(
        's.zoid IN ({in_list})', 's.zoid = ANY(%s::bigint[])')
    CURRENT_TIDS_HF = "SELECT zoid, tid FROM object_state WHERE zoid = ANY(%s::bigint[])"

    # Row locks.  Objects that do not exist yet have no row to lock; their
    # OIDs are new and unique to this transaction anyway.  Each locked
    # row's tid comes back with it (FOR UPDATE/SHARE returns the newest
    # committed version): the conflict and readCurrent checks need no
    # query of their own.
    LOCK_OBJECTS = """
        SELECT zoid, tid FROM current_object WHERE zoid = ANY(%s::bigint[])
        ORDER BY zoid FOR UPDATE
    """
    LOCK_OBJECTS_HF = """
        SELECT zoid, tid FROM object_state WHERE zoid = ANY(%s::bigint[])
        ORDER BY zoid FOR UPDATE
    """
    LOCK_READ_CURRENT = """
        SELECT zoid, tid FROM current_object WHERE zoid = ANY(%s::bigint[])
        ORDER BY zoid FOR SHARE
    """
    LOCK_READ_CURRENT_HF = """
        SELECT zoid, tid FROM object_state WHERE zoid = ANY(%s::bigint[])
        ORDER BY zoid FOR SHARE
    """

    COPY_TEMP = "COPY temp_store (zoid, prev_tid, state) FROM STDIN"
    # New objects straight into place (Adapter.insert_new_objects).
    COPY_NEW_OBJECTS = "COPY object_state (zoid, tid, prev_tid, state_size, state) FROM STDIN"
    COPY_NEW_OBJECTS_HF = "COPY object_state (zoid, tid, state_size, state) FROM STDIN"
    NEW_OBJECTS_CURRENT = """
        INSERT INTO current_object (zoid, tid) SELECT unnest(%s::bigint[]), %s
    """

    # clear_temp's reset (Adapter.temp_garbage_rows).
    RESET_TEMP_STORE = ("TRUNCATE temp_store",)
    RESET_TEMP_BLOBS = ("TRUNCATE temp_blob_chunk",)
    # A chunk is read in parts (Adapter.stream_blob_chunk): a value sent as
    # text (hex) takes twice its size, and past 1 GB PostgreSQL cannot
    # make it (a helper agent's check: a blob stored in 512 MB chunks,
    # blob-chunk-size's largest then, committed and could never be read,
    # "invalid memory alloc request size").  Chunks of blob-chunk-size
    # (1 MB by default) are one part: one query each, as before.
    LOAD_BLOB_CHUNK_PART = """
        SELECT substring(chunk FROM %s + 1 FOR %s)
        FROM blob_chunk WHERE zoid = %s AND tid = %s AND chunk_num = %s
    """

    # History-free blobs of what we write: the OIDs as one array, so that
    # blob_chunk is probed by its index whatever the planner guesses of
    # temp_store (never analysed; its deleted rows until the next reset
    # count in the guess: a join with it became a hash join over a
    # sequential scan of blob_chunk).
    DELETE_BLOBS_OF_WRITTEN_HF = """
        DELETE FROM blob_chunk WHERE zoid = ANY(ARRAY(SELECT zoid FROM temp_store))
    """

    # Commit lock, choice of the tid and its publication, and the pack
    # mark, in one round trip (Adapter.advance_tid).  The mark in a
    # statement of its own: read committed gives it a snapshot taken once
    # the UPDATE holds the lock, so it sees a pack batch that committed
    # while the UPDATE waited (which the UPDATE's own snapshot, taken
    # before the wait, would not).
    ADVANCE_TID = """
        UPDATE commit_lock SET tid = GREATEST(tid + 1, {now}) WHERE id = 0;
        SELECT MAX(CASE WHEN id = 0 THEN tid END), MAX(CASE WHEN id = 1 THEN tid END)
        FROM commit_lock WHERE id IN (0, 1)
    """

    # (reltuples is -1 until the table is first vacuumed or analyzed.)
    COUNT_ESTIMATE = """
        SELECT pg_relation_size(c.oid), c.reltuples::bigint
        FROM pg_class c WHERE c.oid = to_regclass(%s)
    """
    SIZE_OF_STATES = """
        SELECT COALESCE(pg_total_relation_size(to_regclass('object_state')), 0)
             + COALESCE(pg_total_relation_size(to_regclass('blob_chunk')), 0)
    """

    # Several sequence steps per round trip (each reserves OID_BLOCK OIDs).
    NEXT_OID_BLOCK = "SELECT nextval('zoid_seq') FROM generate_series(1, %s::integer)"
    OID_SEQUENCE_STATE = "SELECT last_value, is_called FROM zoid_seq"
    SET_OID_FLOOR = "SELECT setval('zoid_seq', %s)"

    # Pack: the references of analysed revisions, as arrays (adapter.py).
    PACK_REFS_FORGET_ARRAY = "DELETE FROM object_ref WHERE zoid = ANY(%s::bigint[])"
    PACK_REFS_OF_ARRAY = "SELECT zoid, to_zoid FROM object_ref WHERE zoid = ANY(%s::bigint[])"
    PACK_REFS_INSERT_ARRAYS = """
        INSERT INTO object_ref (zoid, tid, to_zoid)
        SELECT * FROM unnest(%s::bigint[], %s::bigint[], %s::bigint[])
    """

    # Pack: joins rather than IN (SELECT ...).  A batch is a range of OIDs;
    # saying so lets the planner read that range of each table's key (a
    # few milliseconds) where it would otherwise hash-join the whole table
    # (hundreds of milliseconds at a million rows): the bounds are unknown
    # at planning time, and guessed narrow.
    _IN_BATCH = """
        BETWEEN (SELECT MIN(zoid) FROM temp_pack_batch)
            AND (SELECT MAX(zoid) FROM temp_pack_batch)
    """
    PACK_DELETE_STATES = """
        DELETE FROM object_state s USING temp_pack_batch t
        WHERE s.zoid = t.zoid AND s.tid < t.below AND s.zoid """ + _IN_BATCH
    PACK_DELETE_BLOBS = """
        DELETE FROM blob_chunk b USING temp_pack_batch t
        WHERE b.zoid = t.zoid AND b.tid < t.below AND b.zoid """ + _IN_BATCH
    PACK_DELETE_REFS = """
        DELETE FROM object_ref r USING temp_pack_batch t
        WHERE r.zoid = t.zoid AND r.tid < t.below AND r.zoid """ + _IN_BATCH
    PACK_DELETE_CURRENT = """
        DELETE FROM current_object c USING temp_pack_batch t
        WHERE c.zoid = t.zoid AND t.garbage = 1 AND c.zoid """ + _IN_BATCH
    # The batch's range of OIDs said (see _IN_BATCH): a 5,000-row batch
    # hash-joined the whole edge table otherwise (33 ms for 383,000
    # edges, 2 ms this way).
    PACK_EXTRA_FIRST = Statements.PACK_EXTRA_FIRST.rstrip() + """
          AND e.to_zoid """ + _IN_BATCH
    PACK_EXTRA_DELETE_BLOBS = _extra_delete('blob_chunk')
    PACK_EXTRA_DELETE_STATES = _extra_delete('object_state')
    PACK_EXTRA_DELETE_CURRENT = _extra_delete('current_object')
    PACK_EXTRA_DELETE_REFS = _extra_delete('object_ref')
    PACK_UNMARK = """
        UPDATE pack_object p SET garbage = 0
        FROM temp_pack_frontier f WHERE p.zoid = f.zoid
    """
    # Autovacuum never analyses temporary tables: without this the planner
    # guesses their size and may loop over millions of rows.
    PACK_ANALYZE = "ANALYZE {table}"
    #: Fresh planner statistics of a table (Adapter.refresh_statistics).
    ANALYZE_TABLE = PACK_ANALYZE
    #: The lock the creation of the schema is made under (see
    #: PostgreSQLAdapter.begin_schema_creation).
    SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(7243910378)"
    #: Key of the session-level advisory lock only one pack holds.
    #: Per schema (a helper agent's check: a pack of the storage in one
    #: schema of a database was refused, "already running", while the
    #: storage of another schema packed); the key of earlier releases for
    #: the public schema, so that one of theirs and one of ours still
    #: exclude each other there.
    _PACK_LOCK_KEY = ("CASE WHEN current_schema() = 'public' THEN 7243910377 "
                      "ELSE 7243910377 + 4294967296 + hashtext(current_schema()) END")
    TRY_PACK_LOCK = "SELECT pg_try_advisory_lock(%s)" % _PACK_LOCK_KEY
    RELEASE_PACK_LOCK = "SELECT pg_advisory_unlock(%s)" % _PACK_LOCK_KEY

    LIST_TABLES = """
        SELECT c.relname FROM pg_class c
        WHERE c.relkind IN ('r', 'p', 'S')
          AND c.relnamespace = """ + CURRENT_SCHEMA_OID + """
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

#: Private to each session.  Not ON COMMIT DELETE ROWS: that truncates
#: every such table, and rebuilds its indexes, at each commit of a
#: transaction that used one, with a file truncation each that waits for
#: the file system's journal.  A quarter of a small commit's time went
#: there, and under a pack's writes a commit took 10-20 ms instead of 3.
#: clear_temp deletes the rows instead, and truncates the table once in a
#: while (Adapter.temp_garbage_rows: autovacuum never visits a temporary
#: table, so the space of deleted rows is not reused).  No index: every
#: statement reads the whole table (the moves, FIX_PREV_TIDS, the blobs'
#: DELETE_BLOBS_OF_WRITTEN_HF), and each upload holds an OID once
#: (Commit's TempStore; a copied transaction's last record of each
#: object, copy._last_of_each), so a primary key only cost its upkeep: a
#: 1000-row COPY took 1.1 ms instead of 1.4, and TRUNCATE makes one file
#: less.
TEMP_STORE = """
    CREATE TEMP TABLE IF NOT EXISTS temp_store (
        zoid BIGINT NOT NULL,
        prev_tid BIGINT NOT NULL,
        state BYTEA
    )
"""

TEMP_BLOB_CHUNK = """
    CREATE TEMP TABLE IF NOT EXISTS temp_blob_chunk (
        zoid BIGINT NOT NULL,
        chunk_num BIGINT NOT NULL,
        chunk BYTEA NOT NULL,
        PRIMARY KEY (zoid, chunk_num)
    )
"""

# object_ref and pack_object are UNLOGGED: what they hold is derived from
# object_state and made again when lost, and writing a million rows of them
# through the WAL made the commits of a live site wait behind the pack's
# log flushes and checkpoints (the writer's p99 three times lower without
# it, and the pack 15 % shorter).  A crash, or a standby promoted, leaves
# them empty; Statements.PACK_REFS_MAY_VANISH makes the next pack see it.
PACK_SCHEMA = (
    """CREATE UNLOGGED TABLE IF NOT EXISTS object_ref (
        zoid BIGINT NOT NULL,
        tid BIGINT NOT NULL,
        to_zoid BIGINT NOT NULL,
        PRIMARY KEY (zoid, tid, to_zoid)
    )""",
    "CREATE INDEX IF NOT EXISTS object_ref_tid ON object_ref (tid)",
    """CREATE UNLOGGED TABLE IF NOT EXISTS pack_object (
        zoid BIGINT PRIMARY KEY,
        keep_tid BIGINT NOT NULL,
        garbage SMALLINT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS pack_info (
        name VARCHAR(32) PRIMARY KEY,
        value BIGINT NOT NULL
    )""",
    # Logged: what it says is not derived from other tables (a few rows
    # per changed object, until the next pack).
    "CREATE TABLE IF NOT EXISTS pack_seed (zoid BIGINT PRIMARY KEY)",
    """CREATE TABLE IF NOT EXISTS pack_removed_list (
        mark BIGINT PRIMARY KEY,
        garbage BYTEA NOT NULL,
        trimmed BYTEA NOT NULL
    )""",
)

#: The pack's work tables, named -> DDL (rows survive commits).
PACK_TEMP_TABLES = {
    'temp_pack_current': """CREATE TEMP TABLE IF NOT EXISTS temp_pack_current (
        zoid BIGINT PRIMARY KEY, tid BIGINT NOT NULL, revisions BIGINT NOT NULL)""",
    'temp_pack_reach': "CREATE TEMP TABLE IF NOT EXISTS temp_pack_reach (zoid BIGINT PRIMARY KEY)",
    'temp_pack_frontier':
        "CREATE TEMP TABLE IF NOT EXISTS temp_pack_frontier (zoid BIGINT PRIMARY KEY)",
    'temp_pack_next': "CREATE TEMP TABLE IF NOT EXISTS temp_pack_next (zoid BIGINT PRIMARY KEY)",
    'temp_pack_dom': "CREATE TEMP TABLE IF NOT EXISTS temp_pack_dom (zoid BIGINT PRIMARY KEY)",
    'temp_pack_seed': "CREATE TEMP TABLE IF NOT EXISTS temp_pack_seed (zoid BIGINT PRIMARY KEY)",
    'temp_pack_batch': """CREATE TEMP TABLE IF NOT EXISTS temp_pack_batch (
        zoid BIGINT PRIMARY KEY, below BIGINT NOT NULL, garbage SMALLINT NOT NULL)""",
    'temp_pack_edges': """CREATE TEMP TABLE IF NOT EXISTS temp_pack_edges (
        to_zoid BIGINT, zoid BIGINT, PRIMARY KEY (to_zoid, zoid))""",
    'temp_pack_extra': "CREATE TEMP TABLE IF NOT EXISTS temp_pack_extra (zoid BIGINT PRIMARY KEY)",
}

DROP_ALL = (
    "DROP TABLE IF EXISTS blob_chunk, current_object, transaction_log, object_state, "
    "commit_lock, object_ref, pack_object, pack_info, pack_removed_list, pack_removed, "
    "pack_seed CASCADE",
    "DROP SEQUENCE IF EXISTS zoid_seq",
)


class PostgreSQLEarlierReleaseReads(EarlierReleaseReads):
    # The earlier releases kept each blob chunk in a large object (its
    # column holds the large object's oid), a whole blob in one: read in
    # parts, as one value (bytea) cannot pass 1 GB.
    LOAD_BLOB_CHUNK = """
        SELECT lo_get(chunk) FROM blob_chunk WHERE zoid = %s AND tid = %s AND chunk_num = %s
    """
    LOAD_BLOB_CHUNK_PART = """
        SELECT lo_get(chunk, %s, %s)
        FROM blob_chunk WHERE zoid = %s AND tid = %s AND chunk_num = %s
    """
