"""What both blob modes share: the layout, and the per-transaction record of
blob files waiting to be committed."""
import errno
import logging
import os
import re
import shutil
import tempfile
import time
import uuid

from ZODB.blob import LAYOUT_MARKER
from ZODB.blob import LAYOUTS
from ZODB.blob import FilesystemHelper
from ZODB.blob import rename_or_copy_blob
from ZODB.POSException import POSKeyError
from ZODB.utils import p64

from ..interfaces import RelStorageError

log = logging.getLogger(__name__)

#: The temporary files of blobs stored by a commit in progress.
PENDING_PREFIX = 'pending-'
#: Seconds after which such a file is taken for a killed process's.
STALE_PENDING_AGE = 24 * 3600
#: The temporary files of blobs being read from the database into a cache
#: (cached.py).  A download writes all the time, so one untouched for six
#: hours was left by a process killed in the middle (a helper agent's
#: check: nothing removed them, and they count in no cache size).  (Not
#: one hour: a process suspended meanwhile, or a blob directory on a file
#: server whose clock is off, would lose a live download: a review
#: finding.)
DOWNLOAD_PREFIX = 'download-'
STALE_DOWNLOAD_AGE = 6 * 3600


#: OS errors of a file system with no room left for a file being written.
_NO_ROOM = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG))


def no_room_error(exc, path, what):
    """For an OSError of a write that found no room (which names no file),
    the same error naming ``path`` and saying ``what`` the file was for,
    else None.  (A helper agent's check: a blob commit or read on a full
    disk failed with a bare "[Errno 28] No space left on device".)"""
    if isinstance(exc, OSError) and exc.errno in _NO_ROOM and not exc.filename:
        return OSError(exc.errno, '%s (%s)' % (exc.strerror, what), path)
    return None


class BlobMode:
    """Base of SharedBlobs and CachedBlobs."""

    #: Whether the database holds the bytes (blob_chunk rows).
    in_database = False

    def check_database(self, adapter, key):
        """Refuse, with an error that says which setting to change, a
        database and a blob-dir that do not go with this mode."""

    def close(self):
        """The storage closes."""

    def renew_locks(self):
        """(relstorage/locks.py) Make the locks this mode shares between
        the storage's instances again, if gevent patched the process since
        they were made."""

    #: Whether blob-dir holds the only copy of the blobs (SharedBlobs).
    only_copy = False

    def __init__(self, blob_dir, options):
        self.blob_dir = blob_dir
        self.options = options
        # ZODB's bushy layout for a new directory, so that a shared
        # directory (or a cache) is laid out as ZODB's own blob storages
        # lay it out; an existing one keeps the layout it has.
        self.fshelper = FilesystemHelper(blob_dir, choose_layout(blob_dir, self.only_copy))
        _create(self.fshelper)
        if not options.read_only:
            self.remove_stale_pending()

    def temporary_directory(self):
        """The directory of blob files being written (ZODB writes a new
        blob's file there); made again when it went (a helper agent's
        check: a cache directory emptied by hand or by tmpreaper while the
        process ran failed every blob read and write until a restart)."""
        temp_dir = self.fshelper.temp_dir
        if not os.path.isdir(temp_dir):
            os.makedirs(temp_dir, 0o700, exist_ok=True)
        return temp_dir

    def filename(self, oid_int, tid_int):
        return self.fshelper.getBlobFilename(p64(oid_int), p64(tid_int))

    def begin(self):
        return BlobTransaction(self)

    def take_file(self, oid_int, path):
        """Move ``path`` (ours from now on) into the temporary directory."""
        fd, target = tempfile.mkstemp(prefix=PENDING_PREFIX + '%x-' % oid_int, suffix='.tmp',
                                      dir=self.temporary_directory())
        os.close(fd)
        try:
            rename_or_copy_blob(path, target, chmod=False)
            # (A rename keeps the file's time: one consumed from a file of
            # last year is not a killed commit's leftover; see
            # remove_stale_pending.)
            os.utime(target)
        except BaseException as exc:
            # (A copy cut short by a full disk: its part would stay, and
            # keep the disk full for the next commit.)
            remove_file(target)
            named = no_room_error(exc, target, 'a blob of the transaction being committed')
            if named is not None:
                raise named from exc
            raise
        return target

    def remove_stale_pending(self, age=STALE_PENDING_AGE, download_age=STALE_DOWNLOAD_AGE):
        """Remove the files that killed processes left in the temporary
        directory (as large as their blobs; nothing else removes them):
        of commits, untouched for ``age`` seconds (another process sharing
        the directory may be committing, and a commit's file waits for its
        vote unchanged), and of reads into a cache, untouched for
        ``download_age`` seconds; None: not those.  Run when the storage
        opens, and (a cache, reads only) each time it is pruned."""
        now = time.time()
        limits = {}
        if age is not None:
            limits[PENDING_PREFIX] = now - age
        if download_age is not None:
            limits[DOWNLOAD_PREFIX] = now - download_age
        removed = 0
        temp_dir = self.fshelper.temp_dir
        try:
            names = os.listdir(temp_dir)
        except OSError:
            return 0
        for name in names:
            limit = limits.get(name.split('-', 1)[0] + '-')
            if limit is None or not name.endswith('.tmp'):
                continue
            path = os.path.join(temp_dir, name)
            try:
                if os.stat(path).st_mtime < limit:
                    os.remove(path)
                    removed += 1
            except OSError:
                continue
        if removed:
            log.info("Removed %d blob files left in %s by commits or reads that never "
                     "finished", removed, temp_dir)
        return removed

    def forget(self, removed_oids, kept_revisions):
        """Pack removed objects/revisions: drop their local files.  Returns
        how many blob files were removed.

        Other processes may share the directory (a cache), forgetting the
        same files at the same moment, or downloading into the same
        object's directory: only files are removed there, and one already
        gone is not an error (a helper agent's check: a directory removed
        by another process between the test and the listing failed polls,
        commits and the pack with FileNotFoundError).  The directories of
        a shared blob-dir (the packing process's alone) go too, and those
        of removed objects in a cache when they are empty."""
        count = 0
        for oid_int in removed_oids:
            path = self.fshelper.getPathForOID(p64(oid_int))
            for name in _listdir(path):
                if name.endswith('.blob') and remove_file(os.path.join(path, name)):
                    count += 1
            if self.only_copy:
                shutil.rmtree(path, ignore_errors=True)
            else:
                # (The object is gone: its directory too, as ZODB's blob
                # storages do, when nothing else is in it.)
                try:
                    os.rmdir(path)
                except OSError:
                    pass
        for oid_int, keep_tid in kept_revisions:
            path = self.fshelper.getPathForOID(p64(oid_int))
            for name in _listdir(path):
                if name.endswith('.blob'):
                    try:
                        tid_int = int(name[:-5].replace('0x', ''), 16)
                    except ValueError:
                        continue
                    if tid_int < keep_tid:
                        remove_file(os.path.join(path, name))
                        count += 1
        return count

    def forget_all(self):
        """zap_all: drop every object's files (the layout marker and the
        temporary directory stay)."""
        remove_object_dirs(self.fshelper.base_dir)

    def missing(self, oid_int, tid_int):
        return POSKeyError("No blob for object 0x%x at transaction 0x%016x" % (oid_int, tid_int),
                           p64(oid_int), p64(tid_int))


