"""shared-blob-dir true: the directory is the only copy of the blobs.

Files reach their final names by rename in ``finish``, after the tid is
chosen and before the database commits: a crash between the two leaves an
unreferenced file (harmless, removed by pack), never a committed row
pointing at a missing file, and a rename never exposes half a file.
"""
import os

from ZODB.blob import link_or_copy
from ZODB.blob import rename_or_copy_blob

from .common import BlobMode


class SharedBlobs(BlobMode):

    in_database = False

    def vote(self, adapter, conn, btxn, tstore):
        pass

    def finish(self, adapter, conn, btxn, tid_int):
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
