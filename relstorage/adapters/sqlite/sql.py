"""SQLite statements and schema."""
import re

from ..sql import Statements


def _in_written_order(stmt):
    """``stmt`` with its inner joins written CROSS JOIN, which SQLite joins
    in the order written (its LEFT JOINs stay)."""
    return re.sub(r'^(\s*)JOIN ', r'\1CROSS JOIN ', stmt, flags=re.M)


class SqliteStatements(Statements):

    # The size of the main database file (as FileStorage's is its file's).
    SIZE_OF_STATES = "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()"

    # SQLite parses "INSERT ... SELECT ... ON CONFLICT" only when the SELECT
    # has a WHERE clause, hence the "WHERE true".
    UPDATE_CURRENT = """
        INSERT INTO current_object (zoid, tid)
        SELECT zoid, %s FROM temp_store WHERE true
        ON CONFLICT (zoid) DO UPDATE SET tid = excluded.tid
    """

    # The bytes of blob chunks each candidate of a batch would remove, and
    # the batch cut after one (PackVerbs._within_blob_budget: only where a
    # batch holds the commit lock for all of its deletions).
    PACK_BATCH_BLOB_BYTES = """
        SELECT t.zoid, SUM(LENGTH(b.chunk))
        FROM temp_pack_batch t
        JOIN blob_chunk b ON b.zoid = t.zoid AND b.tid < t.below
        GROUP BY t.zoid
        ORDER BY t.zoid
    """
    PACK_BATCH_CUT = "DELETE FROM temp_pack_batch WHERE zoid > %s"
    PACK_BATCH_CUT_BEFORE = "DELETE FROM temp_pack_batch WHERE zoid >= %s"
    PACK_BATCH_FIRST = "SELECT MIN(zoid) FROM temp_pack_batch"
    PACK_BATCH_BELOW = "SELECT below FROM temp_pack_batch WHERE zoid = %s"
    PACK_BLOB_BYTES_BY_REVISION = """
        SELECT tid, SUM(LENGTH(chunk)) FROM blob_chunk
        WHERE zoid = %s AND tid < %s
        GROUP BY tid
        ORDER BY tid
    """
    PACK_BATCH_LOWER = "UPDATE temp_pack_batch SET below = %s, garbage = 0 WHERE zoid = %s"

    MOVE_FROM_TEMP_HF = """
        INSERT INTO object_state (zoid, tid, state_size, state)
        SELECT zoid, %s, COALESCE(LENGTH(state), 0), state FROM temp_store WHERE true
        ON CONFLICT (zoid) DO UPDATE SET
            tid = excluded.tid,
            state_size = excluded.state_size,
            state = excluded.state
    """

    INSERT_IGNORE = 'INSERT OR IGNORE INTO'
    INSERT_IGNORE_END = ''

    # SQLite takes CROSS JOIN as the order to join in.  Without it, and
    # without statistics (ANALYZE would take the write lock), it drove
    # these from the large table, scanning every reference (or every
    # current object) for a frontier of a few objects: half a second per
    # re-check of a million-object pack, all of it under the write lock.
    # The incremental reachability likewise: from the small work tables
    # into object_ref and object_state by their keys, and through
    # object_ref once, probing the work tables, for the entries.
    PACK_REACH_STEP = _in_written_order(Statements.PACK_REACH_STEP)
    PACK_REACH_STEP_HF = _in_written_order(Statements.PACK_REACH_STEP_HF)
    PACK_RESCUE_STEP = _in_written_order(Statements.PACK_RESCUE_STEP)
    PACK_DOM_STEP = _in_written_order(Statements.PACK_DOM_STEP)
    PACK_FILL_CURRENT_DOM = _in_written_order(Statements.PACK_FILL_CURRENT_DOM)
    PACK_DOM_ENTRIES = _in_written_order(Statements.PACK_DOM_ENTRIES)
    PACK_DOM_ENTRIES_AT = _in_written_order(Statements.PACK_DOM_ENTRIES_AT)
    PACK_FILL_DOM = _in_written_order(Statements.PACK_FILL_DOM)
    PACK_LATE_DOM_AT = _in_written_order(Statements.PACK_LATE_DOM_AT)
    PACK_SEED_DROPPED = _in_written_order(Statements.PACK_SEED_DROPPED)
    PACK_LATE_DOM = _in_written_order(Statements.PACK_LATE_DOM)
    PACK_LATE_ENTRIES = _in_written_order(Statements.PACK_LATE_ENTRIES)
    PACK_REACH_STEP_DOM = _in_written_order(Statements.PACK_REACH_STEP_DOM)
    PACK_EDGES_FILL = _in_written_order(Statements.PACK_EDGES_FILL)
    PACK_EXTRA_FIRST = _in_written_order(Statements.PACK_EXTRA_FIRST)
    PACK_EXTRA_STEP = _in_written_order(Statements.PACK_EXTRA_STEP)
    PACK_EXTRA_CLOSURE = _in_written_order(Statements.PACK_EXTRA_CLOSURE)

    # The pack's tables are in a file of their own (PACK_APART_SCHEMA):
    # the references and candidates of what the deletion batches removed
    # go once the batches are on disk, out of the main file's lock
    # (PackVerbs.forget_deleted).  The batches go by OID: those up to the
    # last one removed every candidate of the range (parameters: after,
    # upto, ALL_REVISIONS).
    PACK_DONE_REFS = """
        DELETE FROM object_ref
        WHERE zoid IN (SELECT zoid FROM pack_object WHERE zoid > %s AND zoid <= %s)
          AND tid < (SELECT CASE WHEN p.garbage = 1 THEN %s ELSE p.keep_tid END
                     FROM pack_object p WHERE p.zoid = object_ref.zoid)
    """
    PACK_DONE_OBJECTS = "DELETE FROM pack_object WHERE zoid > %s AND zoid <= %s"


