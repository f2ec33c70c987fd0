"""Exceptions raised by RelStorage, and the contract its adapters follow.

The exception classes sort failures into the three kinds a ZODB application
has to tell apart: retry the transaction (ConflictError subclasses and
DisconnectedError, all ``transaction.interfaces.TransientError``), fix the
configuration (SchemaMismatchError, ConfigurationError) or report a bug
(the rest of StorageError).  A failure of ``tpc_finish`` (CommitFailedError,
CommitUnknownError) is never one to retry.

``IRelStorageAdapter`` is the contract between the storage and its
adapters: what storage/, cache/, blobs/ and the tools may ask of one.
"""
import transaction.interfaces
from zope.interface import Attribute
from zope.interface import Interface
from ZODB.POSException import ConflictError
from ZODB.POSException import ReadConflictError  # noqa: F401 re-exported
from ZODB.POSException import StorageError


class RelStorageError(StorageError):
    """Base class of errors specific to RelStorage."""


class UnableToAcquireLockError(ConflictError):
    """A lock could not be had within ``commit-lock-timeout``.

    A ConflictError, so transaction managers retry it.  The store
    transaction has already been rolled back: nothing stays locked.
    """

    def __init__(self, message, oids=()):
        ConflictError.__init__(self, message)
        self.oids = tuple(oids)
        self._message = message

    def __str__(self):
        return self._message


class UnableToLockRowsError(UnableToAcquireLockError):
    """Timed out or deadlocked while locking the objects being committed."""


class UnableToAcquireCommitLockError(UnableToAcquireLockError):
    """Timed out waiting for the database-wide commit lock."""


class SessionPoolExhaustedError(UnableToAcquireLockError):
    """Every store session of the process's pool (session-pool-size) stayed
    in use for commit-lock-timeout seconds."""


class DisconnectedError(RelStorageError, transaction.interfaces.TransientError):
    """The database connection was lost; the next transaction reconnects."""


class StorageClosedError(RelStorageError):
    """The storage was used after its close()."""


class SameDatabaseTwiceError(RelStorageError):
    """Two storage instances of one database voted in the same thread
    without the first finishing (two ZODB connections of one database, or
    an undo beside other changes of it, in one transaction): the second
    would wait for the commit lock the first holds until it is finished,
    which cannot happen.  Not a TransientError: a retry does the same."""


class PermissionDeniedError(RelStorageError):
    """The database refused the configured user a statement (a missing
    grant); the driver's error is its ``__cause__``."""


class DatabaseFullError(RelStorageError):
    """The database ran out of room (its disk, a tablespace): the
    statement was refused and nothing of it was written.  The driver's
    error is its ``__cause__``.  Not a TransientError: a retry needs
    room made first."""


class CommitFailedError(RelStorageError):
    """The connection was lost during the database COMMIT of
    ``tpc_finish``, and the server did not commit: nothing of the
    transaction is in this database.  Not a TransientError: other
    databases joined in the same transaction may have finished their part
    already, and a retry would apply that part twice (ZODB calls
    ``tpc_finish`` on each in turn)."""


class CommitUnknownError(RelStorageError):
    """The connection was lost during the database COMMIT of ``tpc_finish``.

    The server may or may not have committed the transaction: the one
    failure two-phase commit leaves after a successful vote.  Reconnect and
    look (the transaction's tid is in the message) before redoing it; not
    a TransientError, since a blind retry could apply the change twice.
    """


class NewObjectExistsError(RelStorageError):
    """A commit stored an object as new, and the database already has a row
    for its OID (see ``Adapter.move_into_place``)."""


class SchemaMismatchError(RelStorageError):
    """The database holds a schema other than the one configured."""


class EarlierSchemaError(SchemaMismatchError):
    """The database holds the schema of RelStorage 3.x or 4.x.

    This release reads it only when the storage is read-only (a
    zodbconvert source); ``keep_history`` says which history mode the
    schema has.
    """

    def __init__(self, where, tables, keep_history, readable=True):
        self.keep_history = keep_history
        if readable:
            how = ("Copy it into a new database with zodbconvert: this storage "
                   "section can be its source as it stands (zodbconvert opens the "
                   "source read-only, and read-only, this release reads that schema).")
        else:
            how = ("This release cannot read it here either: copy it with the "
                   "earlier release's zodbconvert (into a FileStorage, for example), "
                   "then from there.")
        SchemaMismatchError.__init__(
            self,
            "The database at %s holds the %s schema of an earlier RelStorage "
            "release (3.x or 4.x: it has %s), which this release does not write "
            "to; nothing was changed. %s See \"From an earlier RelStorage "
            "release\" in docs/zodbconvert.rst."
            % (where, 'history-preserving' if keep_history else 'history-free',
               ', '.join(tables), how))


