"""Copying the contents of one ZODB storage into another, fast.

This is the engine behind ``zodbconvert`` and ``RelStorage.copyTransactionsFrom``.
It is built from two halves that meet in a stream of ``Txn`` objects:

readers (the source side, any ZODB storage)
  ``history_txns``  every transaction after a tid, from ``IStorageIteration``
                    (back pointers resolved, so each record carries its state);
  ``current_txns``  only the current record of each object, grouped by tid
                    and ordered by tid (the history-free fast path), from
                    ``IStorageCurrentRecordIteration``.

writers (the destination side)
  ``StorageWriter``    any storage, one ``tpc_begin(tid=...)``/``restore``/
                       ``restoreBlob`` transaction per source transaction
                       (what ZODB's own copy does);
  ``RelStorageWriter`` a RelStorage: many source transactions per database
                       transaction, uploaded in bulk with the adapter's verbs;
                       a transaction holding a blob goes through
                       ``StorageWriter`` (``restoreBlob``);
  ``NullWriter``       a dry run: reads everything (blobs included), writes
                       nothing.

Every transaction keeps its source tid, so the destination's
``lastTransaction()`` always names the last source transaction copied in
full, whatever interrupted the copy.  Readers emit transactions in tid order
(the history-free fast path too), so "copy everything after the
destination's last transaction" is a correct way to resume, for both history
modes: what a history-free destination misses is exactly the objects whose
current tid is later.

Blobs travel through ZODB's ``IBlobStorage`` API: ``loadBlob`` on the source,
``restoreBlob`` on the destination.  A blob record whose file cannot be read
is an error, never skipped.

Into an empty history-free RelStorage either reader will do; ``choose_strategy``
picks one from a cheap estimate of the source's records per object
(``estimate_history``) and thresholds measured per kind of source and
destination (``Adapter.copy_fast_path_thresholds``).

``verify_history`` and ``verify_current`` re-read both sides and raise
``VerifyError`` naming the first differences (up to ``MAX_DIFFERENCES``).
"""
import collections
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from array import array

from ZODB.blob import is_blob_record
from ZODB.interfaces import IBlobStorage
from ZODB.interfaces import IBlobStorageRestoreable
from ZODB.Connection import TransactionMetaData
from ZODB import POSException
from ZODB.POSException import POSKeyError
from ZODB.serialize import referencesf
from ZODB.utils import oid_repr
from ZODB.utils import p64
from ZODB.utils import tid_repr
from ZODB.utils import u64
from ZODB.utils import z64

from ..blobs.common import PENDING_PREFIX
from ..messages import one_line as _one_line
from .commit import CopiedTransaction
from .history import MAX_TID

log = logging.getLogger(__name__)

MB = 1024 * 1024

#: A RelStorageWriter commits when its batch holds this much state data ...
BATCH_BYTES = 16 * MB
#: ... or this many records ...
BATCH_RECORDS = 20000
#: ... or when its oldest pending transaction waited this long (seconds) ...
BATCH_SECONDS = 5.0
#: ... or when one object has this many records in it: each is an update of
#: the same row in one database transaction, and PostgreSQL walks the
#: row's versions made by that transaction at each (a FileStorage of 5,000
#: transactions all changing one counter took 17 s to copy, where 5,000
#: transactions of distinct objects took 7 s).
BATCH_REPEATS = 64


class CopyError(Exception):
    """The copy cannot go on; the message says why and what to do."""


class VerifyError(Exception):
    """Source and destination differ; the message names the first difference."""


class Txn:
    """One transaction on its way from a reader to a writer.

    ``records`` holds ``(oid, data, data_txn)``: ``oid`` 8 bytes, ``data`` the
    state (None: the object does not exist at this revision), ``data_txn``
    the tid of the transaction whose state this record repeats (undo), or None.
    """

    __slots__ = ('tid', 'status', 'user', 'description', 'extension', 'records')

    def __init__(self, tid, status, user, description, extension, records):
        self.tid = tid
        self.status = status
        self.user = user
        self.description = description
        self.extension = extension       # bytes (the pickled extension dict)
        self.records = records

    def metadata(self):
        return TransactionMetaData(self.user, self.description, self.extension)


class Stats:
    """What was copied (or checked), for progress lines and the summary."""

    def __init__(self):
        self.started = time.time()
        self.transactions = 0
        self.records = 0
        self.bytes = 0
        self.blobs = 0
        self.blob_bytes = 0
        self.last_tid = None
        self.renumbered = 0

    @property
    def elapsed(self):
        return max(time.time() - self.started, 1e-6)

    def add_txn(self, txn):
        self.transactions += 1
        self.records += len(txn.records)
        self.bytes += sum(len(r[1]) for r in txn.records if r[1] is not None)
        self.last_tid = txn.tid


# ----------------------------------------------------------------------
# Readers


def _bytes(value):
    if value is None:
        return b''
    if isinstance(value, str):
        return value.encode('utf-8')
    return bytes(value)


def _extension_bytes(txn):
    ext = getattr(txn, 'extension_bytes', None)
    if ext is not None:
        return bytes(ext)
    return TransactionMetaData(b'', b'', getattr(txn, 'extension', None) or {}).extension_bytes


