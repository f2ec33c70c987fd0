"""The storage-wide cache: one per RelStorage, shared by all its instances.

Reading object ``oid`` in a snapshot ``S`` (see ``RelStorage.load``):

1. ``ChangeIndex.tid_at(oid, S)`` (mvcc.py) says which revision is current
   in ``S``, when polls and earlier loads let it know without a query;
2. with a known tid, the state comes from the local LRU keyed (oid, tid)
   (local.py), then from memcached (memcache.py), then from the database;
3. with an unknown tid, one query on the snapshot connection gives state
   and tid, and the answer is recorded for later readers.

States are immutable per (oid, tid), so no cache holds anything that can
become wrong; all MVCC reasoning lives in the index.  The local cache can
be saved to ``cache-local-dir`` on close and is validated against the
database when it is loaded at start (persistent.py).
"""
import hashlib
import logging
import re
import threading
import time

from .local import LocalStateCache
from .mvcc import ChangeIndex
from . import persistent

log = logging.getLogger(__name__)

MB = 1024 * 1024
#: States read from the database are sent to memcached this many at a time
#: (and at every poll).
MEMCACHE_BATCH = 100
#: Seconds between two DEBUG lines of statistics.
STATS_LOG_INTERVAL = 60.0


def safe_prefix(text, length=60):
    """A file-name and memcached-key safe, still unique, spelling of ``text``."""
    text = str(text)
    cleaned = re.sub(r'[^A-Za-z0-9._-]+', '_', text).strip('_.') or 'relstorage'
    if cleaned == text and len(text) <= length:
        return text
    digest = hashlib.sha1(text.encode('utf-8')).hexdigest()[:10]
    return '%s-%s' % (cleaned[:length], digest)


