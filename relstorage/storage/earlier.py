"""Reading a database that RelStorage 3.x or 4.x created.

Those releases kept their data in a schema close to ours (the same
``object_state``, ``current_object`` and ``blob_chunk`` columns), but
with the transaction metadata in ``transaction``, no row recording the
last transaction, and other tables for their locks and pack.  This release
does not write to that schema: opened read-write, such a database is
refused with an error naming zodbconvert (``EarlierSchemaError``), and
nothing in it changes.  Opened read-only, it is read by
``EarlierReleaseStorage``, so the storage section a site already has can
be zodbconvert's source as it stands (zodbconvert opens its source
read-only), and ``ZODB.DB`` can open it read-only to look before copying.

``EarlierReleaseStorage`` is a plain (not MVCC) read-only storage: each
call reads in a snapshot of its own, ``iterator()`` in one snapshot for
the whole iteration.  The adapter's read verbs do the work, on statements
the adapter switched to (``Adapter.read_earlier_schema``).  Blobs come
from the blob-dir as it is (``shared-blob-dir true``, where those releases
kept the only copy), or from the ``blob_chunk`` rows into a temporary
directory of this storage's own: a blob-dir configured as a cache
(``shared-blob-dir false``) is the earlier release's, possibly in use by
its processes, and is not touched.
"""
import collections
import contextlib
import logging
import os
import shutil
import tempfile
import threading

import zope.interface
from ZODB import POSException
from ZODB.blob import BlobFile
from ZODB.blob import FilesystemHelper
from ZODB.interfaces import IBlobStorage
from ZODB.interfaces import IStorage
from ZODB.interfaces import IStorageCurrentRecordIteration
from ZODB.interfaces import IStorageIteration
from ZODB.utils import oid_repr
from ZODB.utils import p64
from ZODB.utils import tid_repr
from ZODB.utils import u64

from ..interfaces import EarlierSchemaError
from ..interfaces import RelStorageError
from . import history

log = logging.getLogger(__name__)

#: Bytes of downloaded blob files kept (beyond the newest one): a copy uses
#: each file once, right after loadBlob, and a reader opens it at once (a
#: file removed while open stays readable until closed).
DOWNLOADS_KEPT_BYTES = 256 << 20


def open_storage(adapter, options):
    """The storage for ``adapter`` and ``options``: a RelStorage, or, on a
    database an earlier release created and with ``read-only``, an
    ``EarlierReleaseStorage`` (every way of opening from a configuration
    goes through here)."""
    from .storage import RelStorage
    try:
        return RelStorage(adapter, name=options.name, options=options)
    except EarlierSchemaError as exc:
        if not options.read_only:
            adapter.close()
            raise
        keep_history = exc.keep_history
    try:
        adapter.read_earlier_schema(keep_history)
        storage = EarlierReleaseStorage(adapter, options)
    except BaseException:
        adapter.close()
        raise
    log.info("Reading the %s schema of an earlier RelStorage release at %s (read-only)",
             'history-preserving' if keep_history else 'history-free', adapter.describe())
    return storage


