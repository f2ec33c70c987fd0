"""History, undo and iteration: the read side of the transaction log."""
import base64
import binascii
import logging
import math
import pickle
import threading
import time
import weakref

from persistent.TimeStamp import TimeStamp
from ZODB import POSException
from ZODB.BaseStorage import DataRecord
from ZODB.BaseStorage import TransactionRecord
from ZODB.blob import is_blob_record
from ZODB.utils import p64
from ZODB.utils import u64

#: The largest tid (and row count) the databases' signed 64-bit columns
#: hold: a larger one given to the storage names nothing that exists.
MAX_TID = 2 ** 63 - 1
#: The largest OID a database holds (its columns are signed 64-bit).
MAX_OID = 2 ** 63 - 1


def beyond_range(oid_int, tid_int=0):
    """Whether an OID (and tid) is past what any database holds: no such
    object, rather than the driver's error for a value its column cannot
    take (OverflowError, NumericValueOutOfRange: a helper agent's check)."""
    return oid_int > MAX_OID or tid_int > MAX_TID

log = logging.getLogger(__name__)


def dump_extension(ext):
    return pickle.dumps(ext, 3) if ext else b''


def load_extension(data):
    if not data:
        return {}
    try:
        return pickle.loads(bytes(data))
    except Exception:  # pylint:disable=broad-except
        # Extension data written by foreign tools: show it, don't fail.
        log.warning("Unreadable transaction extension data (%d bytes)", len(data))
        return {}


def _b(value):
    return bytes(value) if value is not None else b''


def tid_time(tid_int):
    return TimeStamp(p64(tid_int)).timeTime()


def undo_id(tid_int):
    """The id of a transaction in undoLog/undoInfo: the tid in base64, as
    FileStorage and earlier releases give it (applications put it in
    forms and URLs as text)."""
    return base64.encodebytes(p64(tid_int)).rstrip(b'\n')


def undo_tid(transaction_id):
    """The tid (int) that an undo id names: undo_id's form (bytes or
    text), or the 8-byte tid itself."""
    if isinstance(transaction_id, str):
        transaction_id = transaction_id.encode('ascii', 'replace')
    if isinstance(transaction_id, bytes) and len(transaction_id) == 8:
        return _undoable(u64(transaction_id))
    try:
        tid = base64.decodebytes(transaction_id + b'\n')
    except (TypeError, binascii.Error):
        tid = None
    if tid is None or len(tid) != 8:
        raise POSException.UndoError("Invalid transaction id %r" % (transaction_id,))
    return _undoable(u64(tid))


def _undoable(tid):
    if tid > MAX_TID:
        raise POSException.UndoError("No transaction %016x to undo" % tid)
    return tid


def _transaction_entry(tid_int, user, description, ext, **fields):
    """A transaction as history() and undoLog() describe it: the keys of
    its extension, then its time, user, description and ``fields``."""
    entry = {}
    entry.update(load_extension(ext))
    entry.update(time=tid_time(tid_int), user_name=_b(user), description=_b(description),
                 **fields)
    return entry


def _count_bound(value):
    """The whole number of entries FileStorage's ``count < value`` lets
    through: ``value`` rounded up, at most MAX_TID (infinity and NaN
    included), at least 0."""
    if value != value or value >= MAX_TID:
        return MAX_TID
    if value <= 0:
        return 0
    return math.ceil(value)


def object_history(adapter, conn, oid, size):
    if size is None:
        size = 1
    # (Asked for one at least: an object that does not exist raises
    # POSKeyError whatever the size, as FileStorage does.)  As many
    # entries as FileStorage gives, which adds one while it has fewer
    # than ``size``: a fraction rounds up; infinity, and NaN, which no
    # count reaches, are all of them (a helper agent's check: 1.5 gave
    # one entry, infinity and NaN failed).
    wanted = _count_bound(size)
    rows = adapter.history(conn, u64(oid), max(wanted, 1))
    if not rows:
        raise POSException.POSKeyError(oid)
    if wanted < 1:
        return []
    result = []
    for tid, state_size, user, description, ext in rows:
        result.append(_transaction_entry(tid, user, description, ext, tid=p64(tid),
                                         serial=p64(tid), size=state_size, version=''))
    return result