#: The layout ZEO's client cache and earlier RelStorage releases' blob
#: caches (shared-blob-dir false) write: ``<oid % 997>/<oid // 997>.<tid
#: in hex>.blob``, which ZODB's FilesystemHelper does not know.
ZEO_CACHE_LAYOUT = 'zeocache'

#: A top-level directory of ZODB's bushy layout (an OID's first byte) or
#: of its lawn layout (one per object, the OID in hex).
_OID_DIR = re.compile(r'^0x[0-9a-f]+$')


def choose_layout(blob_dir, shared):
    """The layout to use for ``blob_dir``: the one its ``.layout`` marker
    names, or bushy for a new directory.

    An existing directory is never re-laid out under the files it holds:
    a shared directory in ZODB's lawn layout (a FileStorage's
    ``blobstorage`` of old, never migrated) is used as it is.  A blob cache
    written by ZEO or by an earlier RelStorage (the ``zeocache`` layout) is
    only a cache of blobs the database holds: its files are removed and the
    cache starts again, empty and bushy.  A cache's layout given to a
    shared directory is refused: its files are not the only copies the
    shared mode expects."""
    marker = os.path.join(blob_dir, LAYOUT_MARKER)
    try:
        with open(marker) as f:
            layout = f.read().strip()
    except FileNotFoundError:
        layout = None
    except (OSError, UnicodeDecodeError) as exc:
        # (A review finding: a marker of other bytes than text raised a
        # bare UnicodeDecodeError.)
        raise RelStorageError("blob-dir %s: cannot read its layout marker %s: %s"
                              % (blob_dir, LAYOUT_MARKER, exc)) from exc
    if layout is None:
        # No marker: bushy, unless the directory is a lawn of ZODB before
        # markers existed (blob files in a directory at the top).
        if shared and _is_lawn(blob_dir):
            layout = 'lawn'
        else:
            return 'bushy'
    if layout == ZEO_CACHE_LAYOUT:
        if shared:
            raise RelStorageError(
                "blob-dir %s is a blob cache (its %s says %r, the layout of ZEO's cache and "
                "of earlier RelStorage releases with shared-blob-dir false), not a shared "
                "blob directory: set shared-blob-dir false to use it as the cache of blobs "
                "kept in the database, or point blob-dir at the shared blob directory"
                % (blob_dir, LAYOUT_MARKER, layout))
        _empty_zeo_cache(blob_dir)
        return 'bushy'
    if layout not in LAYOUTS:
        raise RelStorageError(
            "blob-dir %s: its %s names the layout %r, which this release cannot read "
            "(known: %s)" % (blob_dir, LAYOUT_MARKER, layout, ', '.join(sorted(LAYOUTS))))
    # (ZODB's FilesystemHelper warns of the lawn layout itself.)
    return layout


