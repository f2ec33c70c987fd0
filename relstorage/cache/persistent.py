"""The local cache saved to a file (``cache-local-dir``) and loaded at start.

File layout (big-endian)::

    b'RSLCACHE'  version:u32  last_tid:u64  count:u64  database_key:u64
    pack_mark:u64
    count x (oid:u64  tid:u64  length:u32  state)
    crc32 of everything before it:u32

(Version 1 had no ``database_key``, versions 1 and 2 no ``pack_mark``:
read as 0.)  ``last_tid`` is the newest transaction the writers had seen;
``database_key`` the key of the database they read (Adapter.database_key),
0 if they knew none; ``pack_mark`` the pack mark they had seen (a file of
another mark is replaced, not merged).  A
file is trusted only as far as the database confirms it:

- a file of another database (another key, both known: a database dropped
  and made again at the same place, ``zodbconvert --clear``) is ignored
  entirely: a copy made with the same tids would otherwise confirm every
  entry of the old contents (a helper agent's check);
- a file whose ``last_tid`` is after the database's last transaction was
  written against a history the database no longer has (restored from an
  older backup): it is ignored entirely;
- so is a file from before a ``zap_all`` (which moves the pack mark on
  without a list of what it removed, see Adapter.pack_removals): a copy
  made into the emptied database with the same tids would confirm every
  entry of the old contents (a helper agent's check), as would a file whose
  pack mark the database has not reached; so, for want of the lists, is a
  file older than the last pack but one;
- every other entry is checked against the database in bulk, one
  ``current_tids`` query per ``VALIDATE_BATCH`` objects, and kept only if
  its tid is still the object's current one;
- a truncated or corrupt file (bad magic, version, length or checksum) is
  ignored.

Several processes may share the directory: writers take an exclusive
``flock`` on ``<file>.lock``, merge what the file already holds with their
own entries (newest tid per object wins; the merged ``last_tid`` is the
maximum, so a file mixing histories is discarded as a whole; a file of
another database is replaced, not merged), write a
temporary file in the same directory and rename it over the old one.
Readers never see a half-written file.
"""
import collections
import logging
import os
import struct
import tempfile
import zlib

from ..tids import tid_of_time

try:
    import fcntl
except ImportError:  # pragma: no cover (Windows)
    fcntl = None

log = logging.getLogger(__name__)

MAGIC = b'RSLCACHE'
VERSION = 3
HEADER = struct.Struct('>8sIQQQQ')
HEADER_V2 = struct.Struct('>8sIQQQ')
HEADER_V1 = struct.Struct('>8sIQQ')
RECORD = struct.Struct('>QQI')
TRAILER = struct.Struct('>I')
VALIDATE_BATCH = 500
SUFFIX = '.rscache'


class CacheFileError(Exception):
    """The file is not a complete cache file of our format."""


#: What read_file returns: ``entries`` is [(oid, tid, state), ...].
CacheFile = collections.namedtuple('CacheFile', 'last_tid entries database_key pack_mark version')


def cache_path(directory, prefix):
    return os.path.join(directory, prefix + SUFFIX)


def read_file(path):
    """A CacheFile, or None if there is no file.

    Raises CacheFileError for a damaged file.
    """
    try:
        with open(path, 'rb') as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if len(data) < HEADER_V1.size + TRAILER.size:
        raise CacheFileError('too short')
    magic, version, last_tid, count = HEADER_V1.unpack_from(data, 0)
    if magic != MAGIC or version not in (1, 2, VERSION):
        raise CacheFileError('not a cache file of version %d' % VERSION)
    header = {1: HEADER_V1, 2: HEADER_V2}.get(version, HEADER)
    if len(data) < header.size + TRAILER.size:
        raise CacheFileError('too short')
    fields = header.unpack_from(data, 0)
    key = fields[4] if version != 1 else 0
    mark = fields[5] if version == VERSION else 0
    body_end = len(data) - TRAILER.size
    (crc,) = TRAILER.unpack_from(data, body_end)
    if zlib.crc32(memoryview(data)[:body_end]) != crc:
        raise CacheFileError('checksum mismatch')
    entries = []
    pos = header.size
    for _ in range(count):
        if pos + RECORD.size > body_end:
            raise CacheFileError('truncated')
        oid, tid, length = RECORD.unpack_from(data, pos)
        pos += RECORD.size
        if pos + length > body_end:
            raise CacheFileError('truncated')
        entries.append((oid, tid, data[pos:pos + length]))
        pos += length
    if pos != body_end:
        raise CacheFileError('trailing garbage')
    return CacheFile(last_tid, entries, key, mark, version)