def revision_before(adapter, conn, oid, tid):
    """(state, start, end) of the revision of ``oid`` current just before
    ``tid`` (ints), as ``loadBefore`` answers: None when the object has
    revisions but none before ``tid``; POSKeyError when it has none, or
    when the revision then says it did not exist (creation undone, or
    deleted by external GC)."""
    oid_int = u64(oid)
    result = adapter.load_before(conn, oid_int, tid)
    if result is None:
        if adapter.load_current(conn, oid_int) is None:
            raise POSException.POSKeyError(oid)
        return None
    if result[0] is None:
        raise POSException.POSKeyError(oid)
    return result


#: The most transactions undo_log reads in one statement.
UNDO_PAGE_MAX = 10000


def undo_log(adapter, conn, snapshot_tid, first, last, filter):
    # As FileStorage counts: the entries (that pass the filter) numbered
    # from 0, those from ``first`` and before ``last``; a negative
    # ``last`` is a count from ``first``.  (A helper agent's check: a
    # negative ``first`` gave more entries than asked for, and a float
    # one failed inside MySQL's and SQLite's drivers.)
    if last < 0:
        last = first - last
    if first != first:
        return []   # (NaN: FileStorage's "from first" never holds; "before last" always)
    first = max(0, _count_bound(first))
    wanted = _count_bound(last) - first
    result = []
    if wanted <= 0:
        return result
    skipped = 0
    upto = snapshot_tid
    # Pages of the log: without a filter, the rows needed at once; with
    # one, larger pages until enough entries pass it.
    page = min(UNDO_PAGE_MAX, max(1, first + wanted) * (1 if filter is None else 2))
    while len(result) < wanted:
        rows = adapter.undo_log(conn, upto, page)
        for tid, user, description, ext in rows:
            entry = _transaction_entry(tid, user, description, ext, id=undo_id(tid))
            if filter is not None and not filter(entry):
                continue
            if skipped < first:
                skipped += 1
                continue
            result.append(entry)
            if len(result) >= wanted:
                break
        if len(rows) < page:
            break
        upto = rows[-1][0] - 1
        page = min(UNDO_PAGE_MAX, page * 2)
    return result


#: Objects whose states an undo reads in one query: the first chunk, and
#: the most (fewer while the states are large: UNDO_CHUNK_BYTES).
UNDO_CHUNK_FIRST = 100
UNDO_CHUNK_MAX = 2000
UNDO_CHUNK_BYTES = 16 << 20