def history_txns(source, start=None, stop=None, stats=None, last=None):
    """Yield a ``Txn`` for every source transaction in [start, stop], and
    none after the one whose tid is ``last``, where the source's order puts
    it (a FileStorage's last transaction need not have the greatest tid).

    Back pointers (records whose data is None but whose ``data_txn`` is set)
    are resolved with ``loadSerial``.  Transaction ids must increase; one that
    does not is given the next possible id (as ZODB's copy does) and counted
    in ``stats.renumbered``: such a destination cannot be resumed with
    ``--incremental`` past that point.
    """
    previous = None
    iterator = source.iterator(start, stop)
    try:
        for trans in iterator:
            tid = trans.tid
            if previous is not None and u64(tid) <= u64(previous):
                new_tid = p64(u64(previous) + 1)
                log.warning("Source transaction %s is not after %s; copying it as %s",
                            tid_repr(tid), tid_repr(previous), tid_repr(new_tid))
                if stats is not None:
                    stats.renumbered += 1
                tid = new_tid
            previous = tid
            records = []
            for rec in trans:
                data = rec.data
                data_txn = getattr(rec, 'data_txn', None)
                if data is None and data_txn is not None:
                    data = _back_pointer_state(source, rec.oid, data_txn)
                records.append((rec.oid, data, data_txn))
            yield Txn(tid, getattr(trans, 'status', ' ') or ' ', _bytes(trans.user),
                      _bytes(trans.description), _extension_bytes(trans), records)
            if last is not None and trans.tid == last:
                break
    finally:
        close = getattr(iterator, 'close', None)
        if close is not None:
            close()


def _back_pointer_state(source, oid, data_txn):
    """The state a back pointer record names; None when that record has
    none.  An undo of the undo of an undone creation points back to the
    undone creation's record, which has no state (the object stops
    existing again), and FileStorage's loadSerial raises POSKeyError for
    it (a helper agent's check: such a source could not be copied, by
    any strategy, not even resumed past it).  The record named exists:
    the source's own iterator found it."""
    try:
        return source.loadSerial(oid, data_txn)
    except POSKeyError:
        return None


#: current_txns keeps up to this many bytes of states from its scan in
#: memory, so that it need not load them again.
SCAN_MEMORY = 256 * MB


def current_tids(source, as_of, keep=None, keep_bytes=0, later=None, unseen=None):
    """(oids, tids): parallel ``array('Q')`` of every object existing in the
    source as of tid ``as_of`` (an int) and its current tid then, oid order.

    Uses ``record_iternext`` (IStorageCurrentRecordIteration).  Objects
    changed after ``as_of`` (a live source) are looked up with ``loadBefore``.
    A history-free source has no earlier revision to find: such an object
    is appended to the list ``later``, or, without one, raises CopyError
    (it was silently left out: a helper agent's check copied a live site
    with ``--strategy current`` and lost the objects changed meanwhile).
    With a dict ``keep``, up to ``keep_bytes`` of states are kept there
    (oid int -> state) so the caller need not load them again.  Another
    source's object with no revision as of ``as_of`` was created after it,
    or its revision then was packed away since (a pack during the copy):
    it is added to the set ``unseen``, for the caller to tell which.
    """
    if not hasattr(source, 'record_iternext'):
        return _current_tids_by_iteration(source, as_of)
    oids, tids = array('Q'), array('Q')
    kept = 0
    nxt = None
    while True:
        try:
            oid, tid, _data, nxt = source.record_iternext(nxt)
        except POSKeyError as exc:
            # FileStorage raises for an object whose creation was undone;
            # RelStorage raises when nothing is left.  Go on after the object
            # only if the storage knows it.
            key = exc.args[0] if exc.args and isinstance(exc.args[0], bytes) else nxt
            if key is None or not _has_history(source, key):
                break
            nxt = p64(u64(key) + 1)
            continue
        except Exception as exc:  # pylint:disable=broad-except
            if _is_value_error(exc):
                break   # FileStorage: nothing at or after nxt
            raise
        tid_int = u64(tid)
        if tid_int > as_of:
            found = source.loadBefore(oid, p64(as_of + 1))
            tid_int = u64(found[1]) if found else None
            _data = None
            if found is None and is_history_free(source):
                if later is None:
                    raise CopyError(
                        "Object %s changed (or was created) in the source after "
                        "transaction %s, and a "
                        "history-free source keeps no earlier revision of it: stop the "
                        "writes to the source, or copy with --strategy replay (one "
                        "snapshot of the source)." % (oid_repr(oid), tid_repr(p64(as_of))))
                later.append(u64(oid))
            elif found is None and unseen is not None:
                unseen.add(u64(oid))
        if tid_int is not None:
            oids.append(u64(oid))
            tids.append(tid_int)
            if keep is not None and _data is not None and kept < keep_bytes:
                keep[oids[-1]] = _data
                kept += len(_data)
        if nxt is None:
            break
    return oids, tids


def _current_tids_by_iteration(source, as_of):
    """current_tids for a storage without record_iternext (DemoStorage,
    for one): replay its transactions up to ``as_of``, keeping the newest
    record of each object; a record without data means the object does
    not exist there."""
    latest = {}
    for txn in source.iterator(None, p64(as_of)):
        for record in txn:
            latest[u64(record.oid)] = (u64(txn.tid), record.data is not None)
    oids, tids = array('Q'), array('Q')
    for oid_int in sorted(latest):
        tid_int, exists = latest[oid_int]
        if exists:
            oids.append(oid_int)
            tids.append(tid_int)
    return oids, tids


