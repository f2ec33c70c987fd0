"""One two-phase commit: the state it carries and the steps it runs.

ZODB's contract (``IStorage.tpc_vote``): once vote has returned, finish must
not fail for any reason vote could have detected.  Other resource managers
of the same transaction (another database, a SQL session) may already have
committed when our finish runs, so everything that can fail happens in vote:

vote
  1. begin the store transaction (single-writer databases lock here);
  2. lock the current rows of the objects we change (exclusive) and of the
     objects read with ``readCurrent`` (shared), in OID order so that two
     committers cannot deadlock;
  3. find the objects changed since their ``prev_tid`` and resolve those
     conflicts with ``_p_resolveConflict``, or raise ConflictError;
  4. upload the states, as resolved, into ``temp_store`` in bulk (but for
     small sets of new objects, which go straight into place in 7; and a
     commit of more than ``Adapter.upload_after_locks_bytes`` uploads
     before step 2, so as not to hold row locks for it, and again after
     4 if it resolved a conflict);
  5. upload blob bytes; check that the ``readCurrent`` objects are current;
  6. take the commit lock and choose a tid strictly greater than the last
     committed one (``Adapter.advance_tid``; one statement on PostgreSQL);
  7. move the rows into place (and insert the new objects that skipped
     ``temp_store``), record the transaction, place the blobs,
     make sure no later allocation hands out the OIDs we stored.

finish
  8. COMMIT (releasing every lock), then publish the tid to the caches.

The commit lock is taken last in vote, after the row locks and conflict
resolution that may wait, so it is held for steps 6-8 only: the moves, the
other resource managers' votes, and the COMMIT.  A lost connection during
the COMMIT is the one failure left; it is reported as such
(``CommitFailedError``, or ``CommitUnknownError`` when the server may have
committed), never as an error to retry.

Fairness.  A transaction that loses a conflict (its rows locked, a newer
revision found that cannot be merged) would, retried, read the winner's
state and vote again, and could lose again to a third committer: under
contention one process can need dozens of attempts.  Where the server can
bound an idle transaction (``Adapter.holds_locks_for_retry``), the loser's
store transaction stays open with its row locks instead of rolling back,
for at most ``keep-locks-on-conflict`` seconds of idleness: the retry on
the same ZODB connection then votes in that transaction, and nobody can
have changed the objects it lost on.  The hold ends with that vote, with
the instance's release, or when the server ends the idle session; the
next vote then simply reconnects.

``Commit`` holds the state from ``tpc_begin`` to the end; the storage keeps
one per transaction and lower layers get what they need as arguments.
``RelStorageWriter`` (copy.py) runs the same steps for batches of copied
transactions through ``Commit.add_copied``.

Fault points (see faults.py) name the moments between the steps; the
crash-point tests (tests/crash_cases.py) end a committing process at each:
FAULT_POINTS lists them in the order a commit reaches them.
"""
import itertools
import logging
import os
import threading
import time

from ZODB import POSException
from ZODB.utils import newTid
from ZODB.utils import p64
from ZODB.utils import u64

from ..interfaces import CommitFailedError
from ..interfaces import CommitUnknownError
from ..interfaces import DisconnectedError
from ..interfaces import NewObjectExistsError
from ..interfaces import RelStorageError
from ..interfaces import StateTooLargeError
from ..interfaces import UnableToLockRowsError
from ..messages import one_line as _one_line
from .faults import fault_point
from .history import MAX_TID
from .tempstore import TempStore

log = logging.getLogger(__name__)

FAULT_POINTS = (
    'begin', 'vote.locked', 'vote.resolved', 'vote.uploaded', 'vote.commit_locked',
    'vote.moved', 'finish.before_commit', 'finish.committed', 'finish.published',
)
#: From this point on the transaction is committed.
FIRST_COMMITTED_POINT = 'finish.committed'
#: How long tpc_finish keeps asking whether a COMMIT that lost its
#: connection was committed, while the server cannot be reached (seconds;
#: a restart refused connections 0.2-2 s here), the first retry after
#: OUTCOME_FIRST_DELAY seconds, each next one twice as late, up to 1 s.
#: (No new attempt starts after the deadline; one under way may take its
#: connect timeout.)
OUTCOME_PATIENCE = 6.0
OUTCOME_FIRST_DELAY = 0.1