def _undo_chunks(adapter, conn, tid, sources):
    """(oid, prev_tid, current_tid, states) for ``sources`` (the
    undo_sources rows, in OID order), the states (adapter.undo_states)
    read a chunk of objects at a time."""
    count = UNDO_CHUNK_FIRST
    i = 0
    while i < len(sources):
        chunk = sources[i:i + count]
        i += len(chunk)
        states = adapter.undo_states(conn, tid, [oid for oid, _, _ in chunk])
        size = 0
        for oid, prev_tid, current_tid in chunk:
            found_states = states[oid]
            size += sum(len(v) for v in found_states[1:] if v is not None)
            yield oid, prev_tid, current_tid, found_states
        count = max(1, count // 4) if size > UNDO_CHUNK_BYTES else min(UNDO_CHUNK_MAX, count * 4)


def undo(adapter, conn, tid, pending, resolve):
    """Queue in ``pending`` (a commit.Commit) the records that undo
    transaction ``tid``; return their OIDs.  ``resolve`` is ZODB's
    tryToResolveConflict."""
    packed = adapter.transaction_packed(conn, tid)
    if packed is None:
        raise POSException.UndoError("No transaction %016x to undo" % tid)
    if packed:
        raise POSException.UndoError("Transaction %016x was packed away" % tid)
    oids = []
    tstore = pending.tstore
    sources = list(adapter.undo_sources(conn, tid))
    for oid, prev_tid, current_tid, states in _undo_chunks(adapter, conn, tid, sources):
        found, before_state, stored_current, undone_state = states
        if prev_tid:
            if not found:
                raise POSException.UndoError(
                    "The state before the transaction was packed away", p64(oid))
        else:
            before_state = None          # undoing the creation
        if oid in tstore:
            # An earlier undo in this same transaction already changed the
            # object: that pending state is what we undo against.
            current_state = tstore.read(oid)
            record_prev = tstore.prev_tid(oid)
            changed = True
            if current_tid == tid:
                # (The query only reads the undone state of an object
                # changed since.)
                undone_state = adapter.load_revision(conn, oid, tid)[1]
        else:
            current_state = stored_current
            record_prev = current_tid
            changed = current_tid != tid
        if changed:
            # Changed since: fine if the object is back in the state the
            # undone transaction gave it, or if the change is mergeable.
            if current_state != undone_state:
                if before_state is None or current_state is None:
                    raise POSException.UndoError(
                        "Some data were modified by a later transaction", p64(oid))
                try:
                    before_state = resolve(
                        p64(oid), p64(current_tid), p64(tid), before_state, current_state)
                except POSException.ConflictError:
                    raise POSException.UndoError(
                        "Some data were modified by a later transaction", p64(oid))
        pending.store(oid, record_prev, before_state)
        if pending.btxn is not None and prev_tid and is_blob_record(before_state):
            pending.btxn.copy(oid, prev_tid)
        oids.append(oid)
    return oids


def record_iternext(adapter, conn, next_oid, ahead=None):
    """IStorageCurrentRecordIteration.record_iternext from ``next_oid``,
    with the records read ahead for the calls that follow (RecordsAhead,
    or None): (the record tuple, what is ahead)."""
    start = u64(next_oid) if next_oid is not None else 0
    count = ahead.next_count() if ahead is not None and ahead.start == start else 1
    if start > MAX_TID:
        raise POSException.POSKeyError(next_oid)
    if count > 1:
        # The sizes first: as many records as fit the budget (at least the
        # one asked for; a helper agent's check: after a run of small
        # records, a read of 500 records of 4 MB each added 645 MB to the
        # process on MariaDB).  (Rows without a state count as records
        # of no size: the read then goes a little further.)
        sizes = adapter.record_sizes(conn, start, count)
        read = 1
        total = (sizes[0][1] or 0) if sizes else 0
        while read < len(sizes) and total + (sizes[read][1] or 0) <= RecordsAhead.MAX_BYTES:
            total += sizes[read][1] or 0
            read += 1
        count = read
    # (One more: the last row only names the OID after those returned.)
    rows = adapter.record_iternext(conn, start, count + 1)
    if not rows:
        raise POSException.POSKeyError(next_oid if next_oid is not None else p64(0))
    oid, tid, state = rows[0]
    following = p64(rows[1][0]) if len(rows) > 1 else None
    ahead = RecordsAhead(list(rows[1:]), count) if len(rows) > 1 else None
    return (p64(oid), p64(tid), bytes(state), following), ahead


class RecordsAhead:
    """Records read ahead by record_iternext: zodbupdate, zodbverify and
    zodbconvert call it once per object, and a query per call (a snapshot
    begun and ended around it, on the storage made from the
    configuration) made a helper agent's zodbupdate of 58,700 records take
    38 s on PostgreSQL, 1.6 s with RelStorage 4.3.  Served for at most
    ``MAX_AGE`` seconds (as current as a caller of record_iternext, whose
    next call may come any time later, can ask), and only to a call that
    goes on from the last (``start``); each read reads more, up to
    ``MAX_COUNT`` records and ``MAX_BYTES`` of states (or the one record
    asked for, whatever its size)."""

    MAX_AGE = 1.0
    MAX_COUNT = 500
    MAX_BYTES = 4 << 20

    def __init__(self, rows, count):
        # rows: the records after the one returned; the last only names
        # the OID that follows the one before it.
        self.rows = rows
        self.count = count
        self.size = sum(len(row[2]) for row in rows if row[2] is not None)
        self.until = time.monotonic() + self.MAX_AGE
        self.start = rows[0][0]
        #: The storage's count of this process's changes when read.
        self.changes = None

    def take(self, start):
        """The record tuple for a call from OID ``start``, or None (then
        read it)."""
        rows = self.rows
        if start != self.start or len(rows) < 2 or time.monotonic() > self.until:
            return None
        oid, tid, state = rows.pop(0)
        self.start = rows[0][0]
        return p64(oid), p64(tid), bytes(state), p64(self.start)

    def next_count(self):
        """How many records the next read reads."""
        if self.size > self.MAX_BYTES:
            return max(1, self.count // 4)
        return min(self.MAX_COUNT, self.count * 4)


class IteratorSnapshots:
    """The snapshots of a storage's open transaction iterators.

    zodbconvert reads each blob (``loadBlob``) while it iterates, in a
    snapshot of the call's own: a pack that ran since may have removed
    that revision (history-preserving), or the object (history-free),
    and the copy failed with "No blob" where the iterator's snapshot still
    has the rows (a helper agent's check, copying while RelStorage 4.3's
    zodbpack ran).  ``read`` asks those snapshots too: only iterators of
    the calling thread (another thread's snapshot is of another moment),
    under the snapshot's lock (its transactions' records may be read from
    any thread).
    """

    def __init__(self):
        self._open = weakref.WeakSet()

    def add(self, iterator):
        self._open.add(iterator)
        return iterator

    def close(self):
        """End every open iterator's snapshot (the storage closes: a helper
        agent's check found the session of one left open after it, which
        kept the database from being dropped)."""
        for iterator in list(self._open):
            iterator.close()

    def read(self, func):
        """The first result of ``func(conn)`` that is not None, over the
        snapshots of the calling thread's open iterators, or None."""
        me = threading.get_ident()
        for iterator in list(self._open):
            snapshot = iterator.snapshot
            if snapshot is None or iterator.thread != me:
                continue
            with snapshot.lock:
                if snapshot.conn is not None:
                    result = func(snapshot.conn)
                    if result is not None:
                        return result
        return None


class _Snapshot:
    """An iterator's connection, in its snapshot, and the transactions it
    returned whose records are not read yet.

    Apart from the iterator, so that the transactions the caller keeps
    hold this, not the iterator (which closes the snapshot when it is
    collected), and so that a collection of the iterator in a reference
    cycle, which clears the weak references inside it before anything
    runs, leaves this one's intact (a review finding: the kept
    transactions' records were lost).  ``weakref.finalize`` keeps it
    until the iterator is gone, then closes it.
    """

    def __init__(self, adapter):
        self.adapter = adapter
        self.conn = None
        self.unread = weakref.WeakSet()
        # Records may be read from any thread (a transaction is handed on),
        # while the iterator reads its next page.
        self.lock = threading.RLock()

    def records(self, txn):
        """Read the records of ``txn`` into it, in the snapshot."""
        with self.lock:
            if txn._records is not None:
                return
            if self.conn is None:
                raise POSException.StorageError(
                    "The records of transaction %016x could not be read before its "
                    "iterator was closed" % u64(txn.tid))
            # data_txn stays None: every record carries its own state,
            # never a back pointer.
            txn._records = [
                DataRecord(p64(oid), txn.tid, _state(state), None)
                for oid, state, _ in self.adapter.records_in_transaction(
                    self.conn, u64(txn.tid))
            ]
            self.unread.discard(txn)

    def close(self):
        """Read the records of the transactions still held, then end the
        snapshot."""
        with self.lock:
            conn = self.conn
            if conn is None:
                return
            try:
                for txn in list(self.unread):
                    self.records(txn)
            finally:
                self.unread = weakref.WeakSet()
                self.conn = None
                conn.rollback()
                conn.close()


class TransactionIterator:
    """Iterates transactions in [start, stop] over one snapshot.

    The iterator reads on a load connection of its own, in one snapshot
    from its first ``next()`` until it is exhausted, closed or collected,
    so that concurrent commits (in a history-free database they move
    records between transactions) never show up half way through.  Nothing
    is opened before the first ``next()``, and nothing stays open after
    the last.

    The log is read a page at a time, and a transaction's records when
    the caller first iterates them: a caller that looks at the
    transactions only (their tids, users, descriptions) read every record
    of the database before, a query per transaction (6.5 s for 31,000
    transactions on PostgreSQL, where RelStorage 4.3 took 0.12 s).  The
    records of a transaction still held when the snapshot ends are read
    then, so that they are always those of the snapshot (see _Snapshot).
    """

    _txns = None
    _snapshot = None
    thread = None

    #: Pages of the log: the first small (a caller may want only the
    #: first transaction), then each four times the last, up to PAGE_MAX.
    PAGE_FIRST = 64
    PAGE_MAX = 4096

    @property
    def snapshot(self):
        """Its _Snapshot, once opened and until closed, else None."""
        snapshot = self._snapshot
        return snapshot if snapshot is not None and snapshot.conn is not None else None

    def __init__(self, adapter, start, stop):
        self._adapter = adapter
        # (Beyond MAX_TID: no transaction, rather than a driver's error.)
        self._start = min(u64(start), MAX_TID) if start is not None else 0
        self._stop = min(u64(stop), MAX_TID) if stop is not None else None
        self._page = self.PAGE_FIRST
        self._closer = None

    def __iter__(self):
        return self

    def _open(self):
        adapter = self._adapter
        self.thread = threading.get_ident()       # (see IteratorSnapshots)
        self._snapshot = snapshot = _Snapshot(adapter)
        self._txns = iter(())
        # (Not a method of self: the finalizer must not keep it alive.)
        self._closer = weakref.finalize(self, snapshot.close)
        try:
            snapshot.conn = conn = adapter.open_load()
            adapter.begin_snapshot(conn)
            last = adapter.get_last_tid(conn)
            self._stop = last if self._stop is None else min(self._stop, last)
        except BaseException:
            self.close()
            raise

    def _next_row(self):
        try:
            return next(self._txns)
        except StopIteration:
            pass
        if self._start > self._stop:
            raise StopIteration
        snapshot = self._snapshot
        with snapshot.lock:
            if snapshot.conn is None:
                raise StopIteration
            rows = self._adapter.transactions_in_range(
                snapshot.conn, self._start, self._stop, self._page)
        if len(rows) < self._page:
            self._start = self._stop + 1      # the end of the range is read
        else:
            self._start = rows[-1][0] + 1
            self._page = min(self.PAGE_MAX, self._page * 4)
        self._txns = iter(rows)
        return next(self._txns)

    def __next__(self):
        if self._txns is None:
            self._open()
        try:
            tid, user, description, ext, packed = self._next_row()
        except StopIteration:
            self.close()
            raise
        snapshot = self._snapshot
        txn = _Transaction(p64(tid), 'p' if packed else ' ', _b(user), _b(description),
                           _b(ext), snapshot)
        snapshot.unread.add(txn)
        return txn

    next = __next__

    def close(self):
        self._txns = iter(())
        self._start, self._stop = 1, 0
        if self._closer is not None:
            self._closer()


def _state(state):
    return bytes(state) if state is not None else None


class _Transaction(TransactionRecord):

    _records = None

    def __init__(self, tid, status, user, description, extension, snapshot):
        TransactionRecord.__init__(self, tid, status, user, description, extension)
        # (Not the iterator: a transaction kept by the caller must not
        # keep its snapshot open, see _Snapshot.)
        self._snapshot = snapshot

    def read_records(self):
        if self._records is None:
            self._snapshot.records(self)
        return self._records

    def __iter__(self):
        return iter(self.read_records())