#: The pack's own tables, in a database file of their own attached as
#: ``pack`` (see Sqlite3Adapter.open_pack): only the pack writes them, and
#: a write there takes that file's lock, not the one every commit needs.
#: (Statements name them unqualified: SQLite finds them in the attached
#: file once the main one has no table of that name.)
PACK_APART_TABLES = ('object_ref', 'pack_object', 'pack_info', 'pack_seed')
PACK_APART_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS pack.object_ref (
        zoid INTEGER NOT NULL,
        tid INTEGER NOT NULL,
        to_zoid INTEGER NOT NULL,
        PRIMARY KEY (zoid, tid, to_zoid)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS pack.object_ref_tid ON object_ref (tid)",
    """CREATE TABLE IF NOT EXISTS pack.pack_object (
        zoid INTEGER PRIMARY KEY,
        keep_tid INTEGER NOT NULL,
        garbage INTEGER NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS pack.pack_info (
        name TEXT PRIMARY KEY,
        value INTEGER NOT NULL
    )""",
    "CREATE TABLE IF NOT EXISTS pack.pack_seed (zoid INTEGER PRIMARY KEY)",
)

#: In the main file: pack_removed_list, which the deletion batches write in
#: the transaction that deletes (other processes read it with the rows
#: gone, see PackVerbs.pack_removals), and pack_pairing, the token that
#: says which pack.sqlite3 goes with this main file (Sqlite3Adapter.
#: pair_pack_tables).
PACK_MAIN_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS pack_removed_list (
        mark INTEGER PRIMARY KEY,
        garbage BLOB NOT NULL,
        trimmed BLOB NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS pack_pairing (
        id INTEGER PRIMARY KEY,
        token INTEGER NOT NULL
    )""",
)

#: The pack's work tables, named -> DDL.
PACK_TEMP_TABLES = {
    'temp_pack_current': """CREATE TEMP TABLE IF NOT EXISTS temp_pack_current (
        zoid INTEGER PRIMARY KEY, tid INTEGER NOT NULL, revisions INTEGER NOT NULL)""",
    'temp_pack_reach': "CREATE TEMP TABLE IF NOT EXISTS temp_pack_reach (zoid INTEGER PRIMARY KEY)",
    'temp_pack_frontier':
        "CREATE TEMP TABLE IF NOT EXISTS temp_pack_frontier (zoid INTEGER PRIMARY KEY)",
    'temp_pack_next': "CREATE TEMP TABLE IF NOT EXISTS temp_pack_next (zoid INTEGER PRIMARY KEY)",
    'temp_pack_dom': "CREATE TEMP TABLE IF NOT EXISTS temp_pack_dom (zoid INTEGER PRIMARY KEY)",
    'temp_pack_seed': "CREATE TEMP TABLE IF NOT EXISTS temp_pack_seed (zoid INTEGER PRIMARY KEY)",
    'temp_pack_batch': """CREATE TEMP TABLE IF NOT EXISTS temp_pack_batch (
        zoid INTEGER PRIMARY KEY, below INTEGER NOT NULL, garbage INTEGER NOT NULL)""",
    'temp_pack_edges': """CREATE TEMP TABLE IF NOT EXISTS temp_pack_edges (
        to_zoid INTEGER NOT NULL, zoid INTEGER NOT NULL, PRIMARY KEY (to_zoid, zoid))
        WITHOUT ROWID""",
    'temp_pack_extra': "CREATE TEMP TABLE IF NOT EXISTS temp_pack_extra (zoid INTEGER PRIMARY KEY)",
}

# Blob bytes, the same in both history modes.
_BLOB_CHUNK_TABLE = (
    """CREATE TABLE blob_chunk (
        zoid INTEGER NOT NULL,
        tid INTEGER NOT NULL,
        chunk_num INTEGER NOT NULL,
        chunk BLOB NOT NULL,
        PRIMARY KEY (zoid, tid, chunk_num)
    )""",
)

HISTORY_PRESERVING_SCHEMA = (
    "CREATE TABLE commit_lock (id INTEGER PRIMARY KEY, tid INTEGER NOT NULL)",
    "INSERT INTO commit_lock (id, tid) VALUES (0, 0)",
    """CREATE TABLE transaction_log (
        tid INTEGER PRIMARY KEY,
        packed BOOLEAN NOT NULL DEFAULT 0,
        is_empty BOOLEAN NOT NULL DEFAULT 0,
        username BLOB NOT NULL,
        description BLOB NOT NULL,
        extension BLOB
    )""",
    """CREATE TABLE object_state (
        zoid INTEGER NOT NULL,
        tid INTEGER NOT NULL,
        prev_tid INTEGER NOT NULL,
        state_size INTEGER NOT NULL,
        state BLOB,
        PRIMARY KEY (zoid, tid)
    )""",
    "CREATE INDEX object_state_tid ON object_state (tid)",
    """CREATE TABLE current_object (
        zoid INTEGER PRIMARY KEY,
        tid INTEGER NOT NULL
    )""",
    "CREATE INDEX current_object_tid ON current_object (tid)",
) + _BLOB_CHUNK_TABLE

HISTORY_FREE_SCHEMA = (
    "CREATE TABLE commit_lock (id INTEGER PRIMARY KEY, tid INTEGER NOT NULL)",
    "INSERT INTO commit_lock (id, tid) VALUES (0, 0)",
    """CREATE TABLE object_state (
        zoid INTEGER PRIMARY KEY,
        tid INTEGER NOT NULL,
        state_size INTEGER NOT NULL,
        state BLOB
    )""",
    "CREATE INDEX object_state_tid ON object_state (tid)",
) + _BLOB_CHUNK_TABLE

TEMP_STORE = """
    CREATE TEMP TABLE IF NOT EXISTS temp_store (
        zoid INTEGER PRIMARY KEY,
        prev_tid INTEGER NOT NULL,
        state BLOB
    )
"""

TEMP_BLOB_CHUNK = """
    CREATE TEMP TABLE IF NOT EXISTS temp_blob_chunk (
        zoid INTEGER NOT NULL,
        chunk_num INTEGER NOT NULL,
        chunk BLOB NOT NULL,
        PRIMARY KEY (zoid, chunk_num)
    )
"""

OID_SCHEMA = """
    CREATE TABLE IF NOT EXISTS oid_counter (id INTEGER PRIMARY KEY, next_oid INTEGER NOT NULL)
"""
