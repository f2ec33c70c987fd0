"""shared-blob-dir true: the directory is the only copy of the blobs.

Files reach their final names by rename in ``finish``, after the tid is
chosen and before the database commits: a crash between the two leaves an
unreferenced file (harmless: a pack removes it where its object exists,
and lists it, leaving it, where it does not), never a committed row
pointing at a missing file, and a rename never exposes half a file.
"""
import errno
import os
import time
import uuid

from ZODB.blob import link_or_copy
from ZODB.blob import rename_or_copy_blob

from ..interfaces import RelStorageError
from .common import BlobMode
from .common import database_holds_blobs
from .common import remove_object_dirs


#: The file that binds a shared blob directory to its database: it names
#: the database's key (Adapter.database_key).  The directory holds the
#: only copies of the blobs, and a pack removes the files of its database
#: that no row keeps, which another database's files there look like.
DATABASE_MARKER = '.relstorage-database'


class SharedBlobs(BlobMode):

    in_database = False
    only_copy = True

    def check_database(self, adapter, key):
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
        if key is not None:
            self.bind(key, adapter.describe())

    def bind(self, key, database):
        """Refuse a directory bound to another database (a helper agent's
        check: a staging database pointed at production's directory packed
        away production's current files); bind an unbound one (new, or
        written by an earlier release) to this database."""
        path = os.path.join(self.blob_dir, DATABASE_MARKER)
        found = _read_key(path)
        if found is None and not self.options.read_only:
            _create(path, 'relstorage database key %x\n' % key)
            found = _read_key(path)
        if found is not None and found != key:
            raise RelStorageError(
                "blob-dir %s holds the blobs of another database (its file %s names "
                "database key %x; %s has %x). A shared blob directory belongs to one "
                "database: its packs remove the files that database does not know. "
                "Point blob-dir at this database's own directory; if these files "
                "really are this database's (a database made again from a backup "
                "that lost its key), delete %s."
                % (self.blob_dir, DATABASE_MARKER, found, database, key, DATABASE_MARKER))

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


def _read_key(path):
    """The key a marker names; None without one.  (A marker being written
    by another process that starts at the same moment is read again.)"""
    for _ in range(50):
        try:
            # (Bytes that are not text name no database either: a review
            # finding, a bare UnicodeDecodeError.)
            with open(path, errors='replace') as f:
                text = f.read()
        except FileNotFoundError:
            return None
        except PermissionError as exc:
            raise RelStorageError(
                "Cannot read %s, which names the database of the shared blob-dir (%s): "
                "every user of the blob-dir needs to read it (written by an earlier "
                "build readable by its owner only: chmod it as the blob files are)"
                % (path, exc.strerror)) from exc
        words = text.split()
        if text.endswith('\n') and words:
            try:
                return int(words[-1], 16)
            except ValueError:
                break
        time.sleep(0.02)
    raise RelStorageError("The file %s does not name a database (%r): delete it, and the "
                          "first storage to open the directory writes it again."
                          % (path, text[:80]))


def _create(path, text):
    """Write ``path`` whole or not at all, unless it exists; with the
    permissions the umask gives, as the directory's other files (a helper
    agent's check: made by mkstemp, it was readable by its owner only, and
    a second system user of a shared blob-dir could not open the storage,
    even read-only, where RelStorage 4.3 worked)."""
    temp = '%s.%s.tmp' % (path, uuid.uuid4().hex)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, 'w') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(temp, path)
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        # (A file system without hard links: created empty and written,
        # which _read_key waits out.)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, 'w') as f:
                f.write(text)
    finally:
        os.remove(temp)


def clear_directory(blob_dir):
    """The database of a shared blob directory was dropped (zodbconvert
    --clear): remove its blob files and the file that bound the directory
    to it (the layout and the temporary directory stay)."""
    remove_object_dirs(blob_dir, ignore_errors=False)
    try:
        os.remove(os.path.join(blob_dir, DATABASE_MARKER))
    except FileNotFoundError:
        pass
