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
                     counter every pack deletion batch (and zap_all)
                     increments, so that other processes learn, with the
                     same query, that cached revisions and objects may be
                     gone; ``pack_removed_list`` says which.  Row 3: the
                     database's key (Adapter.database_key).  Row 4
                     (written by zap_all): the pack mark zap_all moved
                     to (Adapter.zap_mark).  Row 6 (a copy into the
                     database has not finished): when it began
                     (Adapter.copy_mark).  Row 7: the tid of the last
                     transaction committed with a tid of its own, a copy's
                     (Adapter.note_copied_tid).  Row 2 is Oracle's pack
                     lock.
``object_state``     pickles.  History-free: one row per object (``zoid``
                     primary key).  History-preserving: one row per revision
                     (``zoid``, ``tid``), plus ``current_object`` pointing at
                     the newest one and ``transaction_log`` holding metadata.
                     A NULL ``state`` means the object does not exist at that
                     revision (creation undone, or deleted by external GC).
``temp_store``       per-connection temporary table holding the states of the
                     transaction being committed until they move into place.

Pack tables, created by the first pack (see storage/pack.py):

``object_ref``       (zoid, tid, to_zoid): the references of each analysed
                     revision, extracted once and reused by later packs.
``pack_info``        name -> integer: ``refs_tid`` (every revision up to it
                     is in object_ref, but for those ``refs_kept_at`` let
                     out: see PACK_REVISIONS_KEPT), and the pre-pack's
                     ``pack_tid``,
                     ``checked_tid`` (commits up to it were re-checked),
                     ``prepared`` and ``deleted_upto`` (the deletion
                     batches went through the candidates up to that
                     OID); ``packed_tid`` and ``packed_gc`` of the last
                     completed pack; ``seeds_armed`` (history-free
                     analyses record seeds), ``seed_base`` (the seeds are
                     usable), ``seed_tid`` (the pack time of the pack that
                     made them so), ``reach_objects`` (objects the
                     last full reachability saw) and, where object_ref
                     can lose its rows (PACK_REFS_MAY_VANISH),
                     ``no_refs`` (it is empty as nothing references
                     anything).
``pack_object``      the pre-pack's result: objects whose revisions older
                     than ``keep_tid`` go, and (``garbage`` = 1) objects that
                     go entirely.  The deletion goes through it by OID and
                     empties it at its end.
``pack_removed_list`` (mark, garbage, trimmed): what the deletion batch that
                     set the pack mark to ``mark`` removed, one row per
                     batch (adapters/packing.py PackRemovals): the OIDs of
                     objects removed entirely, and (OID, tid) of objects
                     whose revisions older than that tid went.  A mark
                     without a row (zap_all, lists of an earlier pack
                     already emptied, or a batch of a development build
                     of 5.0, which listed a row per object in
                     ``pack_removed``, now emptied by each pack) means
                     "anything may be gone".
``pack_seed``        (zoid): where new garbage may be since the last
                     reachability: what history-free analyses since found
                     (targets of references a new revision dropped,
                     objects new since the analysis before or without
                     references), what
                     that reachability kept only because a commit after its
                     pack time touched it, and candidates a commit brought
                     back.  Emptied when a reachability starts.  A pack
                     whose ``pack_info`` says ``seed_base`` (the pack that
                     last emptied it completed) computes reachability only
                     among what these reach (see compute_pack_candidates).
``temp_pack_*``      per-connection work tables of the pack's reachability
                     and deletion batches.
"""
import re


def _old_rows_only(upsert):
    """``upsert`` (of the rows of temp_store) for those with prev_tid <> 0
    (see Statements.INSERT_NEW_CURRENT); a vendor's always-true WHERE goes."""
    old, found = re.subn(r'FROM temp_store(\s+WHERE true)?\b',
                         'FROM temp_store WHERE prev_tid <> 0', upsert)
    if found != 1:
        raise ValueError('not an upsert from temp_store: %s' % upsert)
    return old


def _extra_step(source, alias, condition, join=''):
    """The garbage candidates after the batch's last OID (%s) that still
    exist and reference the objects of ``source`` (into temp_pack_next)."""
    return """
        INSERT INTO temp_pack_next (zoid)
        SELECT DISTINCT e.zoid FROM %s
        JOIN temp_pack_edges e ON e.to_zoid = %s.zoid
        JOIN pack_object p ON p.zoid = e.zoid
        JOIN {current} c ON c.zoid = e.zoid
        %s
        WHERE e.zoid > %%s AND p.garbage = 1 %s
    """ % (source, alias, join, condition)


def _extra_delete(table):
    """The deletion of every row of ``table`` about the objects of
    temp_pack_extra (ANSI form)."""
    return "DELETE FROM %s WHERE zoid IN (SELECT zoid FROM temp_pack_extra)" % table