def _has_history(source, oid):
    try:
        return bool(source.history(oid))
    except (POSKeyError, KeyError):
        return False


def current_txns(source, as_of, on_scan=None, collected=None):
    """Yield the source's current records as of tid ``as_of`` (an int) as one
    ``Txn`` per distinct tid, in tid order (oid order within a tid).

    History-free destinations keep only these, so this is all a fresh
    history-free copy needs.  Transaction metadata is not copied (a
    history-free RelStorage has nowhere to keep it).
    """
    kept = {}
    unseen = set()
    if collected is not None:
        oids, tids = collected
    else:
        oids, tids = current_tids(source, as_of, kept, SCAN_MEMORY, unseen=unseen)
    if on_scan is not None:
        on_scan(len(oids))
    # A stable sort on tid keeps the oid order within each tid.
    order = sorted(range(len(oids)), key=tids.__getitem__)
    group_tid = None
    records = []
    for i in order:
        tid_int, oid = tids[i], p64(oids[i])
        if tid_int != group_tid:
            if records:
                yield Txn(p64(group_tid), ' ', b'', b'', b'', records)
            group_tid, records = tid_int, []
        data = kept.pop(oids[i], None)
        if data is None:
            data, tid = source.load(oid)
            if u64(tid) != tid_int:
                found = source.loadBefore(oid, p64(as_of + 1))
                if found is None or u64(found[1]) != tid_int:
                    raise CopyError(
                        "Object %s changed in the source while it was being copied; "
                        "run zodbconvert again with --incremental."
                        % oid_repr(oid))
                data = found[0]
        if unseen:
            _check_not_unseen(oid, data, unseen, as_of)
        records.append((oid, data, None))
    if records:
        yield Txn(p64(group_tid), ' ', b'', b'', b'', records)


def _check_not_unseen(oid, data, unseen, as_of):
    """A state as of ``as_of`` refers only to objects that existed then:
    one of ``unseen`` (no revision as of ``as_of`` left in the source) did,
    and a pack removed that revision during the copy (a helper agent's
    check: such objects were left out, exit 0, and --verify, reading the
    same way, said the copy was identical)."""
    try:
        refs = referencesf(data)
    except Exception:  # pylint:disable=broad-except
        return          # (a state a wrapper transformed: not readable here)
    for ref in refs:
        if u64(ref) in unseen:
            raise CopyError(
                "Object %s refers to object %s, whose revision as of transaction %s is "
                "gone from the source: it changed after that transaction, and a pack "
                "removed the revision since (a pack during the copy?). Nothing "
                "inconsistent was kept: run zodbconvert again, or copy with "
                "--strategy replay." % (oid_repr(oid), oid_repr(ref), tid_repr(p64(as_of))))


# ----------------------------------------------------------------------
# Blobs


def _is_blob(data):
    return data is not None and b'ZODB.blob' in data and is_blob_record(data)


def source_blob(source, oid, tid):
    """The path of the committed blob file of ``oid`` at ``tid``; CopyError
    when the source cannot produce it."""
    load_blob = getattr(source, 'loadBlob', None)
    if load_blob is None or not IBlobStorage.providedBy(source):
        raise CopyError(
            "Object %s (transaction %s) is a blob, but the source %s has no blob "
            "support; configure its blob directory." % (
                oid_repr(oid), tid_repr(tid), source.getName()))
    try:
        path = load_blob(oid, tid)
        with open(path, 'rb'):
            pass
    except Exception as exc:  # POSKeyError, OSError, ...
        raise CopyError(
            "Cannot read the blob of object %s in transaction %s from the source: %s"
            % (oid_repr(oid), tid_repr(tid), _one_line(exc))) from exc
    return path


#: Times a blob of the source is read again when its file went from the
#: source's blob cache before it was copied (another process's prune or
#: pack clean-up).
BLOB_READ_ATTEMPTS = 3


def _blob_temp_copy(dest, path):
    """Copy a blob file next to where ``dest`` wants it (restoreBlob may move it)."""
    temp_dir = None
    get_dir = getattr(dest, 'temporaryDirectory', None)
    if get_dir is not None:
        try:
            temp_dir = get_dir()
        except Exception:  # pylint:disable=broad-except
            temp_dir = None
    # Named as a commit's pending blob files are, so that a destination
    # RelStorage opened after a copy that was killed removes it once it is
    # a day old (blobs/common.py).
    fd, name = tempfile.mkstemp(prefix=PENDING_PREFIX + 'zodbconvert-', suffix='.tmp',
                                dir=temp_dir)
    try:
        with os.fdopen(fd, 'wb') as target, open(path, 'rb') as src:
            shutil.copyfileobj(src, target, 1 << 20)
    except BaseException:
        # A helper agent's check: a copy that ran out of room left its
        # part-written file in blob-dir/tmp for good (the caller only
        # learns of files this returns).
        os.unlink(name)
        raise
    return name


def _file_digest(path):
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------------
# Writers


class NullWriter:
    """A dry run: reads every blob the copy would read; writes nothing."""

    def __init__(self, source, dest, stats):
        self.source = source
        self.stats = stats

    def write(self, txn):
        for oid, data, _ in txn.records:
            if _is_blob(data):
                path = source_blob(self.source, oid, txn.tid)
                self.stats.blobs += 1
                self.stats.blob_bytes += os.path.getsize(path)
        self.stats.add_txn(txn)

    def flush(self):
        pass