class StateTooLargeError(RelStorageError):
    """A pickle (or a transaction's metadata) is larger than the database
    accepts: MySQL's max_allowed_packet, or the largest value PostgreSQL or
    SQLite can store and give back (Adapter.max_state_bytes)."""


def describe_oids(oids, limit=10):
    """A short, bounded text naming some OIDs (for error messages)."""
    oids = list(oids)
    shown = ', '.join('0x%x' % o for o in oids[:limit])
    if len(oids) > limit:
        shown += ' and %d more' % (len(oids) - limit)
    return shown


# ----------------------------------------------------------------------
# The adapter contract
#
# What the layers above (storage/, cache/, blobs/, the tools) may ask of an
# adapter.  Every method takes the ``DBConnection`` it runs on (opened by
# the adapter) as its first argument where it touches the database; OIDs
# and tids are ints.  ``relstorage.adapters.base.Adapter`` implements all
# of it on ANSI statements; a vendor package overrides what differs.


class IRelStorageAdapter(Interface):
    """One database, as the storage sees it."""

    vendor = Attribute("Short name of the database kind: 'sqlite', 'postgresql', ...")
    keep_history = Attribute("True for a history-preserving schema.")
    options = Attribute("The relstorage.options.Options the adapter was made with.")
    has_blob_chunk = Attribute("Whether the schema holds blob bytes (blob_chunk).")
    new_rows_direct_bytes = Attribute(
        "At most how many bytes of states of new objects (OIDs this process "
        "handed out) a commit inserts straight into place (insert_new_objects) "
        "instead of through temp_store; 0: never.")

    def describe():
        """Where the adapter connects, for messages; never a password."""

    def database_identity():
        """What tells this database apart from every other, as its server
        names it (adapters.base.same_database compares two)."""

    def refresh_statistics():
        """Fresh query planner statistics of the tables after a bulk load
        (zodbconvert), where the vendor's planner wants them."""

    def prepare_schema(create=True, read_only=False):
        """Create the schema when allowed, else verify it.

        Raises SchemaMismatchError, before writing anything, when the
        database holds the other history mode or no schema at all.
        """

    def open_load():
        """A new connection for snapshots (``begin_snapshot``)."""

    def open_primary_load():
        """The same, on the server commits go to even when read-only
        replicas are configured (the pack's reads)."""

    def open_store():
        """A new connection for commits.  Its temporary tables come with
        its first ``begin_store_checked`` that writes data (or
        ``prepare_temp_tables``)."""

    def close():
        """Release what the adapter itself holds (the OID connection)."""

    def drop_all():
        """Remove every table: tests and ``zodbconvert --clear``."""

    def zap_all():
        """Remove every object and transaction, keeping the schema, in one
        transaction under the commit lock; the last tid goes back to 0 and
        the pack mark moves on.  Returns (last tid before, new pack mark)."""

    # --- snapshots -------------------------------------------------------

    def begin_snapshot(conn):
        """Start one consistent read-only snapshot; it lasts until rollback."""

    def snapshot_marks(conn, witnesses=()):
        """(last committed tid, pack mark, {oid: tid}) as seen by the
        snapshot: the last, the current tid of each of the objects
        ``witnesses`` that exists."""

    def get_last_tid(conn):
        """The last committed tid the connection sees (0 when none)."""

    def poll_changes(conn, after_tid, upto_tid, known=None):
        """(oid, tid) of the objects changed in (after_tid, upto_tid];
        ``known``: {tid: [oid]} of transactions whose changes the caller
        knows, which need not be read back."""

    def recent_changes(conn, upto_tid, limit):
        """The ``limit`` newest (oid, tid) changes up to ``upto_tid``."""

    def load_current(conn, oid):
        """(state, tid) of the current revision, or None.

        A None state means the object does not exist (creation undone,
        or deleted by external GC).
        """

    def load_current_many(conn, oids):
        """{oid: (state, tid)} for those of ``oids`` that exist."""

    def load_revision(conn, oid, tid):
        """(True, state) when revision (oid, tid) exists, else (False, None)."""

    def load_before(conn, oid, tid):
        """(state, start_tid, end_tid or None) current just before ``tid``,
        or None."""

    def current_tids(conn, oids):
        """{oid: tid} of the current revisions of ``oids``."""

    def count_objects(conn):
        """How many objects exist (may be an estimate on big databases)."""

    def database_size(conn):
        """Bytes used by states and blobs (approximate)."""

    # --- OIDs ----------------------------------------------------------

    def new_oid():
        """A new OID (int), never handed out before by any client."""

    def note_oids_used(max_oid):
        """No later ``new_oid`` may return ``max_oid`` or anything below."""

    # --- commit (store connection; see storage/commit.py) ------------

    def begin_store_checked(conn, writes_data=True, durable=True, blobs=True):
        """Begin the write transaction; on single-writer databases this
        waits for the database lock, raising UnableToAcquireCommitLockError
        after commit-lock-timeout.  ``writes_data`` false: the transaction
        will store no object and no blob.  ``durable`` false: a power loss
        may undo it without losing anybody's data (a pack's deletions).
        With ``writes_data``, the connection's temporary tables exist
        afterwards (``prepare_temp_tables``; ``blobs`` false: not
        ``temp_blob_chunk``, which only blobs kept in the database use)."""

    def prepare_temp_tables(conn, blobs=True):
        """Make sure ``conn``'s temporary tables exist (``temp_blob_chunk``
        only with ``blobs``): created once per
        session, committed on their own when ``conn`` is between
        transactions; inside one (a vote going on from a held
        transaction), created in it, and again at the next
        ``begin_store_checked`` should it roll back."""

    def clear_temp(conn):
        """Empty ``temp_store``."""

    def clear_temp_blobs(conn):
        """Empty ``temp_blob_chunk``."""

    def upload(conn, rows):
        """Put (oid, prev_tid, state) rows into ``temp_store`` in bulk."""

    def note_temp_rows(conn, rows, nbytes, name='temp_store'):
        """Count ``rows`` rows of ``nbytes`` bytes just put into a
        temporary table: past the vendor's limit, the next clear_temp
        resets the table instead of deleting its rows."""

    def lock_objects_checked(conn, oids, read_current_oids):
        """Lock the current rows of ``oids`` exclusively and of
        ``read_current_oids`` shared, in OID order, within
        commit-lock-timeout; UnableToLockRowsError (a ConflictError) after
        rolling back otherwise.  Returns {oid: current tid} of the rows
        locked when the locking statements read them, else None."""

    def lock_hold_seconds():
        """How long (seconds of idleness) a store transaction that lost a
        conflict keeps its row locks for the retry; 0 where the vendor
        cannot bound an idle transaction or keep-locks-on-conflict is 0."""

    def hold_locks(conn, seconds):
        """Leave the store transaction of ``conn`` open with its locks and
        have the server end it when idle more than ``seconds``."""

    def end_hold(conn):
        """Undo ``hold_locks``'s idle limit before the held transaction
        goes on (a retry votes in it) or is rolled back."""

    def detect_conflicts(conn, rows, current=None):
        """(oid, committed_tid, prev_tid) for every ``(oid, prev_tid)`` of
        ``rows`` whose current revision exists and is not ``prev_tid``;
        ``current`` is what lock_objects_checked returned."""

    def claim_fresh_oids(oids):
        """The OIDs of ``oids`` handed out by ``new_oid`` in this process and
        not claimed by a vote since (no other transaction can have their
        rows); removes them from that set."""

    def fix_prev_tids(conn):
        """For restore: base every uploaded row on the current revision."""

    def advance_tid(conn, now_tid, requested=None):
        """Take the commit lock and publish a new last tid; return it with
        the pack mark as read once the lock is held: (tid, mark).

        ``requested`` (restore) when that is after the last tid, else the
        later of ``now_tid`` and last + 1.  The lock is held until the
        transaction ends; UnableToAcquireCommitLockError after
        commit-lock-timeout.
        """

    def set_last_tid(conn, tid):
        """Publish ``tid`` as the last committed one (commit lock held)."""

    def move_into_place(conn, tid, has_data, user, description, extension, packed=False,
                        all_new=False, some_new=False, new_rows=()):
        """Make the uploaded rows the revisions of ``tid`` and record the
        transaction's metadata.  ``has_data``: temp_store holds rows;
        ``all_new``: every uploaded object is stored as new (prev_tid 0),
        ``some_new``: some are; ``new_rows``: (oid, state) of new objects
        to insert without temp_store (insert_new_objects).
        NewObjectExistsError when one of the new objects has a row after
        all."""

    def insert_new_objects(conn, tid, rows):
        """Insert ``(oid, state)`` rows as objects created by ``tid``
        (commit lock held)."""

    def commit_outcome(tid, has_data):
        """After a COMMIT that lost its connection: True when ``tid`` was
        committed, False when it was not, None when that cannot be told."""

    def upload_blob_chunk(conn, oid, chunk_num, data):
        """Put one chunk of a blob into ``temp_blob_chunk``."""

    def move_blobs_into_place(conn, tid, has_uploads, has_data=True):
        """Make the uploaded chunks the blobs of revision ``tid``.
        ``has_data`` false: ``temp_store`` holds no row of this
        transaction (history-free, no old blob is then replaced)."""

    def copy_blob(conn, oid, from_tid, to_tid):
        """Reuse the blob of (oid, from_tid) for (oid, to_tid) (undo)."""

    # --- blobs, history, iteration -------------------------------------

    def blob_chunk_count(conn, oid, tid):
        """How many chunks blob (oid, tid) has (0: none)."""

    def any_blob_chunk(conn):
        """Does the database hold the bytes of any blob?"""

    def load_blob_chunk(conn, oid, tid, chunk_num):
        """The bytes of one chunk."""

    def history(conn, oid, size):
        """Up to ``size`` newest revisions of ``oid``, with their
        transactions' metadata."""

    def record_iternext(conn, start_oid, count=2):
        """The current records (oid, tid, state) of the ``count`` objects
        from ``start_oid`` up, in OID order."""

    def record_sizes(conn, start_oid, count):
        """(oid, state size) of the ``count`` current rows from
        ``start_oid`` up (those without a state too), without reading
        their states."""

    def transactions_in_range(conn, start, stop, limit):
        """(tid, user, description, extension, packed) of the first
        ``limit`` transactions in [start, stop], in tid order."""

    def records_in_transaction(conn, tid):
        """(oid, state) of every record of transaction ``tid``."""

    def undo_log(conn, upto_tid, limit):
        """The newest ``limit`` transactions up to ``upto_tid``, newest
        first: (tid, user, description, extension)."""

    def transaction_packed(conn, tid):
        """True/False for a transaction that exists, None when it does not."""

    def undo_sources(conn, tid):
        """(oid, prev_tid, current_tid) of every object ``tid`` changed."""

    def undo_states(conn, tid, oids):
        """{oid: (before_found, before_state, current_state, undone_state)}
        for the objects ``oids`` that ``tid`` changed:
        the revision before ``tid`` (found or packed away), and for an
        object changed since its current state and the state ``tid``
        wrote (both None for an object not changed since)."""

    def count_history(conn):
        """(revisions, objects), exact."""

    # --- pack (adapters/packing.py; storage/pack.py drives it) ----------

    def lock_commit_checked(conn):
        """Take the commit lock (as a commit does); return the last tid."""

    def bump_pack_mark(conn):
        """Increment the pack mark, in the transaction that deletes rows,
        so that other processes drop what may be gone."""

    def copy_mark(conn):
        """When (seconds since the epoch) a copy into this database began
        that has not finished, or None: a pack with garbage collection
        refuses to run meanwhile."""

    def set_copy_mark(conn, started, copied_too=True):
        """Record that a copy began at ``started`` unless an earlier one's
        mark is there (returned, else None), or (None) that none is
        unfinished (which, ``copied_too``, also forgets the last copied
        tid: unfinished_copy); the caller commits."""

    def unfinished_copy(conn):
        """``(began, copied)``: copy_mark, and the tid of the last
        transaction committed with a tid of its own (a copy's) if no other
        transaction committed after it, else None."""

    def note_copied_tid(conn, tid):
        """Record ``tid``, in the vote of a transaction begun with a tid of
        its own, under the commit lock (unfinished_copy)."""

    def acquire_pack_lock():
        """A lock object (``close()`` releases it) held by a session of its
        own, or None when another pack holds it; a killed pack's lock goes
        with its session."""

    def open_pack():
        """A store connection with the pack tables (created on demand) and
        its temporary work tables."""

    def pack_info(conn):
        """{name: int} of the pack's recorded progress (``refs_tid``...)."""

    def set_pack_info(conn, **values):
        """Record progress values."""

    def iter_revisions(conn, after_tid, upto_tid, kept_at=None, page=None):
        """(oid, tid, state) of every revision in (after_tid, upto_tid], by
        tid, streamed: never the whole database in client memory.  With
        ``kept_at`` (history-preserving), without the revisions replaced
        by one of ``kept_at`` or before: a pack to that time or later
        removes them, and needs none of their references.  Read in pages
        of whole tids of about ``page`` revisions (0: all, in the snapshot
        ``conn`` is in), each in a snapshot of its own (renew_snapshot),
        so that no snapshot lasts the whole analysis; history-free, a
        revision that a commit after ``upto_tid`` replaced or deleted
        before its page was read is left out."""

    def renew_snapshot(conn, upto_tid):
        """End the snapshot of load connection ``conn`` and start another
        on the same server; return its last tid.  RelStorageError if that
        is before ``upto_tid``."""

    def count_revisions(conn, after_tid, upto_tid, kept_at=None):
        """How many revisions iter_revisions would yield."""

    def pack_refs_tid(conn):
        """The tid up to which every revision's references are recorded;
        0 when none are, or when they were lost."""

    def forget_refs_after(conn, tid):
        """Drop references recorded for revisions after ``tid`` (leftovers
        of an interrupted analysis)."""

    def add_refs(conn, oids, rows, seeds=False, fresh=False):
        """Record (zoid, tid, to_zoid) rows for the revisions of ``oids``;
        with ``seeds`` (history-free), also where new garbage may be, for
        the next incremental reachability.  ``fresh``: object_ref was
        empty when the analysis started (history-free, no earlier
        references to forget)."""

    def records_seeds(conn):
        """Whether an analysis must record seeds (``add_refs``)."""

    def compute_pack_candidates(conn, pack_tid, gc, snapshot_tid=None):
        """Fill the candidate table with what a pack to ``pack_tid`` removes
        (unreachable objects when ``gc``), by set-based SQL, writing only
        the pack's own tables (begin_pack_write).  Returns (frontier
        steps, objects an incremental reachability examined or None)."""

    def begin_pack_write(conn):
        """Begin a transaction that writes only the pack's own tables."""

    def pair_pack_tables(conn):
        """Called by each analysis once its snapshot is taken: where the
        pack's tables are kept apart from the data, tie them to the data
        as it is now, so that they are not used with another copy."""

    def forget_deleted(conn, upto_oid, final=False):
        """After a deletion batch committed (and, ``final``, once all
        did): drop the references and candidates of what the batches
        removed (the candidates up to ``upto_oid``), where the pack's
        tables are apart (pack_tables_apart), once those batches are on
        disk (sync_deleted); otherwise each batch removed the references,
        and ``final`` removes the candidates."""

    def writers_waiting():
        """Whether a write transaction waits for the database's write lock
        (where the commit lock is that: pack_lock_is_write_lock), so that
        a pack leaves it a turn between two deletion batches; True where
        it cannot be known."""

    def sync_deleted(conn):
        """Wait until the deletion batches committed so far are on disk
        (a batch begun with ``durable`` false may commit before)."""

    def deleted_sync(conn):
        """sync_deleted as a function of no argument that does not use
        ``conn`` (the pack calls it in a thread of its own while it goes
        on), or None where there is nothing to wait for."""

    def seed_unreached(conn, oids):
        """Of ``oids`` (changed after the analysis), record as seeds those
        the last reachability did not reach (history-free)."""

    def pack_candidate_stats(conn):
        """(objects, revisions, bytes, blob revisions) the candidates hold."""

    def new_revisions(conn, after_tid, upto_tid):
        """(oid, tid) committed in (after_tid, upto_tid]: what a deletion
        batch re-checks its candidates against."""

    def rescue_candidates(conn, after_tid, referenced):
        """Drop from the candidates what commits after ``after_tid`` made
        reachable again, transitively."""

    def prepare_pack_deletion(conn):
        """Before the first deletion batch: what makes every batch
        upward-closed (the references between garbage candidates)."""

    def delete_pack_batch(conn, after_oid, limit):
        """Delete the next ``limit`` candidates after ``after_oid``, and the
        garbage candidates after them that lead to garbage among them
        (joins against temporary tables); return what was removed."""

    def mark_packed(conn, pack_tid):
        """History-preserving, as the deletion starts: transactions up to
        ``pack_tid`` can no longer be undone."""

    def finish_pack(conn, pack_tid):
        """History-preserving: remove the transactions up to ``pack_tid``
        (marked packed by mark_packed) left without any state."""

    def missing_references(conn):
        """(oid, tid, missing oid) of references to objects that do not
        exist (``zodbpack --check-refs-only``)."""
