"""What both blob modes share: the layout, and the per-transaction record of
blob files waiting to be committed."""
import logging
import os
import shutil
import tempfile

from ZODB.blob import FilesystemHelper
from ZODB.blob import rename_or_copy_blob
from ZODB.POSException import POSKeyError
from ZODB.utils import p64

log = logging.getLogger(__name__)


class BlobMode:
    """Base of SharedBlobs and CachedBlobs."""

    #: Whether the database holds the bytes (blob_chunk rows).
    in_database = False

    def check_database(self, adapter):
        """Refuse, with an error that says which setting to change, a
        database and a blob-dir that do not go with this mode."""

    def __init__(self, blob_dir, options):
        self.blob_dir = blob_dir
        self.options = options
        # ZODB's bushy layout, so that a shared directory (or a cache) is
        # laid out as ZODB's own blob storages lay it out.
        self.fshelper = FilesystemHelper(blob_dir, 'bushy')
        self.fshelper.create()

    def temporary_directory(self):
        return self.fshelper.temp_dir

    def filename(self, oid_int, tid_int):
        return self.fshelper.getBlobFilename(p64(oid_int), p64(tid_int))

    def begin(self):
        return BlobTransaction(self)

    def take_file(self, oid_int, path):
        """Move ``path`` (ours from now on) into the temporary directory."""
        fd, target = tempfile.mkstemp(prefix='pending-%x-' % oid_int, suffix='.tmp',
                                      dir=self.fshelper.temp_dir)
        os.close(fd)
        rename_or_copy_blob(path, target, chmod=False)
        return target

    def forget(self, removed_oids, kept_revisions):
        """Pack removed objects/revisions: drop their local files.  Returns
        how many blob files were removed."""
        count = 0
        for oid_int in removed_oids:
            path = self.fshelper.getPathForOID(p64(oid_int))
            if os.path.isdir(path):
                count += sum(1 for name in os.listdir(path) if name.endswith('.blob'))
                shutil.rmtree(path, ignore_errors=True)
        for oid_int, keep_tid in kept_revisions:
            path = self.fshelper.getPathForOID(p64(oid_int))
            if not os.path.isdir(path):
                continue
            for name in os.listdir(path):
                if name.endswith('.blob'):
                    try:
                        tid_int = int(name[:-5].replace('0x', ''), 16)
                    except ValueError:
                        continue
                    if tid_int < keep_tid:
                        _remove(os.path.join(path, name))
                        count += 1
        return count

    def forget_all(self):
        """zap_all: drop every object's files (the layout marker and the
        temporary directory stay)."""
        base = self.fshelper.base_dir
        for name in os.listdir(base):
            path = os.path.join(base, name)
            if name.startswith('0x') and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)

    def missing(self, oid_int, tid_int):
        return POSKeyError("No blob for object %x at transaction %x" % (oid_int, tid_int),
                           p64(oid_int), p64(tid_int))


def database_holds_blobs(adapter):
    """Does the database of ``adapter`` hold the bytes of any blob?"""
    conn = adapter.open_load()
    try:
        held = adapter.any_blob_chunk(conn)
        conn.rollback()
    finally:
        conn.close()
    return held


class BlobTransaction:
    """Blob files stored (or copied by undo) in one transaction."""

    def __init__(self, mode):
        self.mode = mode
        self.pending = {}           # oid_int -> temporary path
        self.copies = {}            # oid_int -> tid_int whose blob to reuse (undo)
        self.placed = []            # final files created before the commit

    def __bool__(self):
        return bool(self.pending or self.copies)

    def add(self, oid_int, path):
        old = self.pending.pop(oid_int, None)
        if old:
            _remove(old)
        self.copies.pop(oid_int, None)
        self.pending[oid_int] = self.mode.take_file(oid_int, path)

    def copy(self, oid_int, from_tid):
        old = self.pending.pop(oid_int, None)
        if old:
            _remove(old)
        self.copies[oid_int] = from_tid

    def discard(self):
        for path in self.pending.values():
            _remove(path)
        self.pending.clear()
        self.copies.clear()

    def unplace(self):
        for path in self.placed:
            _remove(path)
        self.placed = []


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError:
        log.warning("Could not remove %s", path, exc_info=True)