class StorageWriter:
    """Writes through the storage API: works for every ZODB storage."""

    def __init__(self, source, dest, stats):
        self.source = source
        self.dest = dest
        self.stats = stats
        self._restore = getattr(dest, 'restore', None)
        self._preindex = {}

    def write(self, txn):
        dest = self.dest
        meta = txn.metadata()
        dest.tpc_begin(meta, txn.tid, txn.status)
        temp_files = []
        try:
            for oid, data, data_txn in txn.records:
                if _is_blob(data):
                    self._write_blob(meta, txn, oid, data, data_txn, temp_files)
                elif self._restore is not None:
                    self._restore(oid, txn.tid, data, '', data_txn, meta)
                else:
                    if data is None:
                        raise CopyError(
                            "The destination %s has no restore(); it cannot record "
                            "the deletion of object %s in transaction %s."
                            % (dest.getName(), oid_repr(oid), tid_repr(txn.tid)))
                    dest.store(oid, self._preindex.get(oid), data, '', meta)
                    self._preindex[oid] = txn.tid
            dest.tpc_vote(meta)
            dest.tpc_finish(meta)
        except BaseException:
            dest.tpc_abort(meta)
            raise
        finally:
            for name in temp_files:
                if os.path.exists(name):
                    os.remove(name)
        self.stats.add_txn(txn)

    def _write_blob(self, meta, txn, oid, data, data_txn, temp_files):
        restore_blob = getattr(self.dest, 'restoreBlob', None)
        if restore_blob is None or not IBlobStorageRestoreable.providedBy(self.dest):
            if IBlobStorage.providedBy(self.dest):
                # (A review finding: through ZEO, whose client has a blob
                # directory but no restoreBlob, the advice was to configure
                # the blob directory it had.)
                raise CopyError(
                    "Object %s (transaction %s) is a blob, but the destination %s "
                    "cannot copy blobs in (it has no restoreBlob: a ZEO client has "
                    "none). Copy into the storage itself (the RelStorage behind the "
                    "ZEO server, say) instead."
                    % (oid_repr(oid), tid_repr(txn.tid), self.dest.getName()))
            raise CopyError(
                "Object %s (transaction %s) is a blob, but the destination %s does "
                "not support blobs; configure its blob directory."
                % (oid_repr(oid), tid_repr(txn.tid), self.dest.getName()))
        for attempt in range(BLOB_READ_ATTEMPTS):
            path = source_blob(self.source, oid, txn.tid)
            try:
                size = os.path.getsize(path)
                temp = _blob_temp_copy(self.dest, path)
                break
            except FileNotFoundError:
                # (A helper agent's check: a zodbpack sharing the source's
                # blob cache removed the file between its download and
                # this copy; the source, read in its snapshot, still has
                # the blob: downloaded again.)
                if attempt == BLOB_READ_ATTEMPTS - 1:
                    raise
        temp_files.append(temp)
        restore_blob(oid, txn.tid, data, temp, data_txn, meta)
        self.stats.blobs += 1
        self.stats.blob_bytes += size

    def flush(self):
        pass


class RelStorageWriter:
    """Writes into a RelStorage many transactions per database transaction.

    A batch goes through the destination's commit pipeline
    (``RelStorage.copy_transactions_in``, commit.py): the same row locks and
    commit lock in the same order as a commit, then each source transaction
    moved into place under its own tid.  An interruption loses at most the
    uncommitted batch; the destination's last tid still names the last
    transaction copied in full.
    """

    def __init__(self, source, dest, stats, batch_bytes=None,
                 batch_records=None, batch_seconds=None):
        self.source = source
        self.dest = dest
        self.stats = stats
        self.batch_bytes = batch_bytes or BATCH_BYTES
        self.batch_records = batch_records or BATCH_RECORDS
        self.batch_seconds = batch_seconds or BATCH_SECONDS
        self._pending = []
        self._pending_bytes = 0
        self._pending_records = 0
        self._pending_since = None
        self._pending_oids = collections.Counter()
        self._fallback = StorageWriter(source, dest, stats)

    def write(self, txn):
        if any(_is_blob(data) for _, data, _ in txn.records):
            # Blobs need the storage's restoreBlob.
            self.flush()
            self._fallback.write(txn)
            return
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(txn)
        self._pending_records += len(txn.records)
        self._pending_bytes += sum(len(d) for _, d, _ in txn.records if d is not None)
        counts = self._pending_oids
        repeated = False
        for oid in {oid for oid, _, _ in txn.records}:
            counts[oid] += 1
            repeated = repeated or counts[oid] >= BATCH_REPEATS
        if (repeated
                or self._pending_bytes >= self.batch_bytes
                or self._pending_records >= self.batch_records
                or time.monotonic() - self._pending_since >= self.batch_seconds):
            self.flush()

    def flush(self):
        pending = self._pending
        if not pending:
            return
        copied = [CopiedTransaction(u64(txn.tid), txn.user, txn.description, txn.extension,
                                    txn.status == 'p', _last_of_each(txn.records))
                  for txn in pending]
        try:
            self.dest.copy_transactions_in(copied)
        except POSException.StorageTransactionError as exc:
            beyond = [txn for txn in pending if u64(txn.tid) >= MAX_TID - 1]
            if beyond:
                # (A helper agent's check: this was said as the next case,
                # of the batch's first transaction, into an empty database.)
                raise CopyError("Cannot copy transaction %s: %s"
                                % (tid_repr(beyond[0].tid), exc)) from exc
            raise CopyError(
                "Cannot copy transaction %s: the destination already has a later "
                "transaction; was it written to during the copy? (%s)"
                % (tid_repr(pending[0].tid), exc)) from exc
        for txn in pending:
            self.stats.add_txn(txn)
        self._pending = []
        self._pending_bytes = self._pending_records = 0
        self._pending_oids.clear()


