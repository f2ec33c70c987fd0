"""RelStorage: the ZODB storage.

One ``RelStorage`` object is created from the configuration; ZODB.DB then
asks it for one ``new_instance()`` per ZODB connection.  Every instance owns
two database connections:

- a *load* connection holding one read-only snapshot from
  ``poll_invalidations`` until ``afterCompletion`` (MVCC by polling);
- a *store* connection, used only while committing.

The instances share the adapter (and with it the OID allocator) and the
state cache.  ZODB does not wrap an IMVCCStorage in its MVCC adapter, so
this class implements the per-connection life cycle itself.

Two-phase commit, in short (see commit.py for the steps):
``store`` only buffers; ``tpc_vote`` uploads, locks the changed rows,
resolves conflicts and checks ``readCurrent``; ``tpc_finish`` takes the
database-wide commit lock just long enough to choose the transaction id,
move the rows into place and commit.
"""
import logging
import threading
import weakref

import zope.interface
from ZODB import POSException
from ZODB.ConflictResolution import ConflictResolvingStorage
from ZODB.blob import BlobFile
from ZODB.interfaces import IBlobStorage
from ZODB.interfaces import IBlobStorageRestoreable
from ZODB.interfaces import IExternalGC
from ZODB.interfaces import IMultiCommitStorage
from ZODB.interfaces import IMVCCStorage
from ZODB.interfaces import IStorage
from ZODB.interfaces import IStorageCurrentRecordIteration
from ZODB.interfaces import IStorageIteration
from ZODB.interfaces import IStorageRestoreable
from ZODB.interfaces import IStorageUndoable
from ZODB.utils import p64
from ZODB.utils import u64

from ..blobs import make_blobs
from ..cache.storage_cache import StorageCache
from ..interfaces import DisconnectedError
from ..interfaces import RelStorageError as StorageError
from ..options import Options
from . import commit
from . import history
from .tempstore import TempStore

log = logging.getLogger(__name__)


#: Sequential read-ahead (see RelStorage._read_ahead).
READ_AHEAD_AFTER = 3
READ_AHEAD = 128


