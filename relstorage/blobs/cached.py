"""shared-blob-dir false: blob bytes live in the database; blob-dir caches them.

Upload (vote) and download (loadBlob) move ``blob-chunk-size`` bytes at a
time, one statement per chunk, so a blob of several GB never sits in
memory.  A download is written to a temporary file in the cache and renamed
to its final name only when complete: a reader never sees a short file, and
an interrupted download leaves only a temporary file that readers ignore.

With a shared cache (``cache-servers``), a blob of at most
``shared.MAX_VALUE`` bytes read from the database is also put there, under
its (oid, tid), and other processes download it from there instead of
reading its chunks from the database.  A blob revision never changes, so
nothing there can become wrong.

The cache is bounded by ``blob-cache-size``: once the bytes added since the
last check pass ``blob-cache-size-check`` percent of it, the least recently
used files are removed until the cache is at 90 % of the limit.  Several
processes may share the directory: pruning takes a lock file, deletes only
final ``.blob`` files (never temporary ones being written), and readers
that lose a race with pruning simply download again.  A process runs one
prune at a time; a check that comes while it runs, or while another
process holds the lock, makes it prune again once that one is done (a
helper agent's check: a prune that found the lock held gave up, and the
files renamed into place after the other prune had counted stayed over
the limit until the next read).  Closing the storage finishes a prune
under way, which its daemon thread might not.
"""
import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from ZODB.blob import rename_or_copy_blob

from .. import locks
from ..cache.shared import MAX_VALUE
from ..interfaces import RelStorageError
from ..options import blob_chunk_bytes
from .common import DOWNLOAD_PREFIX
from .common import no_room_error
from .common import BlobMode
from .common import database_holds_blobs
from .common import remove_file
from .common import remove_object_dirs
from .common import write_file as _write_file

log = logging.getLogger(__name__)

#: The file that marks a blob-dir as a cache (see check_database); its
#: last line names the database whose blobs it caches (CACHE_KEY_LINE).
CACHE_MARKER = '.relstorage-blob-cache'
CACHE_MARKER_TEXT = ('This directory is a cache of blobs kept in a database '
                     '(RelStorage, shared-blob-dir false): its files may be removed.\n')
CACHE_KEY_LINE = 'database key %x\n'
#: The file naming the pack mark (adapters/sql.py, commit_lock) up to
#: which the files that packs removed are gone from the cache (see
#: catch_up).
PACK_MARK_FILE = '.relstorage-pack-mark'
#: Seconds during which a file the cache handed out (a path from loadBlob,
#: which ZODB's Blob.committed() returns for the caller to open later) or
#: took in is not pruned: a prune for a blob larger than the whole cache
#: removed every file, that one included, before its caller opened it (a
#: helper agent's check; Plone streams a blob from that path).  Files
#: kept for it are pruned once it has passed.
PRUNE_GRACE = 2.0