def _is_lawn(blob_dir):
    # (Any of them: an emptied one says nothing.)
    for name in os.listdir(blob_dir):
        path = os.path.join(blob_dir, name)
        if (_OID_DIR.match(name) and os.path.isdir(path)
                and any(entry.endswith('.blob') for entry in os.listdir(path))):
            return True
    return False


def _empty_zeo_cache(blob_dir):
    """Remove what a ``zeocache`` layout holds (its numbered directories,
    its size-check lock and its marker); leave anything else alone."""
    removed = 0
    for name in os.listdir(blob_dir):
        path = os.path.join(blob_dir, name)
        if name.isdigit() and os.path.isdir(path):
            removed += sum(1 for entry in os.listdir(path) if entry.endswith('.blob'))
            shutil.rmtree(path, ignore_errors=True)
    for name in ('check_size.lock', LAYOUT_MARKER):
        remove_file(os.path.join(blob_dir, name))
    log.warning("blob-dir %s held a blob cache in the %r layout (ZEO's, or an earlier "
                "RelStorage's): its %d blob files were removed, and the cache starts again "
                "in the bushy layout (the database holds every blob)",
                blob_dir, ZEO_CACHE_LAYOUT, removed)


def _create(fshelper):
    """ZODB's FilesystemHelper.create, for processes that open a new
    directory at once (a server's workers starting together): ZODB's
    tests, then makes, its directories (FileExistsError in the second
    process, seen in a test of two caches opening at once) and writes its
    layout marker in place (another process read it empty: "names the
    layout ''").  Made here first, the marker whole and only once."""
    os.makedirs(fshelper.temp_dir, exist_ok=True)
    marker = os.path.join(fshelper.base_dir, LAYOUT_MARKER)
    if not os.path.exists(marker):
        # (Not where there is one: a directory read from read-only media.)
        write_file(marker, fshelper.layout_name, exclusive=True)
    fshelper.create()


def write_file(path, text, exclusive=False):
    """Replace ``path`` with ``text`` at once (readers see the old file or
    the new one, never a part), with the permissions the umask gives.
    ``exclusive``: only if there is no such file (False when there was
    one)."""
    temp = '%s.%s.tmp' % (path, uuid.uuid4().hex)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, 'w') as f:
            f.write(text)
        if exclusive:
            try:
                # A hard link is made whole, and only where no file is.
                os.link(temp, path)
                return True
            except FileExistsError:
                return False
            except OSError:
                # (A file system without hard links: the second of two
                # processes that get here at once replaces the first's.)
                if os.path.exists(path):
                    return False
        os.replace(temp, path)
        return True
    finally:
        remove_file(temp)



def database_holds_blobs(adapter):
    """Does the database of ``adapter`` hold the bytes of any blob?  Asked
    of the server commits go to: a read-only replica of a new database may
    not have replayed the schema yet when the storage opens (seen in CI:
    the first open with ro-replica-conf and a blob-dir failed with
    "relation blob_chunk does not exist")."""
    conn = adapter.open_primary_load()
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
            remove_file(old)
        self.copies.pop(oid_int, None)
        self.pending[oid_int] = self.mode.take_file(oid_int, path)

    def copy(self, oid_int, from_tid):
        old = self.pending.pop(oid_int, None)
        if old:
            remove_file(old)
        self.copies[oid_int] = from_tid

    def discard(self):
        for path in self.pending.values():
            remove_file(path)
        self.pending.clear()
        self.copies.clear()

    def unplace(self):
        for path in self.placed:
            remove_file(path)
        self.placed = []


def remove_object_dirs(blob_dir, ignore_errors=True):
    """Remove every object's directory (``0x...``) of ``blob_dir``; its
    layout marker and temporary directory stay."""
    for name in _listdir(blob_dir):
        path = os.path.join(blob_dir, name)
        if name.startswith('0x') and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=ignore_errors)


def _listdir(path):
    """The names in a directory; none if it is not there (any more)."""
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def remove_file(path):
    """Whether ``path`` is gone now; one that cannot be removed is logged,
    not an error."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError:
        log.warning("Could not remove %s", path, exc_info=True)
        return False
    return True
