"""shared-blob-dir true: the directory is the only copy of the blobs.

Files reach their final names by rename in ``finish``, after the tid is
chosen and before the database commits: a crash between the two leaves an
unreferenced file (harmless, removed by pack), never a committed row
pointing at a missing file, and a rename never exposes half a file.
"""
import os

from ZODB.blob import link_or_copy
from ZODB.blob import rename_or_copy_blob

from ..interfaces import RelStorageError
from .common import BlobMode
from .common import database_holds_blobs


class SharedBlobs(BlobMode):

    in_database = False
    only_copy = True

    def check_database(self, adapter):
        """Refuse a database that holds blob bytes: its blob-dir is a cache
        of them (shared-blob-dir false), where this mode would look for
        files that a cache need not have, and write blobs no other
        process would find.  Nor a blob-dir marked as a cache (see
        cached.CACHE_MARKER): a process still in cache mode would prune
        the files this mode writes, their only copies (a review finding)."""
        from .cached import CACHE_MARKER
        if os.path.exists(os.path.join(self.blob_dir, CACHE_MARKER)):
            raise RelStorageError(
                "blob-dir %s is marked as a cache of blobs kept in the database (%s): set "
                "shared-blob-dir false, or, if it is really meant to be the shared "
                "directory, delete that file." % (self.blob_dir, CACHE_MARKER))
        if adapter.has_blob_chunk and database_holds_blobs(adapter):
            raise RelStorageError(
                "%s holds blob data, so blob-dir %s is a cache of it: set shared-blob-dir "
                "false (shared-blob-dir true keeps blobs only in a directory shared by "
                "every client)." % (adapter.describe(), self.blob_dir))

    def vote(self, adapter, conn, btxn, tstore):
        pass

    def finish(self, adapter, conn, btxn, tid_int, has_data=True):
        for oid_int, path in sorted(btxn.pending.items()):
            self.fshelper.createPathForOID(oid_int)
            target = self.filename(oid_int, tid_int)
            rename_or_copy_blob(path, target)
            btxn.placed.append(target)
        btxn.pending.clear()
        for oid_int, from_tid in sorted(btxn.copies.items()):
            source = self.filename(oid_int, from_tid)
            if not os.path.exists(source):
                raise self.missing(oid_int, from_tid)
            target = self.filename(oid_int, tid_int)
            link_or_copy(source, target)
            btxn.placed.append(target)

    def committed(self, btxn, tid_int):
        btxn.placed = []

    def load(self, read_chunks, oid_int, tid_int):
        path = self.filename(oid_int, tid_int)
        if not os.path.exists(path):
            raise self.missing(oid_int, tid_int)
        return path

    def open_file(self, read_chunks, oid_int, tid_int, opener):
        try:
            return opener(self.filename(oid_int, tid_int))
        except FileNotFoundError:
            raise self.missing(oid_int, tid_int) from None
