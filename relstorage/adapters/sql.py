"""ANSI statements shared by the adapters, as named constants.

Placeholders are written ``%s`` (the DB-API "format" style shared by psycopg,
psycopg2, MySQLdb and PyMySQL); adapters whose driver wants another style
convert once when they are built.  Identifiers are fixed; values are always
bound parameters.  A vendor overrides a statement by subclassing and
replacing the attribute, never by editing a string at run time.

Tables (both modes):

``commit_lock``      row 0: ``tid`` is the last committed transaction id.
                     Locking that row is the database-wide commit lock, and
                     reading it is how pollers learn the newest snapshot.
                     Row 1 (written by the first pack): the pack mark, a
                     counter every pack increments, so that other processes
                     learn, with the same query, that cached revisions and
                     objects may be gone.
``object_state``     pickles.  History-free: one row per object (``zoid``
                     primary key).  History-preserving: one row per revision
                     (``zoid``, ``tid``), plus ``current_object`` pointing at
                     the newest one and ``transaction_log`` holding metadata.
                     A NULL ``state`` means the object does not exist at that
                     revision (creation undone, or deleted by external GC).
``temp_store``       per-connection temporary table holding the states of the
                     transaction being committed until they move into place.
"""


class Statements:
    """Statements for one history mode; adapters subclass per vendor."""

    keep_history = True

    def __init__(self, keep_history):
        self.keep_history = keep_history
        if not keep_history:
            for name in dir(self):
                if name.endswith('_HF'):
                    setattr(self, name[:-3], getattr(self, name))

    # --- snapshot reads -------------------------------------------------

    GET_LAST_TID = "SELECT tid FROM commit_lock WHERE id = 0"
    GET_SNAPSHOT_MARKS = "SELECT id, tid FROM commit_lock WHERE id IN (0, 1)"
    GET_PACK_MARK = "SELECT tid FROM commit_lock WHERE id = 1"
    SET_PACK_MARK = "UPDATE commit_lock SET tid = %s WHERE id = 1"
    INSERT_PACK_MARK = "INSERT INTO commit_lock (id, tid) VALUES (1, %s)"

    LOAD_CURRENT = """
        SELECT s.state, s.tid
        FROM current_object c
        JOIN object_state s ON s.zoid = c.zoid AND s.tid = c.tid
        WHERE c.zoid = %s
    """
    LOAD_CURRENT_HF = "SELECT state, tid FROM object_state WHERE zoid = %s"

    LOAD_CURRENT_MANY = """
        SELECT s.zoid, s.state, s.tid
        FROM current_object c
        JOIN object_state s ON s.zoid = c.zoid AND s.tid = c.tid
        WHERE c.zoid IN ({in_list})
    """
    LOAD_CURRENT_MANY_HF = """
        SELECT zoid, state, tid FROM object_state WHERE zoid IN ({in_list})
    """

    LOAD_REVISION = """
        SELECT state FROM object_state WHERE zoid = %s AND tid = %s
    """
    LOAD_REVISION_HF = """
        SELECT state FROM object_state WHERE zoid = %s AND tid = %s
    """

    LOAD_BEFORE = """
        SELECT state, tid FROM object_state
        WHERE zoid = %s AND tid < %s
        ORDER BY tid DESC
        LIMIT 1
    """

    NEXT_TID_AFTER = """
        SELECT MIN(tid) FROM object_state WHERE zoid = %s AND tid > %s
    """

    CURRENT_TIDS = "SELECT zoid, tid FROM current_object WHERE zoid IN ({in_list})"
    CURRENT_TIDS_HF = "SELECT zoid, tid FROM object_state WHERE zoid IN ({in_list})"

    POLL_CHANGES = """
        SELECT zoid, tid FROM current_object WHERE tid > %s AND tid <= %s
    """
    POLL_CHANGES_HF = """
        SELECT zoid, tid FROM object_state WHERE tid > %s AND tid <= %s
    """

    # The newest changes up to a snapshot, newest first: a fresh process
    # starts its change log with them (cache/storage_cache.py, backfill).
    RECENT_CHANGES = """
        SELECT zoid, tid FROM current_object WHERE tid <= %s
        ORDER BY tid DESC LIMIT %s
    """
    RECENT_CHANGES_HF = """
        SELECT zoid, tid FROM object_state WHERE tid <= %s
        ORDER BY tid DESC LIMIT %s
    """

    COUNT_OBJECTS = "SELECT COUNT(*) FROM current_object"
    COUNT_OBJECTS_HF = "SELECT COUNT(*) FROM object_state"
    COUNT_REVISIONS = "SELECT COUNT(*) FROM object_state"

    SIZE_OF_STATES = "SELECT COALESCE(SUM(state_size), 0) FROM object_state"

    # --- history-preserving metadata ------------------------------------

    HISTORY = """
        SELECT s.tid, s.state_size, t.username, t.description, t.extension
        FROM object_state s
        JOIN transaction_log t ON t.tid = s.tid
        WHERE s.zoid = %s
        ORDER BY s.tid DESC
        LIMIT %s
    """
    HISTORY_HF = """
        SELECT tid, state_size, NULL, NULL, NULL
        FROM object_state
        WHERE zoid = %s
        LIMIT %s
    """

    TRANSACTIONS_IN_RANGE = """
        SELECT tid, username, description, extension, packed
        FROM transaction_log
        WHERE tid >= %s AND tid <= %s AND is_empty = %s
        ORDER BY tid
    """
    ALL_TRANSACTIONS_IN_RANGE = """
        SELECT tid, username, description, extension, packed
        FROM transaction_log
        WHERE tid >= %s AND tid <= %s
        ORDER BY tid
    """
    TIDS_IN_RANGE_HF = """
        SELECT DISTINCT tid FROM object_state
        WHERE tid >= %s AND tid <= %s
        ORDER BY tid
    """

    RECORDS_IN_TRANSACTION = """
        SELECT zoid, state, prev_tid FROM object_state WHERE tid = %s ORDER BY zoid
    """
    RECORDS_IN_TRANSACTION_HF = """
        SELECT zoid, state, 0 FROM object_state WHERE tid = %s ORDER BY zoid
    """

    UNDO_LOG = """
        SELECT tid, username, description, extension
        FROM transaction_log
        WHERE packed = %s AND is_empty = %s AND tid <= %s
        ORDER BY tid DESC
    """

    # After a COMMIT whose answer was lost (see Adapter.commit_outcome).
    TID_HAS_STATES = "SELECT zoid FROM object_state WHERE tid = %s LIMIT 1"

    TRANSACTION_EXISTS = """
        SELECT packed FROM transaction_log WHERE tid = %s
    """

    OBJECTS_IN_TRANSACTION = "SELECT zoid FROM object_state WHERE tid = %s"

    RECORD_ITERNEXT = """
        SELECT s.zoid, s.tid, s.state
        FROM current_object c
        JOIN object_state s ON s.zoid = c.zoid AND s.tid = c.tid
        WHERE c.zoid >= %s AND s.state IS NOT NULL
        ORDER BY c.zoid
        LIMIT 2
    """
    RECORD_ITERNEXT_HF = """
        SELECT zoid, tid, state
        FROM object_state
        WHERE zoid >= %s AND state IS NOT NULL
        ORDER BY zoid
        LIMIT 2
    """

    # --- commit -------------------------------------------------------

    CLEAR_TEMP = "DELETE FROM temp_store"

    INSERT_TEMP = """
        INSERT INTO temp_store (zoid, prev_tid, state) VALUES (%s, %s, %s)
    """

    DELETE_TEMP_MANY = "DELETE FROM temp_store WHERE zoid IN ({in_list})"

    DETECT_CONFLICTS = """
        SELECT t.zoid, c.tid, t.prev_tid
        FROM temp_store t
        JOIN current_object c ON c.zoid = t.zoid
        WHERE c.tid <> t.prev_tid
    """
    DETECT_CONFLICTS_HF = """
        SELECT t.zoid, s.tid, t.prev_tid
        FROM temp_store t
        JOIN object_state s ON s.zoid = t.zoid
        WHERE s.tid <> t.prev_tid
    """

    FIX_PREV_TIDS = """
        UPDATE temp_store SET prev_tid = COALESCE(
            (SELECT c.tid FROM current_object c WHERE c.zoid = temp_store.zoid), 0)
    """
    FIX_PREV_TIDS_HF = """
        UPDATE temp_store SET prev_tid = COALESCE(
            (SELECT s.tid FROM object_state s WHERE s.zoid = temp_store.zoid), 0)
    """

    # Taking the commit lock returns the last committed tid.
    LOCK_COMMIT = "SELECT tid FROM commit_lock WHERE id = 0"

    SET_LAST_TID = "UPDATE commit_lock SET tid = %s WHERE id = 0"

    MOVE_FROM_TEMP = """
        INSERT INTO object_state (zoid, tid, prev_tid, state_size, state)
        SELECT zoid, %s, prev_tid, COALESCE(LENGTH(state), 0), state
        FROM temp_store
    """
    # HF upserts are vendor syntax; each adapter supplies MOVE_FROM_TEMP_HF.

    # UPDATE_CURRENT (HP) is vendor syntax too (an upsert into current_object).

    INSERT_TRANSACTION = """
        INSERT INTO transaction_log
            (tid, packed, is_empty, username, description, extension)
        VALUES (%s, %s, %s, %s, %s, %s)
    """

    # --- undo -----------------------------------------------------------

    UNDO_SOURCES = """
        SELECT s.zoid, s.prev_tid, c.tid
        FROM object_state s
        JOIN current_object c ON c.zoid = s.zoid
        WHERE s.tid = %s
        ORDER BY s.zoid
    """

    # --- blobs (shared-blob-dir false) ------------------------------------

    CLEAR_TEMP_BLOBS = "DELETE FROM temp_blob_chunk"

    INSERT_TEMP_BLOB_CHUNK = """
        INSERT INTO temp_blob_chunk (zoid, chunk_num, chunk) VALUES (%s, %s, %s)
    """

    MOVE_BLOBS_FROM_TEMP = """
        INSERT INTO blob_chunk (zoid, tid, chunk_num, chunk)
        SELECT zoid, %s, chunk_num, chunk FROM temp_blob_chunk
    """

    # History-free keeps one revision: the blobs of every object this
    # transaction writes are replaced.
    DELETE_BLOBS_OF_WRITTEN_HF = """
        DELETE FROM blob_chunk WHERE zoid IN (SELECT zoid FROM temp_store)
    """

    COPY_BLOB = """
        INSERT INTO blob_chunk (zoid, tid, chunk_num, chunk)
        SELECT zoid, %s, chunk_num, chunk FROM blob_chunk WHERE zoid = %s AND tid = %s
    """

    BLOB_CHUNK_COUNT = "SELECT COUNT(*) FROM blob_chunk WHERE zoid = %s AND tid = %s"

    LOAD_BLOB_CHUNK = """
        SELECT chunk FROM blob_chunk WHERE zoid = %s AND tid = %s AND chunk_num = %s
    """

    DELETE_BLOBS_OF_OBJECT = "DELETE FROM blob_chunk WHERE zoid = %s"

    DELETE_OLDER_BLOBS = "DELETE FROM blob_chunk WHERE zoid = %s AND tid < %s"

    # --- zap_all: every object and transaction goes, the schema stays ----
    # (The OID counter stays too: other processes may hold blocks of it.)

    ZAP_ALL = (
        "DELETE FROM current_object",
        "DELETE FROM object_state",
        "DELETE FROM transaction_log",
    )
    ZAP_ALL_HF = ("DELETE FROM object_state",)
    ZAP_BLOBS = "DELETE FROM blob_chunk"

    # --- pack -------------------------------------------------------------

    ALL_STATES = "SELECT zoid, tid, state FROM object_state"

    DELETE_OBJECT = "DELETE FROM object_state WHERE zoid = %s"

    DELETE_CURRENT = "DELETE FROM current_object WHERE zoid = %s"

    DELETE_OLDER_REVISIONS = "DELETE FROM object_state WHERE zoid = %s AND tid < %s"

    MARK_PACKED = "UPDATE transaction_log SET packed = %s WHERE tid <= %s"

    DELETE_TRANSACTIONS_WITHOUT_STATES = """
        DELETE FROM transaction_log
        WHERE tid > 0 AND tid <= %s AND packed = %s
          AND tid NOT IN (SELECT DISTINCT tid FROM object_state)
    """