def _temp_prefix(path):
    """Names of the temporary files a save of ``path`` writes: of this
    cache file only, so that a save (which holds that file's lock) may
    remove the ones a killed process left, and never another file's."""
    return '.tmp-%s-' % os.path.basename(path)


def _remove_leftovers(path):
    """Remove the temporary files of ``path`` a process killed while
    saving left (each as large as the cache file).  Only under the file's
    lock: no other save of it is writing one."""
    directory = os.path.dirname(path) or '.'
    start = _temp_prefix(path)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(start) and name.endswith(SUFFIX):
            try:
                os.unlink(os.path.join(directory, name))
                log.info("Removed %s, left by a process that stopped while saving "
                         "its cache", name)
            except OSError:
                pass


def _write_file(path, last_tid, entries, key, mark=0):
    directory = os.path.dirname(path) or '.'
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, 'wb') as f:
            crc = 0
            chunk = HEADER.pack(MAGIC, VERSION, last_tid, len(entries), key or 0, mark or 0)
            crc = zlib.crc32(chunk, crc)
            f.write(chunk)
            for oid, tid, state in entries:
                chunk = RECORD.pack(oid, tid, len(state))
                crc = zlib.crc32(state, zlib.crc32(chunk, crc))
                f.write(chunk)
                f.write(state)
            f.write(TRAILER.pack(crc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class _Locked:
    """Exclusive flock on ``path + '.lock'`` (a no-op without fcntl)."""

    def __init__(self, path):
        self.path = path + '.lock'
        self.f = None

    def __enter__(self):
        self.f = open(self.path, 'a+b')
        if fcntl is not None:
            fcntl.flock(self.f.fileno(), fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if fcntl is not None:
            fcntl.flock(self.f.fileno(), fcntl.LOCK_UN)
        self.f.close()


def save(path, last_tid, entries, limit_bytes, key=None, mark=0, replace=False):
    """Merge ``entries`` (most important last), read from the database
    whose key is ``key`` (None: unknown) with pack mark ``mark``, into the
    file at ``path`` (with ``replace``, over what it holds).

    Returns the number of entries written.
    """
    with _Locked(path):
        _remove_leftovers(path)
        try:
            written = tid_of_time(os.stat(path).st_mtime)
            existing = read_file(path)
        except FileNotFoundError:
            existing = None
        except CacheFileError as exc:
            log.warning("Replacing damaged cache file %s (%s)", path, exc)
            existing = None
        combined = {}           # oid -> (tid, state); the newest tid wins
        order = []              # oids, most important first: ours, then theirs
        sources = [reversed(entries)]
        if existing is not None and (existing.database_key or 0) != (key or 0):
            if existing.database_key:
                log.info("Replacing cache file %s, written for another database", path)
            else:
                # (A helper agent's check: a file of an earlier release was
                # said to be of another database.)
                log.info("Replacing cache file %s, written without the database's key "
                         "(by an earlier release, or a process that could not read it)",
                         path)
            existing = None
        if existing is not None and existing.pack_mark != (mark or 0):
            # Entries learned under two pack marks: those of the older one
            # may describe what a zap_all since emptied.  The newer mark's
            # go (a review finding: keeping the older mark, the file
            # never moved on and was ignored for good after two packs).
            if existing.pack_mark > (mark or 0) and not replace:
                log.info("Keeping cache file %s as it is: written after a pack this "
                         "process has not seen yet", path)
                return 0
            existing = None
        if existing is not None:
            last_tid = max(last_tid, existing.last_tid)
            # Not those committed after the file was written: this save
            # would make them look older than the file (see
            # load_validated; a review finding: another process's save
            # carried them over, and a process started after it took them).
            sources.append(entry for entry in reversed(existing.entries)
                           if entry[1] <= written)
        for source in sources:
            for oid, tid, state in source:
                old = combined.get(oid)
                if old is None:
                    order.append(oid)
                elif old[0] >= tid:
                    continue
                combined[oid] = (tid, state)
        order = [(oid,) + combined[oid] for oid in order]
        kept = []
        size = 0
        for entry in order:
            size += len(entry[2]) + RECORD.size
            if size > limit_bytes:
                break
            kept.append(entry)
        kept.reverse()
        _write_file(path, last_tid, kept, key, mark)
        return len(kept)


def load_validated(path, adapter, put, record, key=None):
    """Load the file at ``path``; entries the database (whose key is
    ``key``, None if unknown) confirms go to ``put(oid, tid, state)`` and
    ``record(oid, tid, snapshot)``.

    Returns (snapshot_tid, loaded, dropped, pack_mark, zap_mark);
    snapshot_tid is None when nothing could be checked (no file, damaged,
    or the database is behind); pack_mark and zap_mark
    (Adapter.zap_mark) are the database's as the entries were checked.
    """
    try:
        # (Before the read: a file written meanwhile is newer still.)
        written = tid_of_time(os.stat(path).st_mtime)
        content = read_file(path)
    except FileNotFoundError:
        return None, 0, 0, None, None
    except (CacheFileError, OSError) as exc:
        log.warning("Ignoring cache file %s: %s", path, exc)
        return None, 0, 0, None, None
    if content is None:
        return None, 0, 0, None, None
    last_tid, entries, file_key, file_mark, version = content
    if file_key and key and file_key != key:
        log.warning("Ignoring cache file %s: it was written for another database "
                    "(made again at the same place, or copied there with zodbconvert "
                    "--clear)", path)
        return None, 0, len(entries), None, None
    conn = adapter.open_load()
    try:
        adapter.begin_snapshot(conn)
        snapshot = adapter.get_last_tid(conn)
        if last_tid > snapshot:
            log.warning(
                "Ignoring cache file %s: it was written after transaction %x but the "
                "database's last transaction is %x (restored from an older backup?)",
                path, last_tid, snapshot)
            return None, 0, len(entries), None, None
        mark = adapter.pack_mark(conn)
        if file_mark != mark and (
                file_mark > mark or adapter.pack_removals(conn, file_mark, mark) is None):
            if version < VERSION:
                log.info("Ignoring cache file %s: it was written by an earlier release, "
                         "which did not record the pack mark, and the database has been "
                         "packed or emptied since it was made", path)
            else:
                log.info("Ignoring cache file %s: the database was emptied (zap_all), "
                         "restored or packed more than once since it was written", path)
            return None, 0, len(entries), None, None
        loaded = dropped = 0
        for i in range(0, len(entries), VALIDATE_BATCH):
            batch = entries[i:i + VALIDATE_BATCH]
            current = adapter.current_tids(conn, [oid for oid, _, _ in batch])
            for oid, tid, state in batch:
                # A revision whose tid is later than the file's writing
                # time was committed while the database's last tid was
                # ahead of the clock (each commit then takes the last tid
                # plus one): after a backup restored, the next commits may
                # take the same tids again, with other states, and the
                # database's tid alone cannot tell them apart (a helper
                # agent's check: a process started after such a restore
                # served a state of the lost history).
                if tid <= written and current.get(oid) == tid:
                    put(oid, tid, state)
                    record(oid, tid, snapshot)
                    loaded += 1
                else:
                    dropped += 1
        return snapshot, loaded, dropped, mark, adapter.zap_mark(conn)
    finally:
        conn.rollback()
        conn.close()