class CachedBlobs(BlobMode):

    in_database = True

    def __init__(self, blob_dir, options, shared=None, adapter=None):
        super().__init__(blob_dir, options)
        self.shared = shared
        # (Warned about at open, the database's limit included.)
        self.chunk_size = blob_chunk_bytes(
            options, limit=getattr(adapter, 'blob_chunk_max', None),
            database=adapter.describe() if adapter is not None else None)
        self.cache_size = options.blob_cache_size
        check = options.blob_cache_size_check or 10
        # (At least a byte: a small size made it 0, which meant "never
        # check", an unlimited cache: a helper agent's check.)
        self._check_every = max(1, self.cache_size * check // 100) if self.cache_size else None
        self._added = 0
        self._grew = False          # this process added files since it opened
        self._lock = threading.Lock()
        self._locks_made_with = locks.made_now(self)
        self._pruning = False       # this process's prune is running
        self._prune_again = False   # and a check came meanwhile
        self._prune_thread = None
        self._closed = False        # the storage closed: no more prunes here
        self._to_forget = []        # (removed oids or None: all, kept revisions, mark)
        self._forgetting = False
        _CACHES.add(self)
        # The pack mark up to which what packs removed is gone (or queued
        # to go) from the cache; None before catch_up.
        self.mark = None
        self._mark_written = None

    def renew_locks(self):
        """(relstorage/locks.py)"""
        if locks.stale(self):
            self._lock = threading.Lock()

    def after_fork_in_child(self):
        """In a child process just forked (os.register_at_fork): the
        parent's prune and forget threads are not here (a review finding:
        a child forked while its parent pruned took the prune for running
        for good, and its cache grew without bound), and the lock may have
        been held by one of them.  What the parent queued to forget goes
        with the next queue's thread."""
        self._lock = threading.Lock()
        self._pruning = self._prune_again = False
        self._prune_thread = None
        self._forgetting = False

    def check_database(self, adapter, key):
        """Refuse a blob-dir that holds blob files while the database holds
        no blob bytes at all, unless it is marked as a cache
        (CACHE_MARKER): the only copies of those blobs, as a shared blob
        directory keeps them, which this mode would take for a cache and
        prune (a configuration that relied on shared-blob-dir being true
        by default, as it was in development builds of this release, would
        lose its blobs that way).  A cache is marked when first opened, so
        that one left with files after zap_all, drop_all or a pack that
        removed the last blob is still known for what it is."""
        marker = os.path.join(self.blob_dir, CACHE_MARKER)
        if not os.path.exists(marker):
            held = database_holds_blobs(adapter)
            found = None if held else _first_blob_file(self.blob_dir)
            if found is not None:
                raise RelStorageError(
                    "blob-dir %s holds blob files (%s), but %s holds no blob data: it "
                    "looks like a shared blob directory, whose files are the only copies. "
                    "With shared-blob-dir false it would be used as a cache and pruned. "
                    "Set shared-blob-dir true to keep using it as it is, or, if it is an "
                    "old cache, empty it." % (self.blob_dir, found, adapter.describe()))
        self._bind(marker, key, adapter.describe())
        self.catch_up(adapter)
        if self._check_every:
            # Over its size already (left so by the processes before, or by
            # a prune that gave up while files were in use): a process that
            # only reads files the cache has adds none, and never pruned (a
            # helper agent's check: 142 MB in a cache of 4 MB).
            self._request_prune()

    def _bind(self, marker, key, database):
        """Refuse a cache of another database's blobs: files are named by
        OID and tid alone, and two databases with the same pair (a copy
        restored with its tids, a database ahead of the clock) served each
        other's bytes (a helper agent's check).  A cache without a key (new,
        or of an earlier release) is bound to this database."""
        found = _marker_key(marker)
        if found is None and key is not None:
            # Made at once with its key, or not at all (a review finding:
            # two processes of different databases opening a new cache
            # together both bound it, each writing its own key); then read
            # again: another process's, or an earlier release's without a
            # key, bound here while no other process of ours reads it (the
            # same race, in a cache an earlier release made: a helper
            # agent's reading).
            if _write_file(marker, CACHE_MARKER_TEXT + CACHE_KEY_LINE % key,
                           exclusive=True):
                return
            with _locked_directory(self.blob_dir):
                found = _marker_key(marker)
                if found is None:
                    _write_file(marker, CACHE_MARKER_TEXT + CACHE_KEY_LINE % key)
                    return
        if found is not None and key is not None and found != key:
            raise RelStorageError(
                "blob-dir %s is the blob cache of another database (its file %s names "
                "database key %x; %s has %x). Its files are named by object and "
                "transaction only, which another database may reuse for other bytes: "
                "give each database a blob-dir of its own. If this database was made "
                "again at the same place (dropped and created), empty the directory: "
                "it is only a cache."
                % (self.blob_dir, CACHE_MARKER, found, database, key))
        if found is None and (key is not None or not os.path.exists(marker)):
            _write_file(marker, CACHE_MARKER_TEXT
                        + (CACHE_KEY_LINE % key if key is not None else ''))

    # --- what packs removed -------------------------------------------------

    def catch_up(self, adapter):
        """When the storage opens: drop the files that packs removed while
        no process using this directory was there to learn of it (a helper
        agent's check: a process started after a pack served a removed
        revision from the cache, where the storage raises POSKeyError).
        The directory names the pack mark it is current with
        (PACK_MARK_FILE); the removal lists of the marks since (kept until
        the next pack) say what goes, or, without them, every file.

        Read on the server commits go to, never a read-only replica: one
        behind the packs the directory has seen made it look like a
        database restored from a backup, and every file of a cache other
        processes share went (a review finding); one of a new database may
        lack the schema still.  A later poll of a replica behind this mark
        is then not news (note_pack_mark)."""
        seen = _read_mark(os.path.join(self.blob_dir, PACK_MARK_FILE))
        conn = adapter.open_primary_load()
        try:
            adapter.begin_snapshot(conn)
            mark = adapter.pack_mark(conn)
            removed = None
            if seen is not None and seen < mark:
                removed = adapter.pack_removals(conn, seen, mark)
        finally:
            conn.rollback()
            conn.close()
        with self._lock:
            self.mark = mark
        if seen == mark:
            self._mark_written = mark
        elif seen is None:
            # (New, or made by an earlier release, which named no mark:
            # taken as it is, as that release did.)
            self._write_mark(mark)
        else:
            # Packs since (their lists say what went; without them, all
            # goes), or a mark beyond the database's (restored from a
            # backup: all goes).
            self._queue_forget(None if removed is None else removed.garbage_ints(),
                               () if removed is None else removed.trimmed_pairs(), mark)

    def note_pack_mark(self, mark, removals):
        """A poll saw pack mark ``mark``; ``removals(after, upto)`` lists
        what the pack batches of those marks removed (None: no lists, or
        None for anything may be gone), on the poll's connection.  What
        they removed goes from the cache in a thread of its own: polls
        learn of each pack batch, and a file system call per removed
        object (in every process) has no place in them.  Until then a
        removed revision may still be served from here, as before the
        pack."""
        with self._lock:
            previous = self.mark
            if previous is not None and mark <= previous:
                return
            self.mark = mark
        removed = None
        if previous is not None and removals is not None:
            removed = removals(previous, mark)
        self._queue_forget(None if removed is None else removed.garbage_ints(),
                           () if removed is None else removed.trimmed_pairs(), mark)

    # --- commit -------------------------------------------------------------

    def vote(self, adapter, conn, btxn, tstore):
        # (commit.vote has emptied temp_blob_chunk if a commit left rows.)
        # (Within the database's limit since the open, which warned.)
        size = min(self.chunk_size, adapter.blob_chunk_max)
        for oid_int, path in sorted(btxn.pending.items()):
            with open(path, 'rb') as f:
                chunk_num = 0
                while True:
                    data = f.read(size)
                    if not data and chunk_num:
                        break
                    adapter.upload_blob_chunk(conn, oid_int, chunk_num, data)
                    chunk_num += 1
                    if len(data) < size:
                        break

    def finish(self, adapter, conn, btxn, tid_int, has_data=True):
        adapter.move_blobs_into_place(conn, tid_int, has_uploads=bool(btxn.pending),
                                      has_data=has_data)
        for oid_int, from_tid in sorted(btxn.copies.items()):
            adapter.copy_blob(conn, oid_int, from_tid, tid_int)

    def committed(self, btxn, tid_int):
        # The uploaded files are now committed content: keep them as cache
        # entries instead of downloading them again.
        # Called by tpc_finish after the COMMIT: nothing may fail it.  (A
        # helper agent's check: a full file system failed the directory's
        # creation, which ZODB's createPathForOID raises as an
        # AssertionError, out of tpc_finish: the transaction manager then
        # aborted the other databases of a committed transaction.)  A file
        # not cached is downloaded when read.
        for oid_int, path in btxn.pending.items():
            try:
                self.fshelper.createPathForOID(oid_int)
                size = os.path.getsize(path)
                # (Used now, for PRUNE_GRACE: a file written long before
                # was pruned between its rename and its chmod, which
                # logged a warning with a traceback.)
                _touch(path)
                rename_or_copy_blob(path, self.filename(oid_int, tid_int))
                self._note_added(size)
            except FileNotFoundError:
                # (Pruned by another process all the same: read again
                # when asked for.)
                log.debug("A committed blob left the blob cache %s at once",
                          self.fshelper.base_dir, exc_info=True)
                remove_file(path)
            except Exception:  # pylint:disable=broad-except
                log.warning("Could not keep committed blob %s in the blob cache %s",
                            path, self.fshelper.base_dir, exc_info=True)
                remove_file(path)
        btxn.pending.clear()

    # --- reading --------------------------------------------------------------

    def load(self, read_chunks, oid_int, tid_int):
        """The path of blob (oid, tid) in the cache, downloaded first with
        ``read_chunks(oid, tid, write)`` (which returns the size, or None
        when the blob does not exist) when it is not there."""
        path = self.filename(oid_int, tid_int)
        try:
            # Touched, not only found: a prune spares what was used in the
            # last PRUNE_GRACE seconds, and one that removed it between a
            # look and the touch gave the caller a path to nothing (a
            # helper agent's check).
            os.utime(path)
            return path
        except FileNotFoundError:
            return self.download(read_chunks, oid_int, tid_int)
        except OSError:
            # (Not ours to touch, on a read-only medium: still readable.)
            if os.path.exists(path):
                return path
            return self.download(read_chunks, oid_int, tid_int)

    def open_file(self, read_chunks, oid_int, tid_int, opener):
        """``opener(path)`` of blob (oid, tid) in the cache, downloaded
        first when it is not there.  A file once open stays readable when
        a prune removes it; opening the path ``load`` returns may come too
        late, as a cache smaller than the blobs read at once prunes every
        file as soon as it is added (a helper agent's check: readers got
        FileNotFoundError, retries included)."""
        path = self.filename(oid_int, tid_int)
        try:
            opened = opener(path)
        except FileNotFoundError:
            return self.download(read_chunks, oid_int, tid_int, opener)
        _touch(path)
        return opened

    def download(self, read_chunks, oid_int, tid_int, opener=None):
        """Fetch blob (oid, tid) into the cache; its path, or, with an
        ``opener``, ``opener(path)`` called before anything can prune it."""
        path = self.filename(oid_int, tid_int)
        self.fshelper.createPathForOID(oid_int)
        fd, temp = tempfile.mkstemp(prefix=DOWNLOAD_PREFIX, suffix='.tmp',
                                    dir=self.temporary_directory())
        opened = None
        try:
            with os.fdopen(fd, 'wb') as f:
                size = self._read(read_chunks, oid_int, tid_int, f.write)
                if size is None:
                    raise self.missing(oid_int, tid_int)
                f.flush()
                os.fsync(f.fileno())
            # Read-only before it gets its final name: once renamed, a
            # concurrent prune may remove it at any moment.  Its owner's
            # only, as ZODB leaves a committed file (0o444 gave everyone
            # what the umask was meant to keep: a helper agent's check).
            os.chmod(temp, 0o400)
            if opener is not None:
                opened = opener(temp)
                _rename(opened, path)
            for attempt in (1, 2, 3):
                try:
                    os.rename(temp, path)
                    break
                except FileNotFoundError:
                    # The object's directory went meanwhile (a helper
                    # agent's check: a pack's clean-up of the cache in
                    # another process removed it while this download ran).
                    if attempt == 3 or not os.path.exists(temp):
                        raise
                    self.fshelper.createPathForOID(oid_int)
            self._note_added(size)
        except BaseException as exc:
            if opened is not None:
                opened.close()
            remove_file(temp)
            named = no_room_error(exc, temp, 'a blob read from the database into the '
                                  'blob cache')
            if named is not None:
                raise named from exc
            raise
        return path if opener is None else opened

    def _read(self, read_chunks, oid_int, tid_int, write):
        """Stream the blob to ``write``, from the shared cache when it has
        it, else with ``read_chunks(oid, tid, write)`` from the database;
        its size, or None if absent."""
        shared = self.shared
        if shared is None:
            return read_chunks(oid_int, tid_int, write)
        data = shared.get_blob(oid_int, tid_int)
        if data is not None:
            write(data)
            return len(data)
        small = _KeepSmall(write, MAX_VALUE)
        size = read_chunks(oid_int, tid_int, small.write)
        if size is not None and small.pieces is not None:
            shared.set_blob(oid_int, tid_int, b''.join(small.pieces))
        return size

    # --- the size bound ---------------------------------------------------

    def _note_added(self, size):
        if not self._check_every:
            return
        with self._lock:
            self._grew = True
            self._added += size
            if self._added < self._check_every:
                return
            self._added = 0
        self._request_prune()

    def _request_prune(self):
        """Prune in the background (or note that the prune running is to
        look again when it is done)."""
        with self._lock:
            if self._closed:
                return
            if self._pruning:
                self._prune_again = True
                return
            self._pruning = True
        # (A prune that cannot start must not fail the read or the commit
        # that added the file: the next one tries again.)
        try:
            if self.options.blob_cache_size_check_external:
                # One child at a time, waited for by a thread (not by
                # close: the child goes on alone), which says why it
                # failed.  (A helper agent's check: a child started at
                # every check, up to 21 at once; and one that could not
                # import relstorage, found through a sys.path set in the
                # application's script as buildout's are, failed unseen.)
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                    [path for path in sys.path if path]))
                child = subprocess.Popen([sys.executable, '-m', 'relstorage.blobs.cached',
                                          self.blob_dir, str(self.cache_size)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         env=env)
                threading.Thread(target=self._wait_for_external_prune, args=(child,),
                                 name='relstorage-blob-prune', daemon=True).start()
            else:
                thread = threading.Thread(target=self._prune_until_done,
                                          name='relstorage-blob-prune', daemon=True)
                with self._lock:
                    self._prune_thread = thread
                thread.start()
        except (OSError, RuntimeError) as exc:
            with self._lock:
                self._pruning = False
            log.warning("Could not start pruning the blob cache %s: %s", self.blob_dir, exc)

    def _wait_for_external_prune(self, child):
        _, err = child.communicate()
        if child.returncode:
            lines = err.decode('utf-8', 'replace').strip().splitlines()
            log.warning("The process pruning the blob cache %s failed (exit status %s): %s",
                        self.blob_dir, child.returncode, lines[-1] if lines else '')
        with self._lock:
            again = self._prune_again and not self._closed
            self._pruning = self._prune_again = False
        if again:
            self._request_prune()

    def _prune_until_done(self):
        try:
            # (A process that runs for months opens its storage once.  Not
            # the files of commits: one of this process's may be a day old,
            # a review finding.)
            self.remove_stale_pending(age=None)
            while True:
                # (Waits for another process's prune, then counts again.)
                prune(self.blob_dir, self.cache_size, wait=True, again=PRUNE_AGAIN,
                      stop=self._is_closed)
                with self._lock:
                    if not self._prune_again or self._closed:
                        self._pruning = False
                        return
                    self._prune_again = False
        except BaseException:
            with self._lock:
                self._pruning = False
                closed = self._closed
            # (After the close, its directory may be gone: the tests' is.)
            log.log(logging.DEBUG if closed else logging.WARNING,
                    "Pruning the blob cache %s failed", self.blob_dir, exc_info=True)

    def _is_closed(self):
        return self._closed

    def _queue_forget(self, removed_oids, kept_revisions, mark):
        """Drop the files of ``removed_oids`` and the revisions older than
        ``kept_revisions`` (every file, with ``removed_oids`` None) in the
        forgetting thread, which then names ``mark`` in PACK_MARK_FILE."""
        with self._lock:
            self._to_forget.append((None if removed_oids is None else list(removed_oids),
                                    list(kept_revisions), mark))
            if self._forgetting:
                return
            self._forgetting = True
        try:
            threading.Thread(target=self._forget_queued, name='relstorage-blob-forget',
                             daemon=True).start()
        except RuntimeError:        # (interpreter shutting down)
            with self._lock:
                self._forgetting = False

    def _forget_queued(self):
        while True:
            with self._lock:
                if not self._to_forget:
                    self._forgetting = False
                    return
                removed_oids, kept_revisions, mark = self._to_forget.pop(0)
            try:
                if removed_oids is None:
                    self._forget_all_files()
                else:
                    self.forget(removed_oids, kept_revisions)
            except OSError:
                log.warning("Could not drop the blob files a pack removed from %s",
                            self.blob_dir, exc_info=True)
            else:
                self._write_mark(mark)

    def _write_mark(self, mark):
        """Name ``mark`` in PACK_MARK_FILE, unless this process named it or
        a greater one.  (Two processes writing at once may leave the lower
        mark: the next process to open forgets those lists again.)"""
        if mark is None or (self._mark_written is not None and mark <= self._mark_written):
            return
        try:
            _write_file(os.path.join(self.blob_dir, PACK_MARK_FILE), '%d\n' % mark)
        except OSError as exc:
            log.warning("Could not write the pack mark of the blob cache %s: %s",
                        self.blob_dir, exc)
        else:
            self._mark_written = mark

    def _forget_all_files(self):
        """Every cached blob file goes; the directories stay: a download
        of this or another process may be making one at this moment (CI:
        ZODB's createPathForOID asserts the directory it made exists, and
        a removal between failed a read of the zapped database)."""
        temp_dir = os.path.join(self.blob_dir, 'tmp')
        for dirpath, dirnames, filenames in os.walk(self.blob_dir):
            if dirpath == temp_dir:
                dirnames[:] = []
                continue
            for name in filenames:
                if name.endswith('.blob'):
                    remove_file(os.path.join(dirpath, name))

    def close(self):
        """The storage closes: this process's prune stops, once done with
        the walk it is in (it no longer waits for another process's, nor
        tries again); if this process added files, the close waits for that
        walk (the thread, a daemon, may be cut short at exit).  What is
        left over the size, the next process's prune at open removes.  (A
        review finding: with the prune at open, every storage's close
        walked the cache, twice, and waited without limit for another
        process's prune: 1.2 s for a cache of 100,000 files, 14 s behind
        another prune, for a script that only read.)"""
        with self._lock:
            self._closed = True
            thread = self._prune_thread if self._pruning and self._grew else None
        if thread is not None and thread is not threading.current_thread():
            thread.join()


class _KeepSmall:
    """Passes pieces on to ``write``, keeping them as long as their total
    stays within ``limit`` (``pieces`` None past it)."""

    def __init__(self, write, limit):
        self._write = write
        self._left = limit
        self.pieces = []

    def write(self, data):
        self._write(data)
        if self.pieces is not None:
            self._left -= len(data)
            if self._left < 0:
                self.pieces = None
            else:
                self.pieces.append(bytes(data))


def _first_blob_file(blob_dir):
    """A ``.blob`` file under ``blob_dir`` (not a temporary one), or None."""
    for dirpath, dirnames, filenames in os.walk(blob_dir):
        if dirpath == os.path.join(blob_dir, 'tmp'):
            dirnames[:] = []
            continue
        for name in filenames:
            if name.endswith('.blob'):
                return os.path.join(dirpath, name)
    return None


def _rename(opened, path):
    """Give the file object opened on a download's temporary file the
    name it is about to have, as a file opened in the cache has."""
    target = getattr(opened, 'raw', opened)     # open(..., 'rb'): its FileIO
    try:
        target.name = path
    except AttributeError:
        pass


def clear_directory(blob_dir):
    """The database of this cache was dropped (zodbconvert --clear): its
    files go, and the files that bound the directory to it, which would
    refuse the new database (the layout and the temporary directory
    stay)."""
    remove_object_dirs(blob_dir, ignore_errors=False)
    for name in (CACHE_MARKER, PACK_MARK_FILE):
        try:
            os.remove(os.path.join(blob_dir, name))
        except FileNotFoundError:
            pass


def _marker_key(path):
    """The database key CACHE_MARKER names; None without one (or without
    the file)."""
    try:
        with open(path, errors='replace') as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    prefix = CACHE_KEY_LINE.split('%', 1)[0]
    for line in lines:
        if line.startswith(prefix):
            try:
                return int(line[len(prefix):], 16)
            except ValueError:
                return None
    return None


def _read_mark(path):
    """The pack mark PACK_MARK_FILE names; None without one."""
    try:
        with open(path, errors='replace') as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked_directory(path):
    """An exclusive flock of directory ``path`` for the block, shared with
    every process of ours binding a cache there (where the file system
    does not lock, none)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)


def _touch(path):
    try:
        os.utime(path)
    except OSError:
        pass


#: The blob caches of this process, for the fork hook below.
_CACHES = weakref.WeakSet()


def _after_fork_in_child():
    for cache in list(_CACHES):
        cache.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


#: How often (seconds) a prune that waits for another process's looks again.
PRUNE_LOCK_POLL = 0.05

#: How many times a prune that kept files for PRUNE_GRACE beyond the
#: limit waits for it to pass and prunes again (in its thread, or the
#: external process).
PRUNE_AGAIN = 3


def prune(blob_dir, limit, wait=False, again=0, stop=None):
    """Remove least recently used cached blobs until under 90 % of ``limit``,
    but those used in the last PRUNE_GRACE seconds; while they keep the
    cache over ``limit``, wait for them to age and prune again, up to
    ``again`` times.  Returns how many files it removed.

    Without ``wait``, returns at once when another thread or process is
    already pruning the directory.  ``stop`` (a function) returning true
    ends it before it waits or tries again.
    """
    removed = 0
    for attempt in range(again + 1):
        count, retry_after = _prune_once(blob_dir, limit, wait, stop)
        removed += count
        # (Not after the last: it slept for nothing, and a storage's close
        # waited for its prune thread to wake up.)
        if not retry_after or attempt == again or not _slept(retry_after, stop):
            break
    return removed


def _slept(seconds, stop):
    """Sleep ``seconds``, in short steps when ``stop`` (a function) may end
    the sleep first; False when it did, or says so at the end."""
    if stop is None:
        time.sleep(seconds)
        return True
    until = time.time() + seconds
    while not stop() and time.time() < until:
        time.sleep(min(PRUNE_LOCK_POLL, max(0, until - time.time())))
    return not stop()


def _prune_once(blob_dir, limit, wait, stop=None):
    """One prune: (files removed, seconds until the files it kept for
    PRUNE_GRACE beyond ``limit`` may go, or 0)."""
    lock_path = os.path.join(blob_dir, '.prune.lock')
    with open(lock_path, 'a') as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not wait or (stop is not None and stop()):
                    return 0, 0         # another process is pruning right now
                # Waited for in short sleeps, not in a blocking flock: in a
                # process gevent has patched, the prune thread is a
                # greenlet, and a blocking call stopped every other one for
                # as long as another process pruned (a review finding: 4 s).
                time.sleep(PRUNE_LOCK_POLL)
        try:
            files = []
            total = 0
            for dirpath, dirnames, filenames in os.walk(blob_dir):
                if os.path.basename(dirpath) == 'tmp' and dirpath == os.path.join(blob_dir, 'tmp'):
                    dirnames[:] = []
                    continue
                for name in filenames:
                    if not name.endswith('.blob'):
                        continue
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.stat(path)
                    except FileNotFoundError:
                        continue
                    files.append((max(st.st_atime, st.st_mtime), st.st_size, path))
                    total += st.st_size
            target = limit * 9 // 10
            removed = 0
            retry_after = 0
            if total > limit:
                files.sort()
                fresh = time.time() - PRUNE_GRACE
                for used, size, path in files:
                    if total <= target:
                        break
                    if used > fresh:
                        # (The rest too: sorted by use.)
                        if total > limit:
                            retry_after = min(PRUNE_GRACE, used - fresh + 0.05)
                        break
                    remove_file(path)
                    total -= size
                    removed += 1
            log.debug("Pruned %d blob files from %s; %d bytes remain", removed, blob_dir, total)
            return removed, retry_after
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


if __name__ == '__main__':
    # blob-cache-size-check-external: python -m relstorage.blobs.cached DIR LIMIT
    started = time.time()
    prune(sys.argv[1], int(sys.argv[2]), wait=True, again=PRUNE_AGAIN)