@zope.interface.implementer(IStorage, IStorageIteration, IStorageCurrentRecordIteration)
class EarlierReleaseStorage:
    """A read-only storage over the schema of RelStorage 3.x / 4.x."""

    def __init__(self, adapter, options):
        self.adapter = adapter
        self.options = options
        self._name = options.name or (
            'RelStorage (schema of an earlier release) on %s' % adapter.describe())
        self._lock = threading.RLock()
        self._conn = None
        self._fshelper = None
        self._downloads = None
        self._downloaded = collections.OrderedDict()      # path -> size, oldest first
        self._downloaded_bytes = 0
        self._iterators = history.IteratorSnapshots()      # see loadBlob
        self._records_ahead = None                         # see record_iternext
        if options.blob_dir:
            if options.shared_blob_dir:
                if not os.path.isdir(options.blob_dir):
                    raise RelStorageError(
                        "blob-dir %s does not exist: with shared-blob-dir true, it "
                        "holds the only copy of the blobs" % options.blob_dir)
                # ZODB reads the layout from the directory's marker.
                self._fshelper = FilesystemHelper(options.blob_dir)
            else:
                self._downloads = tempfile.mkdtemp(prefix='relstorage-earlier-blobs-')
            zope.interface.alsoProvides(self, IBlobStorage)

    # --- reading ----------------------------------------------------------

    @contextlib.contextmanager
    def _read(self):
        """A connection in a snapshot of its own, ended afterwards."""
        with self._lock:
            if self._conn is None or self._conn.broken:
                if self._conn is not None:
                    self._conn.close()
                self._conn = self.adapter.open_load()
            conn = self._conn
            self.adapter.begin_snapshot(conn)
            try:
                yield conn
            finally:
                conn.rollback()

    def lastTransaction(self):
        with self._read() as conn:
            return p64(self.adapter.get_last_tid(conn))

    def load(self, oid, version=''):
        if history.beyond_range(u64(oid)):
            raise POSException.POSKeyError(oid)
        with self._read() as conn:
            row = self.adapter.load_current(conn, u64(oid))
        if row is None or row[0] is None:
            raise POSException.POSKeyError(oid)
        return bytes(row[0]), p64(row[1])

    def loadBefore(self, oid, tid):
        if history.beyond_range(u64(oid)):
            raise POSException.POSKeyError(oid)
        with self._read() as conn:
            found = history.revision_before(self.adapter, conn, oid,
                                            min(u64(tid), history.MAX_TID))
        if found is None:
            return None
        state, start, end = found
        return state, p64(start), (p64(end) if end else None)

    def loadSerial(self, oid, serial):
        if history.beyond_range(u64(oid), u64(serial)):
            raise POSException.POSKeyError(oid, serial)
        with self._read() as conn:
            found, state = self.adapter.load_revision(conn, u64(oid), u64(serial))
        if not found or state is None:
            raise POSException.POSKeyError(oid, serial)
        return state

    def history(self, oid, size=1):
        if history.beyond_range(u64(oid)):
            raise POSException.POSKeyError(oid)
        with self._read() as conn:
            return history.object_history(self.adapter, conn, oid, size)

    def iterator(self, start=None, stop=None):
        return self._iterators.add(history.TransactionIterator(self.adapter, start, stop))

    def record_iternext(self, next=None):
        # Read ahead, as RelStorage.record_iternext does: a query per call
        # made a walk of a 10,000-object database of RelStorage 4.3 take
        # 6.8 s where 4.3 took 0.09 s (a helper agent's check).  (Nothing
        # is committed through this storage: what is ahead is at most
        # RecordsAhead.MAX_AGE old.)
        start = u64(next) if next is not None else 0
        with self._lock:
            ahead = self._records_ahead
            if ahead is not None:
                record = ahead.take(start)
                if record is not None:
                    return record
            with self._read() as conn:
                record, self._records_ahead = history.record_iternext(
                    self.adapter, conn, next, ahead)
        return record

    def __len__(self):
        with self._read() as conn:
            return self.adapter.count_objects(conn)

    def getSize(self):
        with self._read() as conn:
            return self.adapter.database_size(conn)

    # --- blobs ------------------------------------------------------------

    def loadBlob(self, oid, serial):
        if history.beyond_range(u64(oid), u64(serial)):
            raise POSException.POSKeyError(oid, serial)
        if self._fshelper is not None:
            path = self._fshelper.getBlobFilename(oid, serial)
            if not os.path.exists(path):
                raise POSException.POSKeyError("No blob file for object %s at transaction %s"
                                               % (oid_repr(oid), tid_repr(serial)), path)
            return path
        if self._downloads is None:
            raise POSException.Unsupported("No blob-dir is configured")
        path = os.path.join(self._downloads, '%016x-%016x.blob' % (u64(oid), u64(serial)))
        with self._lock:
            if path in self._downloaded and os.path.exists(path):
                self._downloaded.move_to_end(path)
                return path
        oid_int, tid_int = u64(oid), u64(serial)
        adapter = self.adapter
        fd, temp = tempfile.mkstemp(suffix='.tmp', dir=self._downloads)

        def copy_from(conn):
            count = adapter.blob_chunk_count(conn, oid_int, tid_int)
            for chunk_num in range(count):
                adapter.stream_blob_chunk(conn, oid_int, tid_int, chunk_num, f.write)
            return count or None
        try:
            with os.fdopen(fd, 'wb') as f:
                with self._read() as conn:
                    found = copy_from(conn)
                # Packed away since an open iterator's snapshot began?
                # (zodbconvert reads each blob while it iterates.)
                if not found and not self._iterators.read(copy_from):
                    raise POSException.POSKeyError(
                        "No blob for object %s at transaction %s"
                        % (oid_repr(oid), tid_repr(serial)))
            os.rename(temp, path)
        except BaseException:
            os.remove(temp)
            raise
        self._keep(path)
        return path

    def _keep(self, path):
        """Remember a download; remove the oldest ones past
        DOWNLOADS_KEPT_BYTES, so that a copy of a database's every blob
        does not fill the temporary directory."""
        with self._lock:
            size = os.path.getsize(path)
            self._downloaded_bytes += size - self._downloaded.pop(path, 0)
            self._downloaded[path] = size
            while self._downloaded_bytes > DOWNLOADS_KEPT_BYTES and len(self._downloaded) > 1:
                old, size = self._downloaded.popitem(last=False)
                self._downloaded_bytes -= size
                try:
                    os.remove(old)
                except OSError:
                    pass

    def openCommittedBlobFile(self, oid, serial, blob=None):
        for attempt in range(3):
            path = self.loadBlob(oid, serial)
            try:
                return open(path, 'rb') if blob is None else BlobFile(path, 'r', blob)
            except FileNotFoundError:
                # Removed by another thread's download (_keep) meanwhile.
                if attempt == 2:
                    raise

    def temporaryDirectory(self):
        if self._fshelper is not None:
            return self._fshelper.temp_dir
        return self._downloads

    # --- what a read-only storage refuses -----------------------------------

    def _read_only(self, *args, **kwargs):
        raise POSException.ReadOnlyError()

    new_oid = store = restore = storeBlob = restoreBlob = deleteObject = _read_only
    tpc_begin = tpc_vote = tpc_finish = pack = checkCurrentSerialInTransaction = _read_only

    def tpc_abort(self, transaction):
        pass

    def tpc_transaction(self):
        return None

    # --- the rest of IStorage -----------------------------------------------

    def isReadOnly(self):
        return True

    def supportsUndo(self):
        return False

    def registerDB(self, db):
        pass

    def getName(self):
        return self._name

    def sortKey(self):
        return 'RelStorage:' + self.adapter.describe()

    def __repr__(self):
        return '<%s on %s>' % (type(self).__name__, self.adapter.describe())

    def close(self):
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._iterators.close()
            self.adapter.close()
            if self._downloads is not None:
                shutil.rmtree(self._downloads, ignore_errors=True)
                self._downloads = None

    def cleanup(self):
        pass