def _is_lock_error(adapter, exc):
    """Whether ``exc`` is the driver's lock timeout or deadlock (not one
    of ours, which are already ConflictErrors or say what they are)."""
    if isinstance(exc, (POSException.POSError, RelStorageError)):
        return False
    try:
        return adapter.classify_error(exc) == 'lock'
    except Exception:  # pylint:disable=broad-except
        return False


class CopiedTransaction:
    """A transaction copied verbatim (zodbconvert): its tid, metadata and
    ``(oid_int, state)`` rows; state None records a deletion."""

    __slots__ = ('tid', 'user', 'description', 'extension', 'packed', 'rows')

    def __init__(self, tid, user, description, extension, packed, rows):
        self.tid = tid
        self.user = user
        self.description = description
        self.extension = extension
        self.packed = packed
        self.rows = rows


def end_hold_and_roll_back(adapter, conn):
    """Roll back the transaction ``conn`` held for a retry (its hold's
    end may fail on a session already gone: that is no matter)."""
    try:
        adapter.end_hold(conn)
    except Exception:  # pylint:disable=broad-except
        log.debug("Could not end the hold of row locks", exc_info=True)
    conn.rollback()


class Commit:
    """The two-phase commit of one transaction (or one batch of copied
    transactions) on one storage instance."""

    def __init__(self, adapter, cache, blobs, txn, meta=None, tid=None, read_mark=None,
                 untransform=None):
        self.adapter = adapter
        #: The record transform of a storage wrapper (<zlibstorage>)
        #: undone, for reading the references of what is stored (see
        #: _stored_references), or None.
        self.untransform = untransform
        self.cache = cache
        self.blobs = blobs
        self.txn = txn
        #: The thread, and process, that began it (see
        #: RelStorage._begin_commit and _check_one_voter).
        self.thread = threading.get_ident()
        self.pid = os.getpid()
        #: (user, description, extension, status) as bytes (status a str).
        self.meta = meta
        #: The tid asked for by tpc_begin (restore), as an int, or None.
        self.requested_tid = tid
        #: The pack mark of the first snapshot this transaction read from
        #: (RelStorage._read_mark: its poll's, or the first after the last
        #: transaction ended), or None: see _check_not_removed.
        self.read_mark = read_mark
        #: Whether it stores states read with loadSerial or loadBefore
        #: (see _check_not_removed; an undo's are: undone_tids).
        self.from_history = False
        #: The transactions it undoes (see _check_not_packed).
        self.undone_tids = set()
        self.tstore = TempStore()
        #: The largest state the database takes (see _refuse_size), and
        #: the smallest.
        self.max_state_bytes = adapter.max_state_bytes or float('inf')
        self.min_state_bytes = 1 if adapter.empty_state_is_null else 0
        self.read_current = {}          # oid_int -> tid_int seen (filled by the storage's
                                        # checkCurrentSerialInTransaction)
        self.resolved = set()           # oid_ints whose conflict was resolved
        self.fresh = None               # new OIDs nobody else can hold (_claim_fresh)
        self.new_count = 0              # objects stored as new (prev_tid 0), idem
        self.unallocated_max = -1       # highest OID stored as new and not fresh, idem
        self.restoring = False          # restore(): copy history verbatim
        self.undone = set()             # oid_ints restored without a state
        self.btxn = blobs.begin() if blobs is not None else None
        self.copied = []                # CopiedTransaction (copy.py's batches)
        self.tid = None                 # chosen in vote
        self.committed = False          # the COMMIT went through (finish)
        self.commit_sent = False        # a COMMIT was interrupted: it may have
                                        # gone through (its blob files stay)
        self.conn = None                # store connection, from vote on
        self.voted = False
        self.locked = False             # our row locks are taken
        self.lost = False               # a conflict check failed under them
        fault_point('begin')

    # ------------------------------------------------------------------
    # Buffering (no I/O)

    def store(self, oid_int, prev_tid_int, state):
        if state is not None and not self.min_state_bytes <= len(state) <= self.max_state_bytes:
            self._refuse_size(oid_int, state)
        self.tstore.store(oid_int, prev_tid_int, state)
        if self.undone:
            self.undone.discard(oid_int)

    def restore(self, oid_int, tid_int, state):
        if state is not None and not self.min_state_bytes <= len(state) <= self.max_state_bytes:
            self._refuse_size(oid_int, state)
        self.restoring = True
        self.tstore.store(oid_int, tid_int, state)
        if state is None:
            self.undone.add(oid_int)
        else:
            self.undone.discard(oid_int)

    def add_blob(self, oid_int, path):
        self.btxn.add(oid_int, path)

    def add_copied(self, copied):
        """Queue a ``CopiedTransaction``; a batch of them commits as one
        database transaction, each under its own tid."""
        for oid_int, state in copied.rows:
            if state is not None and not (self.min_state_bytes <= len(state)
                                          <= self.max_state_bytes):
                self._refuse_size(oid_int, state)
        self.copied.append(copied)

    def _refuse_size(self, oid_int, state):
        if not state:
            raise POSException.StorageError(
                "The state of object 0x%x is empty, which %s cannot store (it would "
                "read back as no object); nothing was written. A ZODB pickle is never "
                "empty: check what wrote it." % (oid_int, self.adapter.describe()))
        raise StateTooLargeError(
            "The state of object 0x%x is %d bytes, more than the %d bytes %s can store "
            "in one object (%s); nothing was written. Store less in one object (large "
            "data belongs in a blob)."
            % (oid_int, len(state), self.adapter.max_state_bytes, self.adapter.describe(),
               self.adapter.max_state_reason))

    # ------------------------------------------------------------------
    # Vote

    def vote(self, conn, resolve):
        """Run steps 1-7 on the store connection ``conn``; return the OIDs
        (ints) whose conflicts ``resolve`` (ZODB's tryToResolveConflict)
        merged.  On any failure the database transaction is rolled back
        and nothing stays locked."""
        self.conn = conn
        try:
            if self.copied:
                self._vote_copied(conn)
            else:
                self._vote(conn, resolve)
        except POSException.ConflictError:
            # Only a conflict found under our row locks is worth holding
            # them for; a lock timeout has already rolled back.
            if not (self.lost and self._hold_locks()):
                self._rollback()
            raise
        except Exception as exc:
            self._rollback()
            if _is_lock_error(self.adapter, exc):
                # A deadlock or lock wait timeout in a statement of the vote
                # other than the locking ones (which say so themselves): the
                # database rolled back, and a retry may well pass.  (A
                # helper agent's check: MariaDB's deletion of a written
                # blob's old chunks deadlocked with a pack batch, and the
                # driver's error reached the application, not retried.)
                raise UnableToLockRowsError(
                    "Could not complete the vote on %s (lock timeout or deadlock: %s)"
                    % (self.adapter.describe(), _one_line(exc))) from exc
            raise
        except BaseException:
            self._rollback()
            raise
        self.voted = True
        return sorted(self.resolved)

    def _vote(self, conn, resolve):
        adapter, tstore = self.adapter, self.tstore
        writes_data = len(tstore) > 0 or bool(self.btxn)
        blobs = self.blobs is not None and self.blobs.in_database
        if conn.holding_locks and adapter.server_moved(conn):
            # The site moved to another server since the lost vote
            # (replica-conf edited, a failover): the held transaction is on
            # the one it left.  Rolled back there; the retry begins on the
            # one chosen now (a helper agent's check: it committed on the
            # server the site had left).
            end_hold_and_roll_back(adapter, conn)
            conn.holding_locks = False
        if conn.holding_locks:
            # Our previous attempt's transaction, with its row locks (and
            # the session may be one that never wrote: a readCurrent-only
            # vote that lost).
            adapter.end_hold(conn)
            conn.holding_locks = False
            if writes_data:
                adapter.prepare_temp_tables(conn, blobs)
        else:
            adapter.begin_store_checked(conn, writes_data=writes_data, blobs=blobs)
        fresh = self._claim_fresh()
        # New objects that go into place after the commit lock, without
        # temp_store (adapter.new_rows_direct_bytes).
        new_rows = self._new_rows(fresh)
        # The states go up once conflicts are resolved, under the row
        # locks: a resolved state then goes up once, not uploaded, deleted
        # and uploaded again (1000 conflicting objects: 10-11 % longer on
        # PostgreSQL and MariaDB), and only a commit of the same objects
        # waits meanwhile.  But a large upload goes first, as it would
        # hold the locks of objects many commits change (a BTree's
        # buckets, a Length) for its whole length; should it resolve a
        # conflict, it is sent again.
        early = tstore.nbytes > adapter.upload_after_locks_bytes
        if early:
            self._upload(conn, new_rows)
        read_current = self._read_current_only()
        to_lock = [oid for oid in tstore.oids() if oid not in fresh]
        # {oid: current tid} of the locked rows, when the vendor's locking
        # statements read it: then checking costs no query.
        current = None
        if to_lock or read_current:
            # (lock_runs puts every OID in order.)
            current = adapter.lock_objects_checked(conn, to_lock, list(read_current))
            self.locked = True
        fault_point('vote.locked')
        resolved = False
        if not self.restoring and len(tstore) > len(fresh):
            resolved = self._lost_if_raises(self._resolve_conflicts, conn, resolve, fresh,
                                            current)
        fault_point('vote.resolved')
        if resolved or not early:
            self._upload(conn, new_rows)
        fault_point('vote.uploaded')
        if self.restoring:
            # restore() copies history verbatim: whatever is current now is
            # simply the previous revision of what we write.
            adapter.fix_prev_tids(conn)
        if self.btxn:
            conn.temp_dirty = True
            self.blobs.vote(adapter, conn, self.btxn, tstore)
        if read_current:
            self._lost_if_raises(self._check_read_current, conn, read_current, current)
        check = self.read_mark is not None and not self.restoring and len(tstore) > 0
        exact = ((self.from_history or bool(self.undone_tids))
                 and not self.restoring and len(tstore) > 0)
        refs = None
        if exact or check and self.cache is not None and \
                self.cache.newest_pack_mark() != self.read_mark:
            # A batch is known to have committed since our snapshot (another
            # instance of the process saw it): the references are read now,
            # not under the commit lock.
            refs = self._stored_references()
        self.tid, mark = adapter.advance_tid(conn, u64(newTid(None)), self.requested_tid)
        if self.tid >= MAX_TID:
            # (A helper agent's check: after a copied transaction of tid
            # 2**63-2, a commit took the tid that stands for "no limit" in
            # the queries, and every commit after it failed with the
            # driver's overflow error.  Its advice to copy with zodbconvert
            # failed too: a copy keeps the tids.)  Rolled back by the abort.
            tid, self.tid = self.tid, None
            raise POSException.StorageError(
                "%s cannot commit: its transaction ids are used up (the last one "
                "committed is %016x, the largest there can be %016x). Its objects can "
                "still be read. To write again, they must go into a new database under "
                "new transaction ids, which zodbconvert cannot do (it keeps them): "
                "ZODB's export and import can (Connection.exportFile of the root, "
                "oid 0, once; importFile of that in a connection to the new database, "
                "and the imported mapping's items put in its root)"
                % (adapter.describe(), tid - 1, MAX_TID - 1))
        fault_point('vote.commit_locked')
        if self.requested_tid is not None:
            # A copy's transaction (restore, with its tid: ZODB's
            # copyTransactionsFromTo, as zc.zlibstorage's copyTransactionsFrom
            # and a ZEO client's copy make it), whose end nothing announces:
            # while no other transaction has committed after it, a pack with
            # garbage collection takes the copy for unfinished (a review
            # finding: such a copy cut short, then a pack, lost objects it
            # had not linked yet).  Same transaction: the mark is there if,
            # and only if, what it marks is.
            adapter.note_copied_tid(conn, self.tid)
        if self.undone_tids:
            self._check_not_packed(conn)
        if exact or check and mark != self.read_mark:
            self._check_not_removed(conn, mark, refs, exact)
        user, description, extension, status = self.meta
        in_temp = len(tstore) - len(new_rows)
        try:
            adapter.move_into_place(conn, self.tid, in_temp > 0, user, description,
                                    extension, packed=(status == 'p'),
                                    all_new=self.new_count - len(new_rows) == in_temp,
                                    some_new=self.new_count > len(new_rows),
                                    new_rows=new_rows)
        except NewObjectExistsError as exc:
            if self.new_count > len(fresh):
                # An object created under an OID this process did not hand
                # out: another transaction may have created it since the
                # conflict check (a missing row cannot be locked).  Its
                # retry finds the row and conflicts as usual.
                raise POSException.ConflictError(
                    "Another transaction created an object this one creates too "
                    "(%s)" % exc) from exc
            raise
        if self.btxn is not None:
            self.blobs.finish(adapter, conn, self.btxn, self.tid, has_data=in_temp > 0)
        if self.undone and not adapter.keep_history:
            # As in _vote_copied: a history-free database has no revision
            # to say that an object stopped existing (a restored record
            # without a state: an undone creation), so the object goes;
            # copies through restore() (zodbconvert's transactions holding
            # blobs, copyTransactionsFrom) and through batches then give
            # the same database.  No poll would see the rows go: the pack
            # mark tells other processes that objects may be gone.
            adapter.pack_delete(conn, sorted(self.undone), [], self.tid)
            adapter.bump_pack_mark(conn)
        if self.unallocated_max >= 0:
            # Only objects created under OIDs this process did not hand out
            # (copies, restores): an object that exists was created under an
            # OID the counter handed out, or by a copy that moved it past.
            # (A helper agent's check: every process's first commit, even
            # of changes only, read the counter, which on PostgreSQL needs
            # SELECT on zoid_seq where USAGE is what allocating needs.)
            adapter.note_oids_used(self.unallocated_max)
        if writes_data:
            # Where the COMMIT still writes pages (SQLite), a disk that
            # cannot take them fails the vote, not the finish (after the
            # other databases of the transaction voted).
            nbytes = tstore.nbytes
            if blobs and self.btxn:
                nbytes += sum(os.path.getsize(path) for path in self.btxn.pending.values())
            adapter.check_commit_room(conn, len(tstore), nbytes)
        fault_point('vote.moved')

    def _check_not_packed(self, conn):
        """Under the commit lock: none of the transactions this one undoes
        was packed since the undo read them.  A pack's deletion marks the
        transactions up to its pack time packed before its first batch
        (PackVerbs.mark_packed), and a batch may then remove the revisions
        the undo copies on the database side (a blob's chunks: a review
        finding, the undo committed a blob without data)."""
        for tid in sorted(self.undone_tids):
            if self.adapter.transaction_packed(conn, tid):
                raise POSException.UndoError(
                    "Transaction %016x was packed away (by a pack that ran while "
                    "this undo was under way)" % tid)

    def _check_not_removed(self, conn, mark, refs=None, exact=False):
        """The pack mark moved since the snapshot this transaction began
        reading from (``read_mark``): pack batches committed since.  Refuse
        to store a reference to an object one of them removed, or a state
        of one: the object is gone, and the reference would dangle.  An
        application can hold such an object (garbage when the pack
        analysed the database) from a state it read before the batch, and
        link it again: a pack re-checks the commits made before each of
        its batches commits (pack._touched), and a commit made after one
        is checked here.  Under the commit lock: a batch moves the mark on
        and lists what it removed under that lock (pack._Batch.log), so
        none commits between this check and ours.  Costs nothing unless a
        batch committed during the transaction.  ``refs``: what
        _stored_references returned before the lock, or None.

        ``exact``: the transaction stores states read from history (an
        undo, loadSerial, loadBefore), which may reference what a pack
        removed before it began (a helper agent's check: an undo
        committed during a pack's deletion restored a reference to an
        object its first batch had removed): the database says whether
        what they reference exists (a query, for these rare
        transactions only)."""
        adapter, cache = self.adapter, self.cache
        after = self.read_mark

        def read(after, upto):
            return adapter.pack_removals(conn, after, upto)
        if exact or mark < after:
            lists = None
        elif cache is not None:
            lists = cache.pack_removals(after, mark, read)
        else:
            lists = read(after, mark)
        if lists is not None:
            removed = set(lists.garbage_ints())
            if not removed:
                return
        if refs is None:
            refs = self._stored_references()
        if lists is None:
            # The list of some mark since is gone (zap_all, the start of a
            # later pack's deletion, which empties the lists of the one
            # before; a history-free restore of undone creations): ask the
            # database whether what we reference still exists, exactly.
            # (A review finding: refusing such commits outright refused
            # them forever where the transaction's mark could not move.)
            # (Objects we change too: a review finding, their rows written
            # again brought a removed object back.  Not those we create.)
            new = {oid for oid, prev_tid in self.tstore.prev_tids() if not prev_tid}
            wanted = sorted(({ref for _, found in refs for ref in found}
                             | {oid for oid, _ in refs}) - new)
            if not wanted:
                return
            removed = set(wanted) - set(adapter.current_tids(conn, wanted))
            if not removed:
                return
        for oid, found in refs:
            if oid in removed:
                gone = oid
            else:
                gone = next((ref for ref in found if ref in removed), None)
            if gone is not None:
                raise POSException.ConflictError(
                    oid=p64(oid),
                    message="object 0x%x was removed by a pack (garbage when the pack "
                            "analysed %s)%s; this transaction %s it.  A retry reads "
                            "the current states."
                            % (gone, adapter.describe(),
                               ' (this transaction read from history: an undo, '
                               'loadSerial or loadBefore)' if exact
                               else ' after this transaction began',
                               'changes' if gone == oid else 'stores a reference to'))

    def _stored_references(self):
        """[(oid, the OIDs its stored state references)] of every object
        this transaction stores."""
        from .pack import stored_references
        result = []
        rows = self.tstore.rows()
        while True:
            group = list(itertools.islice(rows, 1000))
            if not group:
                return result
            states = [state for _, _, state in group]
            if self.untransform is not None:
                # (A helper agent's check: compressed by <zlibstorage>, they
                # read as no references at all.)
                states = [state if state is None else self.untransform(state)
                          for state in states]
            result.extend(zip([oid for oid, _, _ in group], stored_references(states)))

    def _lost_if_raises(self, check, *args):
        """Run a conflict check and return what it returns; a
        ConflictError from it means this transaction lost to another
        committer (see "Fairness")."""
        try:
            return check(*args)
        except POSException.ConflictError:
            self.lost = True
            raise

    def _upload(self, conn, new_rows):
        """Empty temp_store, then put there the states of every object
        stored but those of ``new_rows`` (which go straight into place)."""
        adapter, tstore = self.adapter, self.tstore
        # (Whatever the connection believes, when rows go up: see
        # _clear_temp.)
        self._clear_temp(conn, force=len(tstore) > len(new_rows) or bool(self.btxn))
        if len(tstore) > len(new_rows):
            conn.temp_dirty = True
            rows, nbytes = tstore.rows(), tstore.nbytes
            if new_rows:
                direct = {oid for oid, _ in new_rows}
                rows = (row for row in rows if row[0] not in direct)
                nbytes -= sum(len(state) for _, state in new_rows)
            adapter.upload(conn, rows)
            adapter.note_temp_rows(conn, len(tstore) - len(new_rows), nbytes)

    def _clear_temp(self, conn, force=False):
        """Empty the temporary tables if they may hold rows (``force``:
        whatever ``conn.temp_dirty`` says).  A pooler that hands one
        server session to several clients (pgbouncer without
        ``server_reset_query``, or in transaction mode) gave a commit a
        temp_store holding another client's rows, which it moved into place
        with its own (a helper agent's check: a committed change reverted):
        rows go up only into tables emptied in the same transaction."""
        if conn.temp_dirty or force:
            self.adapter.clear_temp(conn)
            if self.blobs is not None and self.blobs.in_database:
                self.adapter.clear_temp_blobs(conn)
            conn.temp_dirty = False

    def _claim_fresh(self):
        """The stored OIDs that this process's new_oid handed out and that
        are stored as new: no other transaction can have their rows, so
        they need no row lock and no conflict check.  Claimed at the first
        vote (a vote retried on a new connection keeps them)."""
        if self.fresh is None:
            if self.restoring:
                self.fresh = frozenset()
                self.unallocated_max = self.tstore.max_oid
            else:
                new = [oid for oid, prev_tid in self.tstore.prev_tids() if not prev_tid]
                self.new_count = len(new)
                # (Nothing to claim, such as an empty commit: no lock taken.)
                self.fresh = self.adapter.claim_fresh_oids(new) if new else frozenset()
                self.unallocated_max = max((oid for oid in new if oid not in self.fresh),
                                           default=-1)
        return self.fresh

    def _new_rows(self, fresh):
        """(oid, state) of the fresh objects to insert without temp_store,
        in OID order: all of them when their states total at most
        ``adapter.new_rows_direct_bytes``, else none.  (The deletion of an
        object created in the same transaction goes through temp_store.)"""
        limit = self.adapter.new_rows_direct_bytes
        if not fresh or not limit:
            return []
        tstore = self.tstore
        rows = []
        size = 0
        for oid in sorted(fresh):
            state = tstore.read(oid)
            if state is None:
                continue
            size += len(state)
            if size > limit:
                return []
            rows.append((oid, state))
        return rows

    def _resolve_conflicts(self, conn, resolve, fresh, current):
        """Resolve the conflicts of the objects stored; returns whether
        there were any (their states in tstore are then the merged ones)."""
        adapter, tstore = self.adapter, self.tstore
        conflicts = adapter.detect_conflicts(
            conn, [row for row in tstore.prev_tids() if row[0] not in fresh], current)
        if not conflicts:
            return False
        for oid, committed_tid, prev_tid in conflicts:
            if prev_tid == 0 or tstore.is_deletion(oid):
                # Deleting a changed object, or creating one that exists:
                # nothing to merge.
                raise POSException.ConflictError(
                    oid=p64(oid), serials=(p64(committed_tid), p64(prev_tid)),
                    data=tstore.read(oid))
        # The rows are locked: what is current now stays current.  One
        # query for every committed state; the results replace ours in
        # tstore, before anything is uploaded.
        committed = adapter.load_current_many(conn, [oid for oid, _, _ in conflicts])
        for oid, committed_tid, prev_tid in conflicts:
            committed_state = committed.get(oid, (None, None))[0]
            if committed_state is None:
                raise POSException.ConflictError(
                    oid=p64(oid), serials=(p64(committed_tid), p64(prev_tid)))
            resolved = resolve(p64(oid), p64(committed_tid), p64(prev_tid),
                               tstore.read(oid), committed_state)
            if len(resolved) > self.max_state_bytes:
                self._refuse_size(oid, resolved)
            tstore.store(oid, committed_tid, resolved)
            self.resolved.add(oid)
        return True

    def _read_current_only(self):
        """{oid: tid} of the objects read with readCurrent and not stored
        (a stored object's check is its conflict check).  Whichever is
        smaller is walked in Python: often thousands of objects read and
        a few stored, or the other way round."""
        read_current, tstore = self.read_current, self.tstore
        if len(tstore) < len(read_current):
            read_current = dict(read_current)
            for oid in tstore.oids():
                read_current.pop(oid, None)
            return read_current
        return {oid: tid for oid, tid in read_current.items() if oid not in tstore}

    def _check_read_current(self, conn, read_current, current):
        if current is None:
            current = self.adapter.current_tids(conn, list(read_current))
        # (All still current, the usual answer, in one subset test.)
        if read_current.items() <= current.items():
            return
        changed = [oid for oid, expected in read_current.items()
                   if current.get(oid, 0) != expected]
        if changed:
            oid = min(changed)
            raise POSException.ReadConflictError(
                oid=p64(oid), serials=(p64(current.get(oid, 0)), p64(read_current[oid])))

    def _vote_copied(self, conn):
        """Vote for a batch of copied transactions: the same locks in the
        same order as a commit, then each transaction moved into place
        under its own tid through ``temp_store``."""
        adapter = self.adapter
        copied = self.copied
        adapter.begin_store_checked(conn)
        oids = sorted({oid for c in copied for oid, _ in c.rows})
        if oids:
            adapter.lock_objects_checked(conn, oids, [])
        fault_point('vote.locked')
        adapter.advance_tid(conn, None, copied[0].tid)  # (copies: no pack check)
        fault_point('vote.commit_locked')
        keep_history = adapter.keep_history
        removed_any = False
        for c in copied:
            if keep_history:
                rows = [(oid, 0, state) for oid, state in c.rows]
                deleted = ()
            else:
                # A history-free database has no revision to say that an
                # object stopped existing (an undone creation): the object
                # goes, as it would from a copy of the current records, so
                # both ways of filling it give the same database.
                rows = [(oid, 0, state) for oid, state in c.rows if state is not None]
                deleted = [oid for oid, state in c.rows if state is None]
            conn.temp_dirty = True
            adapter.clear_temp(conn)
            if rows:
                adapter.upload(conn, rows)
                adapter.note_temp_rows(conn, len(rows), sum(len(state or b'') for _, _, state in rows))
                if keep_history:
                    adapter.fix_prev_tids(conn)
            adapter.move_into_place(conn, c.tid, bool(rows), c.user, c.description,
                                    c.extension, packed=c.packed)
            if deleted:
                adapter.pack_delete(conn, deleted, [], c.tid)
                removed_any = True
        if removed_any:
            # No poll would see the rows go: the pack mark tells other
            # processes that objects may be gone.
            adapter.bump_pack_mark(conn)
        self.tid = copied[-1].tid
        if len(copied) > 1:
            adapter.set_last_tid(conn, self.tid)
        if oids:
            adapter.note_oids_used(oids[-1])
        fault_point('vote.moved')

    # ------------------------------------------------------------------
    # Finish and abort

    def finish(self):
        """COMMIT and publish; return the tid (an int).

        Only the COMMIT can fail here (a lost connection, or the server's
        refusal): the error then says whether the transaction was
        committed (CommitFailedError, CommitUnknownError); what follows it
        cannot fail."""
        conn = self.conn
        fault_point('finish.before_commit')
        try:
            conn.commit()
        except DisconnectedError as exc:
            conn.rollback()
            self._lost_commit(exc)
        except Exception as exc:  # pylint:disable=broad-except
            # The server answered the COMMIT with an error (a helper
            # agent's checks: MySQL's KILL QUERY, "Query execution was
            # interrupted"; SQLite's disk filled by another program since
            # the vote): said as CommitFailedError, or CommitUnknownError,
            # as for a lost link, not the driver's bare error.
            conn.rollback()
            self._lost_commit(exc, lost=False)
        except BaseException:
            # Interrupted (Ctrl-C, gevent.Timeout) in the COMMIT: the
            # server may have committed, so the placed blob files stay (a
            # helper agent's check: a committed blob's file was removed),
            # and the session, in a state nobody knows, is not used again.
            self.commit_sent = True
            conn.broken = True
            conn.rollback()
            raise
        self.committed = True
        fault_point('finish.committed')
        if self.btxn is not None:
            self.blobs.committed(self.btxn, self.tid)
        if not self.copied:
            self.cache.committed(self.tid, ((oid, state)
                                            for oid, _, state in self.tstore.rows()))
        fault_point('finish.published')
        return self.tid

    def _lost_commit(self, exc, lost=True):
        """The link went during COMMIT (``lost``), or the server refused
        it: find out whether the server committed.  Returns when it did;
        raises CommitFailedError when it did not, CommitUnknownError when
        that cannot be told.  Neither is retryable (see
        CommitFailedError)."""
        what = ('Lost the connection to %s while committing' if lost
                else '%s answered an error to the COMMIT of') % self.adapter.describe()
        outcome = None
        delay = OUTCOME_FIRST_DELAY
        deadline = time.monotonic() + OUTCOME_PATIENCE
        while True:
            try:
                outcome = self.adapter.commit_outcome(self.tid, len(self.tstore) > 0
                                                      or bool(self.copied))
                break
            except DisconnectedError:
                # A server restarting refuses connections for a moment;
                # an answer then spares an unknown outcome (and, with
                # other databases in the transaction, a split).
                if time.monotonic() + delay > deadline:
                    log.warning("Could not find out whether transaction %016x was "
                                "committed", self.tid, exc_info=True)
                    break
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except Exception:  # pylint:disable=broad-except
                log.warning("Could not find out whether transaction %016x was committed",
                            self.tid, exc_info=True)
                break
        if outcome:
            log.warning("%s transaction %016x, which the server did commit (%s).",
                        what, self.tid, _one_line(exc))
            return
        if outcome is False:
            if self.btxn is not None:
                self.btxn.unplace()
            raise CommitFailedError(
                "%s transaction %016x, which was not committed (%s)"
                % (what, self.tid, _one_line(exc))) from exc
        # The server may have committed before the link went: leave placed
        # blob files alone (an orphan file is harmless; a committed row
        # without its file is not).
        raise CommitUnknownError(
            "%s transaction %016x: it may or may not have been committed (%s)"
            % (what, self.tid, _one_line(exc))) from exc

    def abort(self):
        """Roll back whatever vote did (unless it kept its row locks for
        the retry); never raises for a dead link."""
        if self.conn is not None and not self.conn.holding_locks:
            self._rollback()

    def _hold_locks(self):
        """After a conflict found under our row locks: keep the store
        transaction open for the retry (see "Fairness" above).  False when
        it must be rolled back instead."""
        seconds = self.adapter.lock_hold_seconds()
        if not (self.locked and seconds and self.tid is None and self.conn.in_transaction):
            return False
        try:
            self.adapter.hold_locks(self.conn, seconds)
        except Exception:  # pylint:disable=broad-except
            log.debug("Could not keep the row locks after a conflict", exc_info=True)
            return False
        self.conn.holding_locks = True
        if self.btxn is not None:
            self.btxn.unplace()
        return True

    def _rollback(self):
        self.conn.rollback()
        if self.btxn is not None and not self.commit_sent:
            self.btxn.unplace()

    def close(self):
        """Release the buffers (temporary files) of this commit."""
        self.tstore.close()
        if self.btxn is not None:
            self.btxn.discard()