class Statements:
    """Statements for one history mode; adapters subclass per vendor."""

    #: Statement giving the planner fresh statistics of ``{table}`` after
    #: a bulk load, where the vendor's planner wants them (None: not
    #: needed, or not worth its cost; SQLite's statements name their join
    #: order instead).
    ANALYZE_TABLE = None
    ANALYZE_RETURNS_ROWS = False

    keep_history = True

    #: How a vendor writes "INSERT ... skipping rows whose key exists"
    #: (None where it overrides the statements using them instead).
    INSERT_IGNORE = 'INSERT INTO'
    INSERT_IGNORE_END = 'ON CONFLICT DO NOTHING'

    def __init__(self, keep_history):
        self.keep_history = keep_history
        # {current}: the table holding each object's current tid.
        fill = {'{insert_ignore}': self.INSERT_IGNORE,
                '{insert_ignore_end}': self.INSERT_IGNORE_END,
                '{current}': 'current_object' if keep_history else 'object_state'}
        for name in dir(self):
            if name.startswith('PACK_'):
                value = getattr(self, name)
                if isinstance(value, str):
                    for key, text in fill.items():
                        # (None: the vendor writes those statements out.)
                        if text is not None:
                            value = value.replace(key, text)
                    setattr(self, name, value)
        if not keep_history:
            for name in dir(self):
                if name.endswith('_HF'):
                    setattr(self, name[:-3], getattr(self, name))
            # History-free, object_state holds the current revisions.
            self.UPDATE_CURRENT = self.MOVE_FROM_TEMP
        if self.UPDATE_CURRENT is not None:
            self.UPDATE_OLD_CURRENT = _old_rows_only(self.UPDATE_CURRENT)

    # --- snapshot reads -------------------------------------------------

    GET_LAST_TID = "SELECT tid FROM commit_lock WHERE id = 0"
    #: One row naming the database as the server knows it (see
    #: Adapter.database_identity).
    DATABASE_IDENTITY = None
    #: Whether an idle session still answers (sessions.py).
    PING = "SELECT 1"
    GET_SNAPSHOT_MARKS = "SELECT id, tid FROM commit_lock WHERE id IN (0, 1)"
    #: The same, and (2, tid, oid) of WITNESSES objects (see
    #: RelStorage._poll_invalidations), in the same round trip.
    #: (History-preserving, row 5: whether the transaction of the newest
    #: witness is still there; see Adapter.snapshot_marks.)
    GET_SNAPSHOT_MARKS_WITNESS = """
        SELECT id, tid, NULL FROM commit_lock WHERE id IN (0, 1)
        UNION ALL
        SELECT 2, tid, zoid FROM current_object WHERE zoid IN (%s, %s, %s, %s)
        UNION ALL
        SELECT 5, tid, NULL FROM transaction_log WHERE tid = %s
    """
    GET_SNAPSHOT_MARKS_WITNESS_HF = """
        SELECT id, tid, NULL FROM commit_lock WHERE id IN (0, 1)
        UNION ALL
        SELECT 2, tid, zoid FROM object_state WHERE zoid IN (%s, %s, %s, %s)
    """
    WITNESSES = 4
    #: Row 3 (row 2 is Oracle's pack lock): the database's key, a random
    #: number written once (see Adapter.database_key).
    GET_DATABASE_KEY = "SELECT tid FROM commit_lock WHERE id = 3"
    #: A row of this release's commit_lock (Adapter._holds_own_schema).
    LOCK_COMMIT_EXISTS = "SELECT tid FROM commit_lock WHERE id = 0"
    INSERT_DATABASE_KEY = "INSERT INTO commit_lock (id, tid) VALUES (3, %s)"
    GET_PACK_MARK = "SELECT tid FROM commit_lock WHERE id = 1"
    SET_PACK_MARK = "UPDATE commit_lock SET tid = %s WHERE id = 1"
    INSERT_PACK_MARK = "INSERT INTO commit_lock (id, tid) VALUES (1, %s)"
    GET_ZAP_MARK = "SELECT tid FROM commit_lock WHERE id = 4"
    CLEAR_ZAP_MARK = "DELETE FROM commit_lock WHERE id = 4"
    INSERT_ZAP_MARK = "INSERT INTO commit_lock (id, tid) VALUES (4, %s)"
    #: Row 6 (row 5 is a poll's witness, GET_SNAPSHOT_MARKS): when a copy
    #: into this database that has not finished began.
    GET_COPY_MARK = "SELECT tid FROM commit_lock WHERE id = 6"
    CLEAR_COPY_MARK = "DELETE FROM commit_lock WHERE id IN (6, 7)"
    CLEAR_COPY_BEGAN = "DELETE FROM commit_lock WHERE id = 6"
    GET_COPY_STATE = "SELECT id, tid FROM commit_lock WHERE id IN (0, 6, 7)"
    CLEAR_COPIED_TID = "DELETE FROM commit_lock WHERE id = 7"
    INSERT_COPIED_TID = "INSERT INTO commit_lock (id, tid) VALUES (7, %s)"
    INSERT_COPY_MARK = "INSERT INTO commit_lock (id, tid) VALUES (6, %s)"

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
    #: The same for the OIDs of a range (see base.oid_runs).
    LOAD_CURRENT_RANGE = """
        SELECT s.zoid, s.state, s.tid
        FROM current_object c
        JOIN object_state s ON s.zoid = c.zoid AND s.tid = c.tid
        WHERE c.zoid BETWEEN %s AND %s
    """
    LOAD_CURRENT_RANGE_HF = """
        SELECT zoid, state, tid FROM object_state WHERE zoid BETWEEN %s AND %s
    """

    LOAD_REVISION = """
        SELECT state FROM object_state WHERE zoid = %s AND tid = %s
    """
    LOAD_REVISION_HF = """
        SELECT state FROM object_state WHERE zoid = %s AND tid = %s
    """

    #: With the tid of the next revision (the end of this one's validity),
    #: in the same round trip: loadBefore answers both.  Parameters: oid,
    #: tid, oid, tid.  The next revision after the newest before tid is the
    #: first at or after tid: a subquery that does not depend on the outer
    #: row, which MySQL answers from the index's first key (a review
    #: finding: correlated on s.tid, MariaDB read every revision of the
    #: object for it, 40 ms instead of 1 at 200,000 revisions).
    LOAD_BEFORE = """
        SELECT s.state, s.tid,
               (SELECT MIN(n.tid) FROM object_state n
                WHERE n.zoid = %s AND n.tid >= %s)
        FROM object_state s
        WHERE s.zoid = %s AND s.tid < %s
        ORDER BY s.tid DESC
        LIMIT 1
    """

    CURRENT_TIDS = "SELECT zoid, tid FROM current_object WHERE zoid IN ({in_list})"
    CURRENT_TIDS_HF = "SELECT zoid, tid FROM object_state WHERE zoid IN ({in_list})"

    POLL_CHANGES = """
        SELECT zoid, tid FROM current_object WHERE tid > %s AND tid <= %s
    """
    POLL_CHANGES_HF = """
        SELECT zoid, tid FROM object_state WHERE tid > %s AND tid <= %s
    """
    #: The same, but for the tids on either side of one, t: (a, t) and
    #: (t, b]; plus a row (NULL, t) when the database has transaction t
    #: (NULL, NULL when not: see Adapter.poll_changes).
    POLL_CHANGES_AROUND = """
        SELECT zoid, tid FROM current_object
        WHERE (tid > %s AND tid < %s) OR (tid > %s AND tid <= %s)
        UNION ALL
        SELECT NULL, MAX(tid) FROM transaction_log WHERE tid = %s
    """
    POLL_CHANGES_AROUND_HF = """
        SELECT zoid, tid FROM object_state
        WHERE (tid > %s AND tid < %s) OR (tid > %s AND tid <= %s)
        UNION ALL
        SELECT NULL, MAX(tid) FROM object_state WHERE tid = %s
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

    #: len(storage) (approximate, says IStorage) of a large database: an
    #: exact count is a scan of a whole table (3 s for 6 million objects on
    #: MariaDB), so a vendor that keeps statistics supplies COUNT_ESTIMATE,
    #: (table size in bytes, estimated rows) of the table named by its
    #: parameter (COUNTED_TABLE); the count is exact below
    #: SMALL_TABLE_BYTES, where the estimates may not exist yet.
    COUNT_ESTIMATE = None
    COUNTED_TABLE = "current_object"
    COUNTED_TABLE_HF = "object_state"
    SMALL_TABLE_BYTES = 32 << 20

    #: getSize() (approximate too): a vendor that knows the size of its
    #: tables says it; summing the states reads the whole table (0.7 s for
    #: 300,000 objects on MariaDB).
    SIZE_OF_STATES = "SELECT COALESCE(SUM(state_size), 0) FROM object_state"

    # --- history-preserving metadata ------------------------------------

    #: The object's revisions first, then their transactions: joined
    #: directly, PostgreSQL walked every transaction newest first and
    #: probed object_state for each (a helper agent's check: 55 ms a call
    #: at 31,000 transactions for an object changed long ago).
    HISTORY = """
        SELECT s.tid, s.state_size, t.username, t.description, t.extension
        FROM (SELECT tid, state_size FROM object_state
              WHERE zoid = %s ORDER BY tid DESC LIMIT %s) s
        JOIN transaction_log t ON t.tid = s.tid
        ORDER BY s.tid DESC
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
    # The transaction iterator reads the log a page at a time (from the
    # tid after the last page's last): a list of every transaction of a
    # large database held in memory, and read before the first one is
    # returned, is what a caller wanting the first few does not expect.
    ALL_TRANSACTIONS_IN_RANGE = """
        SELECT tid, username, description, extension, packed
        FROM transaction_log
        WHERE tid >= %s AND tid <= %s
        ORDER BY tid
        LIMIT %s
    """
    TIDS_IN_RANGE_HF = """
        SELECT DISTINCT tid FROM object_state
        WHERE tid >= %s AND tid <= %s
        ORDER BY tid
        LIMIT %s
    """

    RECORDS_IN_TRANSACTION = """
        SELECT zoid, state, prev_tid FROM object_state WHERE tid = %s ORDER BY zoid
    """
    RECORDS_IN_TRANSACTION_HF = """
        SELECT zoid, state, 0 FROM object_state WHERE tid = %s ORDER BY zoid
    """

    #: A page of the log (history.undo_log asks for what it needs, not for
    #: every transaction: a helper agent's check, 62 ms for undoLog(0, 1)
    #: at 20,000 transactions).
    UNDO_LOG = """
        SELECT tid, username, description, extension
        FROM transaction_log
        WHERE packed = %s AND tid <= %s
        ORDER BY tid DESC
        LIMIT %s
    """

    # After a COMMIT whose answer was lost (see Adapter.commit_outcome).
    TID_HAS_STATES = "SELECT zoid FROM object_state WHERE tid = %s LIMIT 1"

    TRANSACTION_EXISTS = """
        SELECT packed FROM transaction_log WHERE tid = %s
    """

    OBJECTS_IN_TRANSACTION = "SELECT zoid FROM object_state WHERE tid = %s"

    #: (The bound on s.zoid too, the same: without it PostgreSQL merged
    #: the two tables from OID 0, and each call cost time in proportion to
    #: where it started; a helper agent's check of zodbupdate, which calls
    #: it once per object, had not finished 112,000 records in 15 minutes.)
    RECORD_ITERNEXT = """
        SELECT s.zoid, s.tid, s.state
        FROM current_object c
        JOIN object_state s ON s.zoid = c.zoid AND s.tid = c.tid
        WHERE c.zoid >= %s AND s.zoid >= %s AND s.state IS NOT NULL
        ORDER BY c.zoid
        LIMIT %s
    """
    RECORD_ITERNEXT_HF = """
        SELECT zoid, tid, state
        FROM object_state
        WHERE zoid >= %s AND state IS NOT NULL
        ORDER BY zoid
        LIMIT %s
    """
    #: The sizes of the states from the same place (same parameters): the
    #: read-ahead reads as many as fit its byte budget.  Rows without a
    #: state too: a test of the state column made InnoDB read every row's
    #: state from its overflow pages (a helper agent's check: 5 s a call
    #: among 4 MB states, where 18 ms without the test).
    RECORD_SIZES = RECORD_ITERNEXT.replace(
        'SELECT s.zoid, s.tid, s.state', 'SELECT s.zoid, s.state_size').replace(
        ' AND s.state IS NOT NULL', '')
    RECORD_SIZES_HF = RECORD_ITERNEXT_HF.replace(
        'SELECT zoid, tid, state', 'SELECT zoid, state_size').replace(
        ' AND state IS NOT NULL', '')

    # --- commit -------------------------------------------------------

    CLEAR_TEMP = "DELETE FROM temp_store"
    #: See Adapter.temp_garbage_rows (vendors that set it define these).
    RESET_TEMP_STORE = ()

    INSERT_TEMP = """
        INSERT INTO temp_store (zoid, prev_tid, state) VALUES (%s, %s, %s)
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
    # HF upserts are vendor syntax; each adapter supplies MOVE_FROM_TEMP_HF,
    # and UPDATE_CURRENT (HP), an upsert into current_object.
    UPDATE_CURRENT = None

    #: The rows of new objects (prev_tid 0: OIDs this process's new_oid
    #: handed out, or checked by detect_conflicts to have no row) go into
    #: the table of current revisions (current_object; history-free,
    #: object_state) with a plain INSERT, and only the others with the
    #: vendor's upsert (UPDATE_OLD_CURRENT: UPDATE_CURRENT, history-free
    #: MOVE_FROM_TEMP_HF, restricted to prev_tid <> 0).  Should a row
    #: exist after all (one created meanwhile by another transaction: a
    #: missing row cannot be locked), the vote fails instead of
    #: overwriting it; and PostgreSQL's upsert inserts speculatively,
    #: which costs more (an add of 1000 objects to a mapping: 4.8-5.4 ms
    #: for the upsert of all rows, 3.5-4.1 for the two statements).  A
    #: commit whose objects are all new sends just the INSERT; one without
    #: any new object just the upsert.
    INSERT_NEW_CURRENT = """
        INSERT INTO current_object (zoid, tid)
        SELECT zoid, %s FROM temp_store WHERE prev_tid = 0
    """
    INSERT_NEW_CURRENT_HF = """
        INSERT INTO object_state (zoid, tid, state_size, state)
        SELECT zoid, %s, COALESCE(LENGTH(state), 0), state FROM temp_store
        WHERE prev_tid = 0
    """

    #: New objects sent straight into place, without temp_store (see
    #: Adapter.insert_new_objects): (oid, tid, state_size, state) rows.
    NEW_OBJECT_STATE = """
        INSERT INTO object_state (zoid, tid, prev_tid, state_size, state)
        VALUES (%s, %s, 0, %s, %s)
    """
    NEW_OBJECT_STATE_HF = """
        INSERT INTO object_state (zoid, tid, state_size, state) VALUES (%s, %s, %s, %s)
    """
    NEW_OBJECT_CURRENT = "INSERT INTO current_object (zoid, tid) VALUES (%s, %s)"

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
    #: The states an undo needs for the objects of transaction tid (the
    #: first parameter) named by OID: the revision before it (p.tid is NULL
    #: when that one is packed away), and, for an object changed since,
    #: its current state and the one the undone transaction wrote.  In one
    #: query for many objects: three queries per object made the undo of a
    #: 10,000-object transaction take 2.0 s on PostgreSQL (RelStorage 4.3:
    #: 0.77 s).  By OID, not by a range of OIDs, which SQLite read through
    #: the tid index, every row of the transaction for each chunk (a
    #: review finding: 8 s for 200,000 objects).
    #: (The revisions joined by OID, never through the tid index: a helper
    #: agent's check saw PostgreSQL, before the table had statistics, read
    #: every revision of the transaction for each object through it: 8.7 s
    #: instead of 0.3.  Hence "+ 0", which no index matches.)
    UNDO_STATES = """
        SELECT s.zoid, p.tid, p.state, c.tid, cur.state, s.state
        FROM object_state s
        JOIN current_object c ON c.zoid = s.zoid
        LEFT JOIN object_state p ON p.zoid = s.zoid AND p.tid + 0 = s.prev_tid
        LEFT JOIN object_state cur ON cur.zoid = s.zoid AND cur.tid + 0 = c.tid
            AND c.tid <> s.tid
        WHERE s.tid = %s AND s.zoid IN ({in_list})
    """

    # --- blobs (shared-blob-dir false) ------------------------------------

    CLEAR_TEMP_BLOBS = "DELETE FROM temp_blob_chunk"
    RESET_TEMP_BLOBS = ()

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
    #: (offset, length, zoid, tid, chunk_num): a part of a chunk, where a
    #: chunk may be too large for one value (Adapter.stream_blob_chunk).
    LOAD_BLOB_CHUNK_PART = None

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
    #: The pack's permanent tables (created by the first pack): emptied by
    #: zap_all too, or a later pack would trust references recorded for
    #: the old history (pack_info's refs_tid) and skip new revisions.
    ZAP_PACK_TABLES = ('object_ref', 'pack_object', 'pack_info', 'pack_removed_list',
                       'pack_removed', 'pack_seed')
    #: Whether object_ref may lose its rows without pack_info losing
    #: refs_tid (PostgreSQL: an UNLOGGED table, emptied by crash recovery).
    PACK_REFS_MAY_VANISH = False
    #: Said around PACK_CANDIDATES when it covers every object (no
    #: incremental reachability; None: nothing), for a planner that
    #: misjudges its joins.
    PACK_LARGE_JOINS_BEGIN = None
    PACK_LARGE_JOINS_END = None
    #: Statements said before and after PACK_EXTRA_CLOSURE, in the
    #: deletion batch's transaction.
    PACK_CLOSURE_BEGIN = PACK_CLOSURE_END = ()

    # --- pack -------------------------------------------------------------

    DELETE_OBJECT = "DELETE FROM object_state WHERE zoid = %s"

    DELETE_CURRENT = "DELETE FROM current_object WHERE zoid = %s"

    DELETE_OLDER_REVISIONS = "DELETE FROM object_state WHERE zoid = %s AND tid < %s"

    MARK_PACKED = "UPDATE transaction_log SET packed = %s WHERE tid <= %s"

    # NOT EXISTS probes the index on object_state.tid per transaction; NOT
    # IN (SELECT ...) may materialise every tid of the database.
    DELETE_TRANSACTIONS_WITHOUT_STATES = """
        DELETE FROM transaction_log
        WHERE tid > 0 AND tid <= %s AND packed = %s
          AND NOT EXISTS (SELECT 1 FROM object_state s WHERE s.tid = transaction_log.tid)
    """

    # --- pack: references, reachability, batches (storage/pack.py) -----------

    #: Statements taking (without waiting) and releasing the session lock
    #: that lets one pack run at a time; vendors supply them.
    TRY_PACK_LOCK = None
    RELEASE_PACK_LOCK = None

    PACK_INFO_GET = "SELECT name, value FROM pack_info"
    PACK_INFO_DELETE = "DELETE FROM pack_info WHERE name = %s"
    PACK_INFO_INSERT = "INSERT INTO pack_info (name, value) VALUES (%s, %s)"
    #: One key set in one statement (each deletion batch sets two, in the
    #: transaction that holds the commit lock); None: PACK_INFO_DELETE,
    #: then PACK_INFO_INSERT.
    PACK_INFO_SET = """
        INSERT INTO pack_info (name, value) VALUES (%s, %s)
        ON CONFLICT (name) DO UPDATE SET value = excluded.value
    """

    # Ordered by tid: the analysis records its progress as a tid.
    PACK_REVISIONS = """
        SELECT zoid, tid, state FROM object_state
        WHERE tid > %s AND tid <= %s
        ORDER BY tid
    """
    PACK_NEXT_TID = """
        SELECT MIN(tid) FROM object_state WHERE tid > %s AND tid <= %s
    """
    PACK_COUNT_REVISIONS_AFTER = """
        SELECT COUNT(*) FROM object_state WHERE tid > %s AND tid <= %s
    """
    # History-preserving, a pack to time T needs the references of the
    # revisions current at T or later only: one replaced by a revision of
    # T or before is removed by that pack, and no pack to T or after
    # follows it (pack_info ``refs_kept_at``: the latest such T, which a
    # pack to an earlier time cannot use).  At a million objects, the
    # revisions of the buckets the garbage was removed from held 1.8
    # million references, recorded and then forgotten by the same pack.
    # Parameters: after, upto, T.
    PACK_REVISIONS_KEPT = """
        SELECT zoid, tid, state FROM object_state s
        WHERE tid > %s AND tid <= %s
          AND NOT EXISTS (SELECT 1 FROM object_state n
                          WHERE n.zoid = s.zoid AND n.tid > s.tid AND n.tid <= %s)
        ORDER BY tid
    """
    PACK_COUNT_REVISIONS_KEPT = """
        SELECT COUNT(*) FROM object_state s
        WHERE tid > %s AND tid <= %s
          AND NOT EXISTS (SELECT 1 FROM object_state n
                          WHERE n.zoid = s.zoid AND n.tid > s.tid AND n.tid <= %s)
    """
    # Left by an analysis that was interrupted part way through a tid.
    PACK_REFS_FORGET_AFTER = "DELETE FROM object_ref WHERE tid > %s"
    # History-free: an object's new revision replaces its references.
    PACK_REFS_FORGET_OBJECTS = "DELETE FROM object_ref WHERE zoid IN ({in_list})"
    PACK_REFS_INSERT = "INSERT INTO object_ref (zoid, tid, to_zoid) VALUES "

    # The revision of each object current at the pack time, and how many
    # revisions it has up to then.  In key order: PostgreSQL's hash
    # aggregate hands the groups out in no order, and a million of them
    # inserted so into the key cost 3.3 s against 1.9 s sorted first.
    PACK_FILL_CURRENT = """
        INSERT INTO temp_pack_current (zoid, tid, revisions)
        SELECT zoid, MAX(tid), COUNT(*) FROM object_state
        WHERE tid <= %s
        GROUP BY zoid
        ORDER BY zoid
    """
    # History-free, an object has one revision: ``revisions`` says
    # instead whether it has a state (1) or not (0: a record restored
    # from a history where the object was deleted), so that
    # PACK_CANDIDATES_HF need not join object_state again.
    PACK_FILL_CURRENT_HF = """
        INSERT INTO temp_pack_current (zoid, tid, revisions)
        SELECT zoid, tid, CASE WHEN state IS NULL THEN 0 ELSE 1 END
        FROM object_state WHERE tid <= %s
    """
    # One step of the frontier: what the pack-time revisions of the
    # frontier reference, not reached yet.
    PACK_REACH_STEP = """
        INSERT INTO temp_pack_next (zoid)
        SELECT DISTINCT r.to_zoid FROM temp_pack_frontier f
        JOIN temp_pack_current c ON c.zoid = f.zoid
        JOIN object_ref r ON r.zoid = c.zoid AND r.tid = c.tid
        LEFT JOIN temp_pack_reach x ON x.zoid = r.to_zoid
        WHERE x.zoid IS NULL
    """
    # History-free: object_ref holds the references of each object's last
    # analysed revision only (a new one replaces them), and those are
    # followed whatever its tid.  Joined to the pack-time revisions
    # instead, an object a commit changed after the analysis (the root,
    # on a busy site) reached nothing, and all below it was a candidate.
    PACK_REACH_STEP_HF = """
        INSERT INTO temp_pack_next (zoid)
        SELECT DISTINCT r.to_zoid FROM temp_pack_frontier f
        JOIN object_ref r ON r.zoid = f.zoid
        LEFT JOIN temp_pack_reach x ON x.zoid = r.to_zoid
        WHERE x.zoid IS NULL
    """
    # With GC, in two stages, so that the next pack knows what was kept
    # only because a commit after the pack time touched it: first from
    # the root alone, then from those commits (PACK_LATE_ROOTS; and,
    # history-preserving, what their revisions reference, PACK_LATE_REFS).
    PACK_ROOT = """
        INSERT INTO temp_pack_next (zoid) SELECT zoid FROM {current} WHERE zoid = 0
    """
    PACK_LATE_ROOTS = """
        INSERT INTO temp_pack_seed (zoid)
        SELECT c.zoid FROM {current} c
        LEFT JOIN temp_pack_reach x ON x.zoid = c.zoid
        WHERE c.tid > %s AND x.zoid IS NULL
    """
    PACK_NEXT_FROM_SEED = """
        INSERT INTO temp_pack_next (zoid) SELECT zoid FROM temp_pack_seed WHERE 1 = 1
    """

    # --- incremental reachability (packing.py) ------------------------------
    PACK_REFS_OF = "SELECT zoid, to_zoid FROM object_ref WHERE zoid IN ({in_list})"
    # pack_seed has a key (servers may require one of every table); only
    # the pack, one at a time, writes it: NOT EXISTS skips what it holds.
    PACK_SEED_FORGET = "DELETE FROM pack_seed WHERE zoid IN ({in_list})"
    PACK_SEED_INSERT = "INSERT INTO pack_seed (zoid) VALUES "
    # (DISTINCT: a pack_seed made before it had its key may repeat rows.)
    PACK_SEED_TAKE = "INSERT INTO temp_pack_dom (zoid) SELECT DISTINCT zoid FROM pack_seed"
    PACK_SEED_CLEAR = "DELETE FROM pack_seed"
    PACK_SEED_SAVE = """
        INSERT INTO pack_seed (zoid) SELECT t.zoid FROM temp_pack_seed t
        WHERE NOT EXISTS (SELECT 1 FROM pack_seed s WHERE s.zoid = t.zoid)
    """
    PACK_SEED_RESCUED = """
        INSERT INTO pack_seed (zoid) SELECT f.zoid FROM temp_pack_frontier f
        WHERE NOT EXISTS (SELECT 1 FROM pack_seed s WHERE s.zoid = f.zoid)
    """
    # Of the given objects (changed after the analysis), those the
    # reachability did not reach (packing.seed_unreached).
    PACK_SEED_UNREACHED = """
        INSERT INTO pack_seed (zoid) SELECT c.zoid FROM temp_pack_current c
        LEFT JOIN temp_pack_reach x ON x.zoid = c.zoid
        WHERE x.zoid IS NULL AND c.zoid IN ({in_list})
          AND NOT EXISTS (SELECT 1 FROM pack_seed s WHERE s.zoid = c.zoid)
    """
    PACK_DOM_HAS_ROOT = "SELECT zoid FROM temp_pack_dom WHERE zoid = 0"
    PACK_DOM_FROM_NEXT = """
        INSERT INTO temp_pack_dom (zoid) SELECT zoid FROM temp_pack_next WHERE 1 = 1
    """
    PACK_FRONTIER_FROM_DOM = """
        INSERT INTO temp_pack_frontier (zoid) SELECT zoid FROM temp_pack_dom WHERE 1 = 1
    """
    # The domain: everything the seeds reach.  Whatever lies outside it is
    # reached as at the last pack (no reference on its way went).
    PACK_DOM_STEP = """
        INSERT INTO temp_pack_next (zoid)
        SELECT DISTINCT r.to_zoid FROM temp_pack_frontier f
        JOIN object_ref r ON r.zoid = f.zoid
        LEFT JOIN temp_pack_dom d ON d.zoid = r.to_zoid
        WHERE d.zoid IS NULL
    """
    # The domain's objects as of the pack time: the only candidates.
    PACK_FILL_CURRENT_DOM = """
        INSERT INTO temp_pack_current (zoid, tid, revisions)
        SELECT s.zoid, s.tid, CASE WHEN s.state IS NULL THEN 0 ELSE 1 END
        FROM temp_pack_dom d
        JOIN object_state s ON s.zoid = d.zoid
        WHERE s.tid <= %s
    """
    # Entries into the candidates from outside the domain (one scan of
    # object_ref).
    PACK_DOM_ENTRIES = """
        INSERT INTO temp_pack_next (zoid)
        SELECT DISTINCT r.to_zoid FROM object_ref r
        JOIN temp_pack_current c ON c.zoid = r.to_zoid
        LEFT JOIN temp_pack_dom d ON d.zoid = r.zoid
        LEFT JOIN temp_pack_reach x ON x.zoid = r.to_zoid
        WHERE d.zoid IS NULL AND x.zoid IS NULL
    """
    # Objects of the domain changed after the pack time: kept, and what
    # they reference among the candidates is reached.
    PACK_LATE_DOM = """
        INSERT INTO temp_pack_seed (zoid)
        SELECT d.zoid FROM temp_pack_dom d
        JOIN object_state s ON s.zoid = d.zoid
        WHERE s.tid > %s
    """
    PACK_LATE_ENTRIES = """
        INSERT INTO temp_pack_next (zoid)
        SELECT DISTINCT r.to_zoid FROM temp_pack_seed l
        JOIN object_ref r ON r.zoid = l.zoid
        JOIN temp_pack_current c ON c.zoid = r.to_zoid
        LEFT JOIN temp_pack_reach x ON x.zoid = r.to_zoid
        WHERE x.zoid IS NULL
    """
    # --- history-preserving: the same, by the pack time ---------------------
    # Seeds are found at the reachability, between the last completed pack
    # time (T1, pack_info ``seed_tid``) and this one (T2): the base pack
    # left each object one revision at most up to T1.  Parameters: T2, T1,
    # T2.  The objects changed in (T1, T2], with their revision current at
    # T2 and how many they have up to it (their older ones go).
    PACK_FILL_CHANGED = """
        INSERT INTO temp_pack_current (zoid, tid, revisions)
        SELECT s.zoid, MAX(s.tid), COUNT(*) FROM object_state s
        WHERE s.tid <= %s
          AND s.zoid IN (SELECT zoid FROM object_state WHERE tid > %s AND tid <= %s)
        GROUP BY s.zoid
    """
    # What their revision at T1 referenced and the one at T2 does not.
    PACK_SEED_DROPPED = """
        {insert_ignore} temp_pack_dom (zoid)
        SELECT DISTINCT r.to_zoid FROM temp_pack_current c
        JOIN object_state p ON p.zoid = c.zoid AND p.tid <= %s
        JOIN object_ref r ON r.zoid = p.zoid AND r.tid = p.tid
        LEFT JOIN object_ref n ON n.zoid = c.zoid AND n.tid = c.tid AND n.to_zoid = r.to_zoid
        WHERE n.zoid IS NULL {insert_ignore_end}
    """
    # Those without a revision at T1: new.
    PACK_SEED_NEW = """
        {insert_ignore} temp_pack_dom (zoid)
        SELECT c.zoid FROM temp_pack_current c
        WHERE NOT EXISTS (SELECT 1 FROM object_state p WHERE p.zoid = c.zoid AND p.tid <= %s)
        {insert_ignore_end}
    """
    # The domain's objects as of T2 (the changed ones are there already).
    PACK_FILL_DOM = """
        {insert_ignore} temp_pack_current (zoid, tid, revisions)
        SELECT s.zoid, MAX(s.tid), COUNT(*) FROM temp_pack_dom d
        JOIN object_state s ON s.zoid = d.zoid
        WHERE s.tid <= %s
        GROUP BY s.zoid {insert_ignore_end}
    """
    # Changed objects outside the domain lose only older revisions: they
    # count as reached (their references are entries, below).
    PACK_REACH_OUTSIDE_DOM = """
        INSERT INTO temp_pack_reach (zoid)
        SELECT c.zoid FROM temp_pack_current c
        LEFT JOIN temp_pack_dom d ON d.zoid = c.zoid
        WHERE d.zoid IS NULL
    """
    # Entries from outside the domain: references of a revision current
    # at T2 (none newer up to T2).  Parameters: T2, T2.
    PACK_DOM_ENTRIES_AT = """
        INSERT INTO temp_pack_next (zoid)
        SELECT DISTINCT r.to_zoid FROM object_ref r
        JOIN temp_pack_current c ON c.zoid = r.to_zoid
        LEFT JOIN temp_pack_dom d ON d.zoid = r.zoid
        LEFT JOIN temp_pack_reach x ON x.zoid = r.to_zoid
        WHERE d.zoid IS NULL AND x.zoid IS NULL AND r.tid <= %s
          AND NOT EXISTS (SELECT 1 FROM object_state o
                          WHERE o.zoid = r.zoid AND o.tid > r.tid AND o.tid <= %s)
    """
    # The domain's objects changed after T2 that are not reached yet:
    # kept, and seeds of the next pack.
    PACK_LATE_DOM_AT = """
        INSERT INTO temp_pack_seed (zoid)
        SELECT d.zoid FROM temp_pack_dom d
        JOIN {current} o ON o.zoid = d.zoid
        LEFT JOIN temp_pack_reach x ON x.zoid = d.zoid
        WHERE o.tid > %s AND x.zoid IS NULL
    """
    # Candidates that revisions after T2 reference and nothing reached
    # yet: kept, and seeds of the next pack.
    PACK_LATE_REFS = """
        {insert_ignore} temp_pack_seed (zoid)
        SELECT DISTINCT r.to_zoid FROM object_ref r
        JOIN temp_pack_current c ON c.zoid = r.to_zoid
        LEFT JOIN temp_pack_reach x ON x.zoid = r.to_zoid
        WHERE r.tid > %s AND x.zoid IS NULL {insert_ignore_end}
    """

    # One step of the reachability inside the candidates.
    PACK_REACH_STEP_DOM = """
        INSERT INTO temp_pack_next (zoid)
        SELECT DISTINCT r.to_zoid FROM temp_pack_frontier f
        JOIN object_ref r ON r.zoid = f.zoid
        JOIN temp_pack_current c ON c.zoid = r.to_zoid
        LEFT JOIN temp_pack_reach x ON x.zoid = r.to_zoid
        WHERE x.zoid IS NULL
    """
    PACK_REACH_ADD = """
        INSERT INTO temp_pack_reach (zoid) SELECT zoid FROM temp_pack_next WHERE 1 = 1
    """
    PACK_FRONTIER_FROM_NEXT = """
        INSERT INTO temp_pack_frontier (zoid) SELECT zoid FROM temp_pack_next WHERE 1 = 1
    """
    # Parameters: gc (1/0), pack tid, snapshot tid, gc.  An object goes
    # entirely when it has no revision after the pack time and is
    # unreachable (with GC) or did not exist at the pack time; otherwise
    # only its older revisions go.  A revision after the analysis's
    # snapshot does not count: the reachability did not see it, and the
    # deletion's re-check, which reads those commits, keeps the object
    # (and what its kept revision references: history-preserving, that
    # revision stays, and must not point at a removed object).
    PACK_CANDIDATES = """
        INSERT INTO pack_object (zoid, keep_tid, garbage)
        SELECT c.zoid, c.tid,
               CASE WHEN n.zoid IS NULL
                         AND ((x.zoid IS NULL AND %s = 1) OR s.state IS NULL)
                    THEN 1 ELSE 0 END
        FROM temp_pack_current c
        JOIN object_state s ON s.zoid = c.zoid AND s.tid = c.tid
        LEFT JOIN temp_pack_reach x ON x.zoid = c.zoid
        LEFT JOIN {current} n ON n.zoid = c.zoid AND n.tid > %s AND n.tid <= %s
        WHERE (c.revisions > 1 OR s.state IS NULL OR (x.zoid IS NULL AND %s = 1))
    """
    # History-free (parameter: gc): an object goes whole or not at all,
    # and the objects changed after the pack time are not in
    # temp_pack_current.  One anti-join of the two work tables: joined to
    # object_state as well, PostgreSQL misjudged the rows by 200 times
    # and probed temp_pack_reach once per object (5.1 s against 1.4 s at
    # a million objects).  An object changed after the reachability read
    # it is kept by the deletion's re-check.
    PACK_CANDIDATES_HF = """
        INSERT INTO pack_object (zoid, keep_tid, garbage)
        SELECT c.zoid, c.tid, 1
        FROM temp_pack_current c
        LEFT JOIN temp_pack_reach x ON x.zoid = c.zoid
        WHERE ((x.zoid IS NULL AND %s = 1) OR c.revisions = 0)
    """
    PACK_CLEAR_CANDIDATES = "DELETE FROM pack_object"

    # What the candidates amount to: objects, revisions, bytes, blobs.
    PACK_COUNT_OBJECTS = "SELECT COUNT(*) FROM pack_object WHERE garbage = 1"
    PACK_COUNT_REVISIONS = """
        SELECT COUNT(*), COALESCE(SUM(s.state_size), 0)
        FROM pack_object p JOIN object_state s ON s.zoid = p.zoid
        WHERE s.tid < p.keep_tid OR p.garbage = 1
    """
    PACK_CANDIDATES_OF = """
        SELECT zoid, keep_tid, garbage FROM pack_object WHERE zoid IN ({in_list})
    """
    PACK_COUNT_BLOBS = """
        SELECT COUNT(*) FROM pack_object p JOIN blob_chunk b ON b.zoid = p.zoid
        WHERE b.chunk_num = 0 AND (b.tid < p.keep_tid OR p.garbage = 1)
    """

    # Re-checking candidates against commits after the analysis: those
    # with a new revision, those a new revision references, and (see
    # PACK_RESCUE_STEP) what those reference among the candidates.
    PACK_RESCUE_CHANGED = """
        INSERT INTO temp_pack_frontier (zoid)
        SELECT p.zoid FROM {current} c
        JOIN pack_object p ON p.zoid = c.zoid
        WHERE c.tid > %s AND p.garbage = 1
    """
    PACK_NEW_REVISIONS = """
        SELECT zoid, tid, state FROM object_state WHERE tid > %s AND tid <= %s
    """
    PACK_NEXT_INSERT = "INSERT INTO temp_pack_next (zoid) VALUES "
    PACK_RESCUE_REFERENCED = """
        {insert_ignore} temp_pack_frontier (zoid)
        SELECT p.zoid FROM temp_pack_next n
        JOIN pack_object p ON p.zoid = n.zoid
        WHERE p.garbage = 1 {insert_ignore_end}
    """
    PACK_UNMARK = """
        UPDATE pack_object SET garbage = 0
        WHERE zoid IN (SELECT zoid FROM temp_pack_frontier)
    """
    PACK_RESCUE_STEP = """
        {insert_ignore} temp_pack_next (zoid)
        SELECT p.zoid FROM temp_pack_frontier f
        JOIN pack_object pf ON pf.zoid = f.zoid
        JOIN object_ref r ON r.zoid = pf.zoid AND r.tid = pf.keep_tid
        JOIN pack_object p ON p.zoid = r.to_zoid
        WHERE p.garbage = 1 {insert_ignore_end}
    """

    # One deletion batch: the next candidates by OID, each with the tid
    # below which its revisions go (all of them for garbage).
    PACK_FILL_BATCH = """
        INSERT INTO temp_pack_batch (zoid, below, garbage)
        SELECT zoid, CASE WHEN garbage = 1 THEN %s ELSE keep_tid END, garbage
        FROM pack_object WHERE zoid > %s
        ORDER BY zoid
        LIMIT %s
    """
    PACK_BATCH_ROWS = "SELECT zoid, below, garbage FROM temp_pack_batch ORDER BY zoid"
    # Upward-closed batches (PackVerbs.prepare_pack_batch).  The references
    # between garbage candidates, by the referenced object, once per
    # deletion: object_ref has no index on to_zoid.
    PACK_EDGES_FILL = """
        INSERT INTO temp_pack_edges (to_zoid, zoid)
        SELECT r.to_zoid, r.zoid FROM pack_object p
        JOIN object_ref r ON r.zoid = p.zoid AND r.tid = p.keep_tid
        JOIN pack_object q ON q.zoid = r.to_zoid
        WHERE p.garbage = 1 AND q.garbage = 1 AND r.to_zoid <> r.zoid
    """
    # The garbage candidates after the batch's last OID (%s) that still
    # exist and reference garbage of the batch; then (PACK_EXTRA_STEP)
    # those that reference what the last step found.
    PACK_EXTRA_FIRST = _extra_step('temp_pack_batch b', 'b', 'AND b.garbage = 1')
    PACK_EXTRA_STEP = _extra_step(
        'temp_pack_frontier f', 'f', 'AND x.zoid IS NULL',
        'LEFT JOIN temp_pack_extra x ON x.zoid = e.zoid')
    # From those (temp_pack_next), everything that leads to them, in one
    # recursive statement (UNION: a cycle ends); None where the vendor
    # has no such statement (PACK_EXTRA_ADD and PACK_EXTRA_STEP go a step
    # at a time).
    PACK_EXTRA_CLOSURE = """
        INSERT INTO temp_pack_extra (zoid)
        WITH RECURSIVE up (zoid) AS (
            SELECT zoid FROM temp_pack_next
            UNION
            SELECT e.zoid FROM up
            JOIN temp_pack_edges e ON e.to_zoid = up.zoid
            JOIN pack_object p ON p.zoid = e.zoid
            JOIN {current} c ON c.zoid = e.zoid
            WHERE e.zoid > %s AND p.garbage = 1
        )
        SELECT zoid FROM up
    """
    PACK_EXTRA_ADD = "INSERT INTO temp_pack_extra (zoid) SELECT zoid FROM temp_pack_next WHERE 1 = 1"
    PACK_EXTRA_ROWS = "SELECT zoid FROM temp_pack_extra ORDER BY zoid"
    PACK_EXTRA_BLOBS = """
        SELECT COUNT(*) FROM temp_pack_extra t JOIN blob_chunk b ON b.zoid = t.zoid
        WHERE b.chunk_num = 0
    """
    # Every row of the extra objects: they are few, and spread over the
    # OIDs (the range join of a batch would not fit them).
    PACK_EXTRA_DELETE_BLOBS = _extra_delete('blob_chunk')
    PACK_EXTRA_DELETE_STATES = _extra_delete('object_state')
    PACK_EXTRA_DELETE_CURRENT = _extra_delete('current_object')
    PACK_EXTRA_DELETE_REFS = _extra_delete('object_ref')
    PACK_BATCH_BLOBS = """
        SELECT COUNT(*) FROM temp_pack_batch t JOIN blob_chunk b ON b.zoid = t.zoid
        WHERE b.chunk_num = 0 AND b.tid < t.below
    """
    # ANSI forms (SQLite plans "zoid IN (SELECT ...)" as primary key
    # lookups); PostgreSQL and MySQL join instead.
    PACK_DELETE_STATES = """
        DELETE FROM object_state
        WHERE zoid IN (SELECT zoid FROM temp_pack_batch)
          AND tid < (SELECT t.below FROM temp_pack_batch t WHERE t.zoid = object_state.zoid)
    """
    PACK_DELETE_BLOBS = """
        DELETE FROM blob_chunk
        WHERE zoid IN (SELECT zoid FROM temp_pack_batch)
          AND tid < (SELECT t.below FROM temp_pack_batch t WHERE t.zoid = blob_chunk.zoid)
    """
    PACK_DELETE_REFS = """
        DELETE FROM object_ref
        WHERE zoid IN (SELECT zoid FROM temp_pack_batch)
          AND tid < (SELECT t.below FROM temp_pack_batch t WHERE t.zoid = object_ref.zoid)
    """
    PACK_DELETE_CURRENT = """
        DELETE FROM current_object
        WHERE zoid IN (SELECT zoid FROM temp_pack_batch WHERE garbage = 1)
    """
    # The removal lists read by other processes (see pack_removed_list above).
    PACK_REMOVED_LOG = """
        INSERT INTO pack_removed_list (mark, garbage, trimmed) VALUES (%s, %s, %s)
    """
    PACK_REMOVED_CLEAR = "DELETE FROM pack_removed_list"
    PACK_REMOVED_GET = """
        SELECT garbage, trimmed FROM pack_removed_list WHERE mark > %s AND mark <= %s
    """
    # Candidates after the OID where the deletion stands (%s) that still
    # exist (a batch may have taken some along: prepare_pack_batch).
    PACK_ANY_GARBAGE = """
        SELECT p.zoid FROM pack_object p JOIN {current} c ON c.zoid = p.zoid
        WHERE p.garbage = 1 AND p.zoid > %s AND p.zoid IN ({in_list})
    """

    # The candidates once the deletion went through them all.  The
    # batches leave theirs (pack_info's deleted_upto says where the
    # deletion stands): on MariaDB, deleting each batch's rows of
    # pack_object took a fifth of the deletion; one DELETE of them all
    # takes a third of that.  Not TRUNCATE: it needs a lock that a
    # pg_dump or mysqldump holds for their whole run, and MySQL's DROP
    # privilege.
    PACK_CLEAR_DONE = "DELETE FROM pack_object"
    # Where the pack's tables are apart (SQLite): see PackVerbs.forget_deleted.
    PACK_DONE_REFS = PACK_DONE_OBJECTS = None

    # History-preserving end of a pack: transactions up to the pack time
    # are packed (no undo), and those left without states go.
    PACK_MARK_PACKED = """
        UPDATE transaction_log SET packed = %s WHERE tid <= %s AND packed <> %s
    """

    # References from current revisions to objects that do not exist.
    PACK_MISSING_REFERENCES = """
        SELECT r.zoid, r.tid, r.to_zoid
        FROM {current} c
        JOIN object_ref r ON r.zoid = c.zoid AND r.tid = c.tid
        LEFT JOIN {current} t ON t.zoid = r.to_zoid
        WHERE t.zoid IS NULL
        ORDER BY r.zoid, r.to_zoid
    """


class EarlierReleaseReads:
    """Mixin over a vendor's ``Statements``: the reads, and only the reads,
    over the schema that RelStorage 3.x and 4.x created (see
    storage/earlier.py), so that such a database can be zodbconvert's
    source.  Its ``object_state``, ``current_object`` and ``blob_chunk``
    have the columns ours read (``object_state`` has an ``md5`` more, and a
    history-free ``blob_chunk`` is keyed by ``zoid`` alone but has
    ``tid``); what differs is named here:

    - the transaction metadata is in ``transaction`` (a keyword, quoted as
      the vendor quotes identifiers: ``TRANSACTION_TABLE``), which also
      holds a row of tid 0 that is no transaction;
    - the last transaction is the highest tid in the data: nothing records
      it apart (``commit_row_lock`` is only locked).

    A vendor whose blob chunks differ (PostgreSQL's are large objects)
    overrides the blob statements in its own mixin.
    """

    TRANSACTION_TABLE = '"transaction"'

    GET_LAST_TID = "SELECT MAX(tid) FROM {transaction}"
    GET_LAST_TID_HF = "SELECT MAX(tid) FROM object_state"

    # Ours, on the other table; the row of tid 0 is no transaction.
    HISTORY = Statements.HISTORY.replace('transaction_log', '{transaction}')
    ALL_TRANSACTIONS_IN_RANGE = Statements.ALL_TRANSACTIONS_IN_RANGE.replace(
        'transaction_log', '{transaction}').replace('AND tid <= %s', 'AND tid <= %s AND tid > 0')

    # Reads of ours that the earlier schema cannot answer, and which a
    # read-only storage never sends: None, so that a use fails loudly.
    POLL_CHANGES_AROUND = UNDO_LOG = TRANSACTION_EXISTS = TRANSACTIONS_IN_RANGE = None
    GET_SNAPSHOT_MARKS = GET_SNAPSHOT_MARKS_WITNESS = GET_SNAPSHOT_MARKS_WITNESS_HF = None

    def __init__(self, keep_history):
        super().__init__(keep_history)
        for name in ('GET_LAST_TID', 'HISTORY', 'ALL_TRANSACTIONS_IN_RANGE'):
            value = getattr(self, name)
            setattr(self, name, value.replace('{transaction}', self.TRANSACTION_TABLE))