def _last_of_each(records):
    """``(oid_int, data)`` of ``records``, once per object: its last record.

    A FileStorage transaction can hold two records of one object (stored
    twice before the vote): loading it in that transaction gives the
    last, and that is the record a database keeps (one row per object and
    transaction)."""
    rows = {}
    for oid, data, _ in records:
        rows[u64(oid)] = data
    return list(rows.items())


def make_writer(source, dest, stats, dry_run=False):
    if dry_run:
        return NullWriter(source, dest, stats)
    if is_relstorage(dest):
        return RelStorageWriter(source, dest, stats)
    return StorageWriter(source, dest, stats)


def is_relstorage(storage):
    from .storage import RelStorage
    return isinstance(storage, RelStorage)


def reads_relstorage(storage):
    """A RelStorage, or a database of an earlier release read through
    storage/earlier.py: either has an ``adapter`` that answers for it."""
    from .earlier import EarlierReleaseStorage
    return is_relstorage(storage) or isinstance(storage, EarlierReleaseStorage)


def is_history_free(storage):
    """True for a history-free RelStorage (the only kind we can tell), or
    a wrapper that reads and writes through one and keeps no records of
    its own (zc.zlibstorage's ``base``, zc.beforestorage's ``storage``; a
    helper agent's check: a copy from a live ``<zlibstorage>`` around a
    history-free RelStorage was taken for one from a history-preserving
    source, and missed the objects changed while it began; into one, its
    --verify compared transactions a history-free database does not
    keep).  Not a DemoStorage: its changes keep records of their own."""
    inner = _through_wrappers(storage, ('base', 'storage'), reads_relstorage)
    return inner is not None and not inner.adapter.keep_history


# ----------------------------------------------------------------------
# Choosing how to fill a history-free destination

#: Replaying transactions writes every record of the source; the fast path
#: writes only the current ones but must find them first, one
#: ``record_iternext`` per object.  So the fast path pays off when the source
#: holds enough records per object (as estimated by ``estimate_history``);
#: from how many on depends on the kind of source and on the destination's
#: database, so each adapter class carries its thresholds
#: (``Adapter.copy_fast_path_thresholds``, measured as explained there and
#: in "How the copy works" in docs/zodbconvert.rst).
SOURCE_KINDS = {'file': 'a FileStorage', 'zeo': 'a ZEO', 'relstorage': 'a RelStorage'}

#: How many current records the estimate reads from the source.
ESTIMATE_SAMPLES = 1000

#: FileStorage's data record header (oid, tid, prev, tloc, vlen, plen).
FS_DATA_HEADER = 42

REPLAY = 'replay'
CURRENT = 'current'


class HistoryEstimate:
    """How many records (revisions, deletions included) the source holds for
    how many current objects; ``how`` says where the numbers come from."""

    def __init__(self, records, objects, how, exact=False):
        self.records = records
        self.objects = objects
        self.how = how
        self.exact = exact

    @property
    def per_object(self):
        return self.records / float(self.objects) if self.objects else 0.0

    def __repr__(self):
        return '<HistoryEstimate %d records, %d objects: %s>' % (
            self.records, self.objects, self.how)


def estimate_history(source, samples=None):
    """A cheap ``HistoryEstimate`` of the source, or None when it cannot tell.

    - a history-free RelStorage keeps one record per object;
    - a history-preserving RelStorage counts its rows (two ``COUNT(*)``);
    - any other storage with ``getSize`` and ``record_iternext`` (FileStorage,
      ZEO): its size divided by the size of an average record, from a sample
      of current records taken across the OID range.  Transaction headers are
      not counted apart, so the estimate is a little high for sources made of
      many tiny transactions.
    """
    if reads_relstorage(source):
        return _relstorage_history(source)
    if not hasattr(source, 'record_iternext'):
        return None
    try:
        size = int(source.getSize() or 0)
        objects = len(source)
    except Exception:  # pylint:disable=broad-except
        log.debug('no size or length for %r', source, exc_info=True)
        return None
    if size <= 0 or objects <= 0:
        return None
    sizes = _sample_state_sizes(source, samples or ESTIMATE_SAMPLES)
    if not sizes:
        return None
    record = FS_DATA_HEADER + sum(sizes) / float(len(sizes))
    records = max(int(size / record), 1)
    return HistoryEstimate(
        records, objects,
        'source size %s / (%d objects x %.0f bytes, the mean of %d sampled current '
        'records)' % (_mb(size), objects, record, len(sizes)))


def _mb(size):
    if size < MB:
        return '%.1f KB' % (size / 1024.0)
    return '%.1f MB' % (size / float(MB))


def _relstorage_history(source):
    adapter = source.adapter
    if not adapter.keep_history:
        objects = len(source)
        return HistoryEstimate(objects, objects, 'history-free RelStorage source: '
                               'one record per object', exact=True)
    conn = adapter.open_load()
    try:
        adapter.begin_snapshot(conn)
        records, objects = adapter.count_history(conn)     # one snapshot
    finally:
        conn.rollback()
        conn.close()
    return HistoryEstimate(records, objects, 'history-preserving RelStorage source: '
                           'rows counted', exact=True)