class StorageCache:

    def __init__(self, options, adapter=None, prefix=None):
        self.options = options
        self.local = LocalStateCache(options.cache_local_mb * MB,
                                     options.cache_local_object_max,
                                     options.cache_local_compression)
        self.index = ChangeIndex(options.cache_delta_size_limit)
        if prefix is None:
            prefix = options.cache_prefix or (adapter.describe() if adapter else 'relstorage')
        self.prefix = safe_prefix(prefix)
        self.memcache = None
        self._to_memcache = {}      # states read from the database, sent in batches
        self._to_memcache_lock = threading.Lock()
        if options.cache_servers:
            from .memcache import MemcacheStateCache
            self.memcache = MemcacheStateCache(options.cache_servers,
                                               options.cache_module_name, self.prefix)
        self.db_loads = 0
        self.index_mismatches = 0
        self.persistent_loaded = self.persistent_dropped = 0
        self._last_stats_log = time.monotonic()
        self._closed = False
        if adapter is not None and self.persistent_path:
            self._load_persistent(adapter)

    # ------------------------------------------------------------------
    # The read path

    def load(self, adapter, conn, oid, snapshot):
        """(state, tid) of oid's revision current in ``snapshot``; None when
        the object does not exist there.  ``conn`` is the snapshot's
        connection."""
        tid = self.index.tid_at(oid, snapshot)
        if tid is not None:
            state = self.local.get(oid, tid)
            if state is not None:
                return state, tid
            if self.memcache is not None:
                state = self.memcache.get(oid, tid)
                if state is not None:
                    self.local.put(oid, tid, state)
                    return state, tid
        row = adapter.load_current(conn, oid)
        self.db_loads += 1
        if row is None:
            return None
        state = None if row[0] is None else bytes(row[0])
        found = row[1]
        if tid is not None and found != tid:
            self.index_mismatches += 1
            log.error("Cache index said oid %x is at %x in snapshot %x but the database "
                      "says %x; using the database's answer.", oid, tid, snapshot, found)
        self.index.record(oid, found, snapshot)
        if state is not None:
            self.local.put(oid, found, state)
            if self.memcache is not None:
                self._send_later(oid, found, state)
        return state, found

    def _send_later(self, oid, tid, state):
        with self._to_memcache_lock:
            self._to_memcache[(oid, tid)] = state
            if len(self._to_memcache) < MEMCACHE_BATCH:
                return
        self.flush()

    def flush(self):
        """Send the states read from the database to memcached (one
        round trip per server); called at every poll and on close."""
        if self.memcache is None:
            return
        with self._to_memcache_lock:
            batch, self._to_memcache = self._to_memcache, {}
        if batch:
            self.memcache.set_many(batch)

    def prefetch(self, adapter, conn, oids, snapshot):
        """Make the current states of ``oids`` in ``snapshot`` cached, with
        one database query for those not found in a cache."""
        missing = []
        from_memcache = []
        for oid in oids:
            tid = self.index.tid_at(oid, snapshot)
            if tid is None:
                missing.append(oid)
            elif (oid, tid) not in self.local:
                from_memcache.append((oid, tid))
        if from_memcache:
            if self.memcache is not None:
                found = self.memcache.get_many(from_memcache)
                for (oid, tid), state in found.items():
                    self.local.put(oid, tid, state)
            else:
                found = {}
            missing.extend(oid for oid, tid in from_memcache if (oid, tid) not in found)
        if not missing:
            return 0
        rows = adapter.load_current_many(conn, missing)
        self.db_loads += len(rows)
        fresh = {}
        for oid, (state, tid) in rows.items():
            self.index.record(oid, tid, snapshot)
            if state is not None:
                self.local.put(oid, tid, state)
                fresh[(oid, tid)] = state
        if fresh and self.memcache is not None:
            self.memcache.set_many(fresh)
        return len(rows)

    def poll(self, adapter, conn, prev, snapshot):
        """The (oid, tid) changes in (prev, snapshot], keeping the index's
        change log; ``prev`` None on an instance's first poll."""
        self.flush()
        changes = self.index.poll(
            prev, snapshot, lambda after, upto: adapter.poll_changes(conn, after, upto))
        now = time.monotonic()
        if now - self._last_stats_log >= STATS_LOG_INTERVAL and log.isEnabledFor(logging.DEBUG):
            self._last_stats_log = now
            self.log_stats()
        return changes

    def rolled_back(self, new_last, old_last):
        """The database went back in time: forget every tid we knew."""
        self.index.rolled_back(new_last, old_last)

    # ------------------------------------------------------------------
    # Used by commit, loadSerial, loadBefore and pack

    def get(self, oid, tid):
        return self.local.get(oid, tid)

    def put(self, oid, tid, state):
        """A revision's state, e.g. just committed: into both caches."""
        self.local.put(oid, tid, state)
        if self.memcache is not None and state is not None:
            self.memcache.set(oid, tid, state)

    def committed(self, tid, rows):
        """The states of a transaction just committed as ``tid``
        (``rows``: (oid, state) pairs): into the local cache, and into
        memcached in one batch whose replies are awaited, so that another
        process that learns of ``tid`` by polling finds them there."""
        fresh = {}
        local = self.local
        for oid, state in rows:
            local.put(oid, tid, state)
            if state is not None:
                fresh[(oid, tid)] = state
        if fresh and self.memcache is not None:
            self.memcache.set_many(fresh, wait=True)

    def clear(self):
        """After pack: revisions may be gone, forget what we knew."""
        self.local.clear()
        self.index.clear()

    # ------------------------------------------------------------------
    # Statistics

    def stats(self):
        result = self.local.stats()
        index = self.index
        result.update({
            'tid_known': index.answered,
            'tid_unknown': index.unknown,
            'db_loads': self.db_loads,
            'polls': index.polls,
            'polls_without_query': index.polls_free,
            'log_entries': index.log_size(),
            'checked_entries': len(index),
            'index_mismatches': self.index_mismatches,
            'persistent_loaded': self.persistent_loaded,
            'persistent_dropped': self.persistent_dropped,
        })
        if self.memcache is not None:
            result['memcache'] = self.memcache.stats()
        return result

    def log_stats(self):
        s = self.stats()
        mc = s.get('memcache')
        log.debug("cache %s: local %d hits / %d misses (%.0f%%), %d entries, %d bytes; "
                  "tids known without a query %d, unknown %d; database loads %d; "
                  "polls %d (%d without a query)%s",
                  self.prefix, s['hits'], s['misses'], s['ratio'] * 100, s['entries'],
                  s['bytes'], s['tid_known'], s['tid_unknown'], s['db_loads'], s['polls'],
                  s['polls_without_query'],
                  '; memcached %d hits / %d misses / %d errors'
                  % (mc['hits'], mc['misses'], mc['errors']) if mc else '')

    # ------------------------------------------------------------------
    # Persistent cache file

    @property
    def persistent_path(self):
        directory = self.options.cache_local_dir
        if not directory or not self.local.limit:
            return None
        return persistent.cache_path(directory, self.prefix)

    def _load_persistent(self, adapter):
        path = self.persistent_path
        started = time.time()
        try:
            snapshot, loaded, dropped = persistent.load_validated(
                path, adapter, self.local.put, self.index.record)
        except Exception:  # pylint:disable=broad-except
            log.warning("Could not load the cache file %s", path, exc_info=True)
            return
        self.persistent_loaded, self.persistent_dropped = loaded, dropped
        if snapshot is not None:
            self.index.start_log(snapshot)
            log.info("Loaded %d cached states from %s in %.2fs (%d were out of date)",
                     loaded, path, time.time() - started, dropped)

    def save(self):
        """Write the local cache to cache-local-dir (merging with the file)."""
        path = self.persistent_path
        if path is None or not len(self.local):
            return 0
        entries = list(self.local.items())
        last_tid = max([self.index.high_water] + [tid for _, tid, _ in entries])
        try:
            written = persistent.save(path, last_tid, entries, self.local.limit)
        except Exception:  # pylint:disable=broad-except
            log.warning("Could not write the cache file %s", path, exc_info=True)
            return 0
        log.debug("Saved %d cached states to %s", written, path)
        return written

    def close(self):
        if self._closed:
            return
        self._closed = True
        self.flush()
        self.save()
        if log.isEnabledFor(logging.DEBUG):
            self.log_stats()
        if self.memcache is not None:
            self.memcache.close()