@zope.interface.implementer(
    IStorage,
    IMVCCStorage,
    IMultiCommitStorage,
    IStorageRestoreable,
    IStorageIteration,
    IStorageCurrentRecordIteration,
    IExternalGC,
)
class RelStorage(ConflictResolvingStorage):
    """A ZODB storage keeping pickles in a relational database."""

    _crs_transform_record_data = _crs_untransform_record_data = staticmethod(lambda d: d)

    def __init__(self, adapter, name=None, create=None, options=None,
                 _parent=None, **kwoptions):
        if options is None:
            options = Options(**kwoptions)
        elif kwoptions:
            options = options.copy(**kwoptions)
        self._adapter = adapter
        self._options = options
        self._name = name or options.name or 'RelStorage on %s' % adapter.describe()
        self._is_read_only = bool(options.read_only)
        self._parent = _parent
        self._before = None                 # historical instances: load before this tid

        if _parent is None:
            if create is None:
                create = options.create_schema
            adapter.prepare_schema(create=create, read_only=self._is_read_only)
            # Shared by every instance; loads its persistent file, if any.
            self._cache = StorageCache(options, adapter)
            self._blobs = make_blobs(options, adapter)
            if self._blobs is not None and self._blobs.in_database and not adapter.has_blob_chunk:
                raise StorageError(
                    "The schema at %s has no blob_chunk table, so blobs cannot be kept "
                    "in the database; use shared-blob-dir true or recreate the schema."
                    % adapter.describe())
        else:
            self._cache = _parent._cache
            self._blobs = _parent._blobs
            self._crs_transform_record_data = _parent._crs_transform_record_data
            self._crs_untransform_record_data = _parent._crs_untransform_record_data

        if adapter.keep_history:
            zope.interface.alsoProvides(self, IStorageUndoable)
        if self._blobs is not None:
            zope.interface.alsoProvides(self, IBlobStorage, IBlobStorageRestoreable)
            # ZODB.blob.copyTransactionsFromTo puts its files here.
            self.fshelper = self._blobs.fshelper

        # _lock guards the connections of this instance: a storage instance
        # may be used from several threads (ZODB's own tests do).  It is an
        # RLock because conflict resolution loads while committing.
        self._lock = threading.RLock()
        # _tpc_cond serializes two-phase commits on this instance.
        self._tpc_cond = threading.Condition()
        self._load_conn = None
        self._store_conn = None
        self._snapshot_open = False
        self._snapshot_tid = 0
        self._poll_tid = None          # what the ZODB connection has been told
        self._snapshot_pack_mark = 0    # the pack mark in our snapshot
        self._poll_pack_mark = None     # ... when the ZODB connection last polled
        self._last_commit_tid = 0
        self._ra_next = self._ra_run = 0      # read-ahead state (see _read_ahead)
        self._ra_until = -1
        self._last_load = None          # (oid, snapshot, (state, serial)), see load
        self._own_tids = set()          # committed here since the last poll
        # The storage object made from the configuration is used directly by
        # ZODB.DB (undoLog, pack, lastTransaction, ...) and by tools; until
        # somebody polls it, each of its reads sees the latest commits.
        # Instances (one per ZODB connection) keep their snapshot until
        # afterCompletion/poll, as MVCC requires.
        self._autorefresh = _parent is None
        self._closed = False
        self._instances = weakref.WeakSet()
        self._reset_tpc()

    # ------------------------------------------------------------------
    # Instances (IMVCCStorage)

    def new_instance(self):
        instance = type(self)(self._adapter, name=self._name, options=self._options,
                              _parent=self)
        self._instances.add(instance)
        return instance

    def before_instance(self, before=None):
        instance = self.new_instance()
        instance._before = u64(before) if before is not None else None
        instance._is_read_only = True
        return instance

    def release(self):
        with self._lock:
            for conn in (self._load_conn, self._store_conn):
                if conn is not None:
                    conn.close()
            self._load_conn = self._store_conn = None
            self._snapshot_open = False

    def close(self):
        if self._closed:
            return
        self._closed = True
        self.release()
        if self._parent is None:
            # Instances nobody released (a ZODB connection never closed)
            # would otherwise keep their database sessions until garbage
            # collection.
            for instance in list(self._instances):
                instance.release()
            self._cache.close()
            self._adapter.close()

    # ------------------------------------------------------------------
    # The snapshot (load connection)

    def _get_load_conn(self):
        if self._load_conn is None or self._load_conn.broken:
            if self._load_conn is not None:
                self._load_conn.close()
            self._load_conn = self._adapter.open_load()
        return self._load_conn

    def _ensure_snapshot(self):
        if self._snapshot_open and self._autorefresh and self._txn is None:
            self._end_snapshot()
        if self._snapshot_open:
            return self._load_conn
        for attempt in (1, 2):
            conn = self._get_load_conn()
            try:
                self._adapter.begin_snapshot(conn)
                tid, pack_mark = self._adapter.snapshot_marks(conn)
                break
            except DisconnectedError:
                # The server restarted or dropped us since the last
                # transaction: nothing was in flight, so reconnect once.
                conn.close()
                self._load_conn = None
                if attempt == 2:
                    raise
        self._snapshot_open = True
        self._snapshot_tid = tid
        self._snapshot_pack_mark = pack_mark
        # A pack happened since the cache last looked: it drops what
        # may be gone (see StorageCache.note_pack_mark).
        self._cache.note_pack_mark(pack_mark, tid)
        if self._poll_tid is None:
            self._poll_tid = tid
        return conn

    def _end_snapshot(self):
        self._ra_until = -1
        # A later snapshot may carry the same tid yet differ (a pack does
        # not change the last tid).
        self._last_load = None
        if self._snapshot_open:
            self._snapshot_open = False
            conn = self._load_conn
            if conn is not None:
                conn.rollback()
                if conn.broken:
                    conn.close()
                    self._load_conn = None

    def poll_invalidations(self):
        with self._lock:
            self._autorefresh = False
            previous = self._poll_tid
            self._end_snapshot()
            conn = self._ensure_snapshot()
            current = self._snapshot_tid
            self._poll_tid = current
            mark, self._poll_pack_mark = self._poll_pack_mark, self._snapshot_pack_mark
            if previous is not None and mark is not None and mark != self._snapshot_pack_mark:
                # Packed since our last poll: objects our ZODB connection
                # caches may be gone, so it must drop everything.  The
                # shared change log restarts at this (post-pack) snapshot.
                self._own_tids = set()
                self._cache.poll(self._adapter, conn, None, current)
                return None
            if previous is None or current == previous:
                self._own_tids = set()
                # Nothing to invalidate, but keep the shared change log
                # up to this snapshot.
                self._cache.poll(self._adapter, conn, previous, current)
                return []
            if current < previous:
                # The database went back in time (restored from a backup):
                # nothing the connection caches can be trusted.
                log.warning("The database's last transaction went backwards "
                            "(from %x to %x); invalidating all caches.", previous, current)
                self._cache.rolled_back(current, previous)
                return None
            # One query at most, often none: the change log shared by all
            # instances may already hold (previous, current].
            changes = self._cache.poll(self._adapter, conn, previous, current)
            own = self._own_tids
            self._own_tids = set()
            # What this instance committed itself is already in its ZODB
            # connection's cache: invalidating it would only cost reloads.
            return [p64(oid) for oid, tid in changes if tid not in own]

    def sync(self, force=True):
        with self._lock:
            self._end_snapshot()

    def afterCompletion(self):
        with self._lock:
            self._end_snapshot()

    # ------------------------------------------------------------------
    # Loading

    def load(self, oid, version=''):
        if self._before is not None:
            result = self.loadBefore(oid, p64(self._before))
            if result is None:
                raise POSException.POSKeyError(oid)
            return result[:2]
        with self._lock:
            conn = self._ensure_snapshot()
            snapshot = self._snapshot_tid
            last = self._last_load
            if last is not None and last[0] == oid and last[1] == snapshot:
                # ZODB's Connection.get loads a state to make the ghost and
                # again to activate it; in one snapshot the answer is the
                # same, so the second load costs nothing.
                return last[2]
            oid_int = u64(oid)
            self._read_ahead(conn, oid_int)
            # The revision current in our snapshot: from the caches when
            # the shared index knows its tid, else from the database.
            result = self._cache.load(self._adapter, conn, oid_int, snapshot)
            if result is None or result[0] is None:
                raise POSException.POSKeyError(oid)
            answer = result[0], p64(result[1])
            self._last_load = (oid, snapshot, answer)
        return answer

    def _read_ahead(self, conn, oid_int):
        """Sequential read-ahead by OID.

        Objects created together get consecutive OIDs and tend to be read
        together (a container and its items, a BTree's buckets).  After
        READ_AHEAD_AFTER loads of consecutive OIDs on this connection, the
        next READ_AHEAD OIDs not already known to the cache are read in one
        query, in the same snapshot, instead of one round trip each.
        Random access never triggers it; a scan of cached objects costs no
        query (prefetch only asks for what the cache does not know).
        """
        if oid_int == self._ra_next:
            self._ra_run += 1
        elif oid_int == self._ra_next - 1:
            # The same object again: ZODB's Connection.get loads a state to
            # make the ghost and again to activate it.  Neither breaks
            # nor extends the run.
            return
        else:
            self._ra_run = 0
        self._ra_next = oid_int + 1
        if (self._ra_run >= READ_AHEAD_AFTER and oid_int > self._ra_until
                and self._cache.local.limit):
            self._ra_until = oid_int + READ_AHEAD - 1
            self._cache.prefetch(self._adapter, conn, range(oid_int, oid_int + READ_AHEAD),
                                 self._snapshot_tid)

    def loadBefore(self, oid, tid):
        oid_int = u64(oid)
        with self._lock:
            result = self._adapter.load_before(self._ensure_snapshot(), oid_int, u64(tid))
        if result is None:
            if not self._exists(oid_int):
                raise POSException.POSKeyError(oid)
            return None
        if result[0] is None:
            # The revision in force then says the object did not exist
            # (creation undone, or deleted by external GC).
            raise POSException.POSKeyError(oid)
        state, start, end = result
        self._cache.put(oid_int, start, state)
        return state, p64(start), (p64(end) if end is not None else None)

    def _exists(self, oid_int):
        """Whether the object has any revision in the snapshot."""
        with self._lock:
            return self._adapter.load_current(self._ensure_snapshot(), oid_int) is not None

    def getTid(self, oid):
        """The tid of the current revision; POSKeyError when there is none."""
        return self.load(oid)[1]

    def loadSerial(self, oid, serial):
        oid_int, tid_int = u64(oid), u64(serial)
        state = self._cache.get(oid_int, tid_int)
        if state is not None:
            return state
        with self._lock:
            found, state = self._adapter.load_revision(self._ensure_snapshot(), oid_int, tid_int)
            if not found:
                # A revision committed after our snapshot began: revisions
                # never change, so reading it outside the snapshot is safe.
                found, state = self._adapter.load_revision(
                    self._get_store_conn(), oid_int, tid_int)
                if not self._tpc_active():
                    self._store_conn.rollback()
        if not found or state is None:
            raise POSException.POSKeyError(oid)
        self._cache.put(oid_int, tid_int, state)
        return state

    def prefetch(self, oids):
        """Load many objects in one query, warming the state cache."""
        oid_ints = [u64(oid) for oid in oids]
        if not oid_ints or self._before is not None:
            return
        with self._lock:
            conn = self._ensure_snapshot()
            self._cache.prefetch(self._adapter, conn, oid_ints, self._snapshot_tid)

    def lastTransaction(self):
        with self._lock:
            if self._before is not None:
                return p64(self._before - 1)
            if not self._snapshot_open:
                self._ensure_snapshot()
            return p64(max(self._snapshot_tid, self._last_commit_tid))

    # ------------------------------------------------------------------
    # Two-phase commit

    def _get_store_conn(self):
        if self._store_conn is None or self._store_conn.broken:
            if self._store_conn is not None:
                self._store_conn.close()
            self._store_conn = self._adapter.open_store()
        return self._store_conn

    def _reset_tpc(self):
        self._txn = None
        self._tstore = None
        self._read_current = {}
        self._resolved = set()
        self._restore_tid = None
        self._restoring = False
        self._voted = False
        self._meta = None
        self._btxn = None

    def _tpc_active(self):
        return self._txn is not None

    def _check_txn(self, txn):
        if txn is not self._txn:
            raise POSException.StorageTransactionError(self, txn)

    def tpc_transaction(self):
        return self._txn

    def tpc_begin(self, txn, tid=None, status=' '):
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        with self._tpc_cond:
            if self._txn is txn:
                raise POSException.StorageTransactionError(
                    "Duplicate tpc_begin calls for same transaction")
            while self._txn is not None:
                self._tpc_cond.wait()
            self._txn = txn
        self._tstore = TempStore()
        if self._blobs is not None:
            self._btxn = self._blobs.begin()
        self._restore_tid = u64(tid) if tid is not None else None
        ext = getattr(txn, 'extension_bytes', None)
        if ext is None:
            ext = history.dump_extension(getattr(txn, 'extension', None) or {})
        self._meta = (_as_bytes(txn.user), _as_bytes(txn.description), ext, status)

    def store(self, oid, serial, data, version, txn):
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        self._check_txn(txn)
        if version:
            raise POSException.Unsupported("Versions aren't supported")
        self._tstore.store(u64(oid), _tid_int(serial), data)
        return None

    def restore(self, oid, serial, data, version, prev_txn, txn):
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        self._check_txn(txn)
        if version:
            raise POSException.Unsupported("Versions aren't supported")
        if data is None and prev_txn is not None:
            # A back pointer: the record repeats the state of prev_txn.
            data = self.loadSerial(oid, prev_txn)
        self._restoring = True
        self._tstore.store(u64(oid), u64(serial), data)

    def deleteObject(self, oid, oldserial, txn):
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        self._check_txn(txn)
        self._tstore.store(u64(oid), u64(oldserial) if oldserial else 0, None)

    def checkCurrentSerialInTransaction(self, oid, serial, txn):
        self._check_txn(txn)
        self._read_current[u64(oid)] = u64(serial)

    def tpc_vote(self, txn):
        self._check_txn(txn)
        with self._lock:
            for attempt in (1, 2):
                conn = self._get_store_conn()
                try:
                    commit.vote(self, conn)
                    break
                except DisconnectedError:
                    # Lost the store connection (server restarted, session
                    # killed): nothing of this transaction was committed and
                    # everything to vote is still in the temp store, so vote
                    # once more on a new connection.
                    conn.rollback()
                    if attempt == 2:
                        raise
                except BaseException:
                    conn.rollback()
                    raise
            self._voted = True
        return [p64(oid) for oid in self._resolved]

    def tpc_finish(self, txn, f=None):
        self._check_txn(txn)
        if not self._voted:
            raise POSException.StorageTransactionError(
                "tpc_finish called without tpc_vote")
        try:
            with self._lock:
                conn = self._store_conn
                if conn is None or conn.broken:
                    # Reconnecting here would commit an empty temp_store.
                    raise DisconnectedError(
                        "Lost the store connection to %s between vote and finish"
                        % self._adapter.describe())
                tid_int = commit.finish(self, conn)
                self._last_commit_tid = tid_int
                self._own_tids.add(tid_int)
                tid = p64(tid_int)
                if f is not None:
                    f(tid)
                # Later loads through this instance must see what it wrote.
                self._end_snapshot()
            return tid
        finally:
            self._end_tpc()

    def tpc_abort(self, txn):
        if txn is not self._txn:
            return
        try:
            with self._lock:
                if self._store_conn is not None:
                    self._store_conn.rollback()
        finally:
            self._end_tpc()

    def _end_tpc(self):
        if self._tstore is not None:
            self._tstore.close()
        if self._btxn is not None:
            self._btxn.discard()
        with self._tpc_cond:
            self._reset_tpc()
            self._tpc_cond.notify_all()

    # ------------------------------------------------------------------
    # Blobs (IBlobStorage, IBlobStorageRestoreable; only with a blob-dir)

    def storeBlob(self, oid, oldserial, data, blobfilename, version, txn):
        self.store(oid, oldserial, data, version, txn)
        self._btxn.add(u64(oid), blobfilename)

    def restoreBlob(self, oid, serial, data, blobfilename, prev_txn, txn):
        self.restore(oid, serial, data, '', prev_txn, txn)
        self._btxn.add(u64(oid), blobfilename)

    def loadBlob(self, oid, serial):
        if self._blobs is None:
            raise POSException.Unsupported("No blob-dir is configured")
        return self._blobs.load(self, u64(oid), u64(serial))

    def openCommittedBlobFile(self, oid, serial, blob=None):
        attempts = 5 if self._blobs is not None and self._blobs.in_database else 1
        for attempt in range(attempts):
            path = self.loadBlob(oid, serial)
            try:
                return open(path, 'rb') if blob is None else BlobFile(path, 'r', blob)
            except FileNotFoundError:
                # Pruned from the cache between lookup and open: fetch again.
                if attempt == attempts - 1:
                    raise

    def temporaryDirectory(self):
        return self._blobs.temporary_directory()

    def _read_blob_chunks(self, oid_int, tid_int, write):
        """Stream a blob's chunks to ``write``; its size, or None if absent."""
        adapter = self._adapter
        with self._lock:
            conn = self._ensure_snapshot()
            count = adapter.blob_chunk_count(conn, oid_int, tid_int)
            fresh = False
            if not count:
                # Committed after our snapshot began? Revisions never change,
                # so the latest committed data is as good.
                conn = self._get_store_conn()
                fresh = True
                count = adapter.blob_chunk_count(conn, oid_int, tid_int)
            try:
                if not count:
                    return None
                size = 0
                for num in range(count):
                    data = adapter.load_blob_chunk(conn, oid_int, tid_int, num)
                    write(data)
                    size += len(data)
                return size
            finally:
                if fresh and not self._tpc_active():
                    conn.rollback()

    def new_oid(self):
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        return p64(self._adapter.new_oid())

    # ------------------------------------------------------------------
    # History, undo, iteration

    def supportsUndo(self):
        return self._adapter.keep_history

    def history(self, oid, size=1):
        with self._lock:
            return history.object_history(self, self._ensure_snapshot(), oid, size)

    def undoLog(self, first=0, last=-20, filter=None):
        if not self._adapter.keep_history:
            return []
        with self._lock:
            return history.undo_log(self, self._ensure_snapshot(), first, last, filter)

    def undoInfo(self, first=0, last=-20, specification=None):
        if specification:
            def filter(desc):
                return all(desc.get(k) == v for k, v in specification.items())
        else:
            filter = None
        return self.undoLog(first, last, filter)

    def undo(self, transaction_id, txn):
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        self._check_txn(txn)
        if not self._adapter.keep_history:
            raise POSException.UndoError("Undo is not supported by history-free storages")
        with self._lock:
            oids = history.undo(self, self._ensure_snapshot(), u64(transaction_id))
        return None, [p64(oid) for oid in oids]

    def iterator(self, start=None, stop=None):
        return history.TransactionIterator(self._adapter, start, stop)

    def record_iternext(self, next=None):
        with self._lock:
            return history.record_iternext(self, self._ensure_snapshot(), next)

    def copyTransactionsFrom(self, other, verbose=False):
        """Copy every transaction of ``other`` (any IStorageIteration),
        keeping their tids, many per database transaction; blobs go through
        ``restoreBlob`` (see copy.py)."""
        from . import copy
        copy.copy_transactions(other, self)

    def pack(self, t, referencesf, gc=None):
        """IStorage.pack; see run_pack."""
        self.run_pack(t, referencesf, gc=gc)

    def run_pack(self, t, referencesf, gc=None, prepack_only=None, skip_prepack=None,
                 progress=None):
        """Pack to time ``t`` (see storage/pack.py); returns a PackReport.
        ``gc``, ``prepack_only`` and ``skip_prepack`` default to the
        pack-gc, pack-prepack-only and pack-skip-prepack options;
        ``progress`` makes a progress display per phase (zodbpack)."""
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        from . import pack
        options = self._options
        report = pack.pack(
            self._adapter, options, t, referencesf,
            gc=options.pack_gc if gc is None else gc,
            blobs=self._blobs, cache=self._cache,
            prepack_only=options.pack_prepack_only if prepack_only is None else prepack_only,
            skip_prepack=options.pack_skip_prepack if skip_prepack is None else skip_prepack,
            progress=progress)
        with self._lock:
            self._end_snapshot()
        return report

    def check_references(self, referencesf, progress=None):
        """References from current revisions to objects that do not exist,
        as (oid, tid, missing oid) integers; removes nothing."""
        from . import pack
        return pack.check_references(self._adapter, referencesf, progress=progress)

    # ------------------------------------------------------------------
    # Small IStorage methods

    def getName(self):
        return self._name

    def sortKey(self):
        return 'RelStorage:' + self._adapter.describe()

    def isReadOnly(self):
        return self._is_read_only

    def getSize(self):
        with self._lock:
            return self._adapter.database_size(self._ensure_snapshot())

    def __len__(self):
        with self._lock:
            return self._adapter.count_objects(self._ensure_snapshot())

    def cache_stats(self):
        """Hit/miss statistics of the storage-wide state cache."""
        return self._cache.stats()

    def __repr__(self):
        return '<%s %r at 0x%x>' % (type(self).__name__, self._name, id(self))


def _tid_int(serial):
    if not serial:
        return 0
    if isinstance(serial, str):
        # Old callers (and ZODB's own doctests) pass '\0' * 8.
        serial = serial.encode('latin-1')
    return u64(serial)


def _as_bytes(value):
    if value is None:
        return b''
    if isinstance(value, str):
        return value.encode('utf-8')
    return bytes(value)