def _is_value_error(exc):
    """A ValueError or KeyError, also as ZEO passes on one raised by the
    server's storage (a ServerException naming it)."""
    if isinstance(exc, (ValueError, KeyError)):
        return True
    return (type(exc).__name__ == 'ServerException' and bool(exc.args)
            and exc.args[0] in ('builtins.ValueError', 'builtins.KeyError'))


def _at_or_after(source, oid_int):
    """``record_iternext`` from ``oid_int``: (oid, tid, data, next) or None."""
    try:
        return source.record_iternext(p64(oid_int))
    except POSKeyError:
        return None         # nothing there (or an undone creation)
    except Exception as exc:  # pylint:disable=broad-except
        if _is_value_error(exc):
            return None     # nothing at or after it
        raise


def _max_oid(source):
    index = getattr(source, '_index', None)
    if index is not None and hasattr(index, 'maxKey'):      # FileStorage
        try:
            return u64(index.maxKey())
        except ValueError:
            return None
    # Otherwise the largest OID at which record_iternext still finds one.
    if _at_or_after(source, 0) is None:
        return None
    low, high = 0, 1
    while high < (1 << 64) - 1 and _at_or_after(source, high) is not None:
        low, high = high, min(high * 2, (1 << 64) - 1)
    while high - low > 1:
        middle = (low + high) // 2
        if _at_or_after(source, middle) is not None:
            low = middle
        else:
            high = middle
    return low


def _sample_state_sizes(source, samples):
    """State sizes of up to ``samples`` current records spread evenly over
    the OID range (OIDs tend to follow creation order, so the first objects
    alone would be a biased sample)."""
    top = _max_oid(source)
    if top is None:
        return []
    step = max(1, (top + 1) // samples)
    sizes = []
    last = -1
    for start in range(0, top + 1, step):
        if start <= last:
            continue            # the record found last is at or after it
        found = _at_or_after(source, start)
        if found is None:
            continue
        # (After a gap of OIDs, the next record answers for every start
        # in the gap: it is counted once.)
        last = u64(found[0])
        if found[2] is not None:
            sizes.append(len(found[2]))
    return sizes


def source_kind(source):
    """'relstorage', 'zeo' or 'file' (FileStorage and anything else)."""
    if reads_relstorage(source):
        return 'relstorage'
    if type(source).__module__.split('.')[0] == 'ZEO':
        return 'zeo'
    return 'file'


def fast_path_threshold(source, adapter_class=None):
    """(records per object from which the fast path is chosen into a
    destination of ``adapter_class`` (None: the default), description)."""
    from ..adapters.base import Adapter
    kind = source_kind(source)
    if getattr(adapter_class, 'adapter', None) is not None:
        adapter_class = type(adapter_class.adapter)     # (a storage, as before)
    adapter = adapter_class or Adapter
    threshold = adapter.copy_fast_path_thresholds[kind]
    text = 'the threshold for %s source' % SOURCE_KINDS[kind]
    if threshold != Adapter.copy_fast_path_thresholds[kind]:
        text += ' into %s' % adapter.display_name
    return threshold, text


def choose_strategy(source, adapter_class=None, requested='auto'):
    """How to fill an empty history-free RelStorage of ``adapter_class``
    (its adapter's class; None: the default thresholds): (REPLAY or
    CURRENT, why, estimate or None)."""
    if requested == REPLAY:
        return REPLAY, 'requested with --strategy replay', None
    if not hasattr(source, 'record_iternext'):
        if requested == CURRENT:
            raise CopyError("--strategy current: the source %s cannot list its current "
                            "records (no record_iternext); use --strategy replay."
                            % source.getName())
        return REPLAY, 'the source cannot list its current records', None
    if requested == CURRENT:
        return CURRENT, 'requested with --strategy current', None
    estimate = estimate_history(source)
    if estimate is None:
        return (CURRENT, 'the amount of history in the source cannot be estimated',
                None)
    ratio = estimate.per_object
    threshold, which = fast_path_threshold(source, adapter_class)
    detail = '%s %.2f records per object (%s)' % (
        'the source holds' if estimate.exact else 'about', ratio, estimate.how)
    if ratio >= threshold:
        return CURRENT, '%s: at least %g, %s' % (detail, threshold, which), estimate
    return REPLAY, '%s: fewer than %g, %s' % (detail, threshold, which), estimate


# ----------------------------------------------------------------------
# Driving a copy


def run(txns, writer, stats, progress=None):
    """Feed ``txns`` to ``writer``; call ``progress(stats)`` after each."""
    try:
        for txn in txns:
            writer.write(txn)
            if progress is not None:
                progress(stats)
        writer.flush()
    finally:
        close = getattr(writer, 'close', None)
        if close is not None:
            close()
    if progress is not None:
        progress(stats)
    return stats


@contextlib.contextmanager
def unfinished(dest, dry_run=False):
    """A RelStorage ``dest`` is marked as holding an unfinished copy
    (RelStorage.mark_copy) in the block, and no longer when it ends
    without an error: a pack with garbage collection refuses to run
    until then."""
    dest = None if dry_run else relstorage_under(dest)
    if dest is None:
        yield
        return
    earlier = dest.mark_copy(time.time())
    last = dest.lastTransaction()
    try:
        yield
    except BaseException:
        if earlier is None and dest.lastTransaction() == last:
            # Nothing was written (a helper agent's check: a copy refused
            # at its first batch, into a database already complete, left
            # every pack of it refused).  (Not what a copy through ZEO,
            # say, left: copied_too.)
            try:
                dest.mark_copy(None, copied_too=False)
            except Exception:  # pylint:disable=broad-except
                log.warning("Could not remove the mark of a copy into %s that wrote "
                            "nothing", dest.getName(), exc_info=True)
        raise
    dest.mark_copy(None)


def relstorage_under(storage):
    """The RelStorage ``storage`` is, or the one it writes through
    (zc.zlibstorage's ``base``, zc.beforestorage's ``storage``, a
    DemoStorage's ``changes``, as many layers as there are), else None (a
    helper agent's check: a copy into ``<zlibstorage>`` around
    ``<relstorage>`` was not marked, and a pack removed what it had not
    linked yet)."""
    # (A DemoStorage writes into its changes, never its base: a review
    # finding, a copy into one whose base was a read-only RelStorage
    # failed with ReadOnlyError, marking the base.)
    return _through_wrappers(storage, ('changes', 'base', 'storage'), is_relstorage)


def _through_wrappers(storage, names, wanted):
    """``storage``, or the first of the storages it wraps (the attribute
    of ``names`` each layer has, as many layers as there are) for which
    ``wanted(storage)``; else None.  A layer with ``changes`` (a
    DemoStorage), where ``names`` leaves them out, ends the walk: it keeps
    records of its own."""
    for _ in range(10):
        if wanted(storage):
            return storage
        if 'changes' not in names and hasattr(storage, 'changes'):
            return None
        inner = None
        for name in names:
            inner = getattr(storage, name, None)
            if inner is not None and hasattr(inner, 'lastTransaction'):
                break
            inner = None
        if inner is None or inner is storage:
            return None
        storage = inner
    return None


def copy_transactions(source, dest, start=None, progress=None, dry_run=False, stats=None,
                      last=None):
    """Copy every source transaction from ``start`` (a tid, inclusive) on,
    up to the one whose tid is ``last`` (None: the end)."""
    stats = stats if stats is not None else Stats()
    writer = make_writer(source, dest, stats, dry_run)
    with unfinished(dest, dry_run):
        return run(history_txns(source, start, stats=stats, last=last), writer, stats,
                   progress)


def copy_current(source, dest, as_of, progress=None, dry_run=False, stats=None,
                 on_scan=None):
    """The history-free fast path: copy only current records, in tid order,
    then make the destination's last tid ``as_of`` (an int)."""
    stats = stats if stats is not None else Stats()
    writer = make_writer(source, dest, stats, dry_run)
    with unfinished(dest, dry_run):
        run(current_txns(source, as_of, on_scan=on_scan), writer, stats, progress)
        if not dry_run and u64(dest.lastTransaction()) < as_of:
            # Record that the copy reached the source's last transaction
            # (its last records may all have been deletions).
            closing = Txn(p64(as_of), ' ', b'', b'', b'', [])
            writer = make_writer(source, dest, Stats())
            run([closing], writer, writer.stats)
    return stats


# ----------------------------------------------------------------------
# Verification


#: How many differences a verification lists before it stops looking.
MAX_DIFFERENCES = 10


class _Differences:
    """Collects what differs; raises VerifyError naming them all once
    ``MAX_DIFFERENCES`` are found, or at the end (``check``)."""

    def __init__(self, limit=None):
        self.limit = limit or MAX_DIFFERENCES
        self.found = []

    def add(self, text):
        self.found.append(text)
        if len(self.found) >= self.limit:
            self.check(more=True)

    def check(self, more=False):
        if not self.found:
            return
        if len(self.found) == 1 and not more:
            raise VerifyError(self.found[0])
        raise VerifyError('%s%d differences; the first ones:\n  - %s' % (
            'At least ' if more else '', len(self.found),
            '\n  - '.join(self.found)))


def _blob_digest(storage, oid, tid, side):
    try:
        # A RelStorage keeping blobs in the database: those bytes, not its
        # cache's copy (which a copy just wrote from the source's files).
        stored = getattr(storage, 'stored_blob_digest', None)
        digest = stored(oid, tid) if stored is not None else None
        return digest if digest is not None else _file_digest(storage.loadBlob(oid, tid))
    except Exception as exc:  # pylint:disable=broad-except
        raise VerifyError("Cannot read the blob of object %s in transaction %s from "
                          "the %s: %s" % (oid_repr(oid), tid_repr(tid), side,
                                          _one_line(exc))) from exc


def _compare_state(oid, tid, sdata, ddata, source, dest, stats, where):
    """Return what differs between the two records, or None."""
    if sdata != ddata:
        return ("Object %s%s differs: source %s, destination %s"
                % (oid_repr(oid), where, _describe_state(sdata),
                   _describe_state(ddata)))
    if _is_blob(sdata):
        try:
            if _blob_digest(source, oid, tid, 'source') != _blob_digest(
                    dest, oid, tid, 'destination'):
                return "The blob of object %s%s differs" % (oid_repr(oid), where)
        except VerifyError as exc:
            return str(exc)
        stats.blobs += 1
    return None


def _describe_state(data):
    if data is None:
        return 'no state (deleted)'
    return '%d bytes (sha1 %s)' % (len(data), hashlib.sha1(data).hexdigest()[:12])


def _compare_txn(stxn, dtxn, source, dest, stats, differences):
    where = ' in transaction %s' % tid_repr(stxn.tid)
    for field in ('user', 'description'):
        if getattr(stxn, field) != getattr(dtxn, field):
            differences.add("The %s of transaction %s differs: %r != %r" % (
                field, tid_repr(stxn.tid), getattr(stxn, field), getattr(dtxn, field)))
    if stxn.metadata().extension != dtxn.metadata().extension:
        differences.add("The extension of transaction %s differs: %r != %r" % (
            tid_repr(stxn.tid), stxn.metadata().extension, dtxn.metadata().extension))
    srecs = {oid: data for oid, data, _ in stxn.records}
    drecs = {oid: data for oid, data, _ in dtxn.records}
    for oid in sorted(set(srecs) | set(drecs)):
        if oid not in drecs:
            differences.add("Object %s%s is missing from the destination"
                            % (oid_repr(oid), where))
        elif oid not in srecs:
            differences.add("Object %s%s is in the destination only"
                            % (oid_repr(oid), where))
        else:
            diff = _compare_state(oid, stxn.tid, srecs[oid], drecs[oid], source, dest,
                                  stats, where)
            if diff:
                differences.add(diff)


def verify_history(source, dest, progress=None, stop=None):
    """Compare transaction by transaction: ids, metadata, every record.

    Raises VerifyError listing the first differences (up to
    ``MAX_DIFFERENCES``)."""
    stats = Stats()
    differences = _Differences()
    source_txns = history_txns(source, None, stop)
    dest_txns = history_txns(dest, None, stop)
    stxn, dtxn = next(source_txns, None), next(dest_txns, None)
    while stxn is not None or dtxn is not None:
        if dtxn is None or (stxn is not None and stxn.tid < dtxn.tid):
            differences.add("Transaction %s is missing from the destination"
                            % tid_repr(stxn.tid))
            stxn = next(source_txns, None)
        elif stxn is None or dtxn.tid < stxn.tid:
            differences.add("Transaction %s is in the destination only"
                            % tid_repr(dtxn.tid))
            dtxn = next(dest_txns, None)
        else:
            _compare_txn(stxn, dtxn, source, dest, stats, differences)
            stats.add_txn(stxn)
            if progress is not None:
                progress(stats)
            stxn, dtxn = next(source_txns, None), next(dest_txns, None)
    differences.check()
    return stats


def verify_current(source, dest, as_of, progress=None):
    """Compare object by object the current states as of tid ``as_of``.

    Raises VerifyError listing the first differences (up to
    ``MAX_DIFFERENCES``)."""
    stats = Stats()
    differences = _Differences()
    later = []
    unseen = set()
    soids, stids = current_tids(source, as_of, later=later, unseen=unseen)
    doids, dtids = current_tids(dest, as_of)
    source_map = dict(zip(soids, stids))
    dest_map = dict(zip(doids, dtids))
    # (An object with no revision as of as_of left in another source:
    # created since, or its revision then packed away: either way the
    # destination is behind; it was said to be "in the destination only",
    # or, missing from both, not said at all.)
    later = set(later) | unseen
    for oid_int in sorted(set(source_map) | set(dest_map) | later):
        oid = p64(oid_int)
        if oid_int in later:
            # (A history-free source: its state as of as_of is gone.)
            differences.add("Object %s changed in the source after the destination's last "
                            "transaction %s: the destination is behind (--incremental "
                            "copies it)" % (oid_repr(oid), tid_repr(p64(as_of))))
            continue
        if oid_int not in dest_map:
            differences.add("Object %s is missing from the destination" % oid_repr(oid))
            continue
        if oid_int not in source_map:
            differences.add("Object %s is in the destination only" % oid_repr(oid))
            continue
        stid, dtid = source_map[oid_int], dest_map[oid_int]
        if stid != dtid:
            differences.add("Object %s has revision %s in the source but %s in the "
                            "destination" % (oid_repr(oid), tid_repr(p64(stid)),
                                             tid_repr(p64(dtid))))
            continue
        try:
            sdata = source.loadSerial(oid, p64(stid))
        except POSKeyError:
            # (Listed in one snapshot, loaded in another: a helper agent's
            # check saw a pack of the live source end the verification
            # with a bare POSKeyError.)
            differences.add("Object %s: its revision %s went from the source during the "
                            "verification (a pack?); verify again"
                            % (oid_repr(oid), tid_repr(p64(stid))))
            continue
        ddata = dest.loadSerial(oid, p64(dtid))
        diff = _compare_state(oid, p64(stid), sdata, ddata, source, dest, stats, '')
        if diff:
            differences.add(diff)
        stats.records += 1
        stats.bytes += len(sdata)
        if progress is not None and stats.records % 1000 == 0:
            progress(stats)
    differences.check()
    stats.last_tid = p64(as_of)
    return stats


__all__ = ['CopyError', 'VerifyError', 'Stats', 'Txn', 'history_txns', 'current_txns',
           'current_tids', 'copy_transactions', 'copy_current', 'verify_history',
           'verify_current', 'make_writer', 'is_relstorage', 'reads_relstorage',
           'is_history_free', 'z64',
           'HistoryEstimate', 'estimate_history', 'choose_strategy', 'REPLAY', 'CURRENT',
           'fast_path_threshold', 'source_kind']
