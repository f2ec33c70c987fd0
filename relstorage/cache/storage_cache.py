"""The storage-wide cache: one per RelStorage, shared by all its instances.

Reading object ``oid`` in a snapshot ``S`` (see ``RelStorage.load``):

1. ``ChangeIndex.tid_at(oid, S)`` (mvcc.py) says which revision is current
   in ``S``, when polls and earlier loads let it know without a query;
2. with a known tid, the state comes from the local LRU keyed (oid, tid)
   (local.py), then from the shared cache (shared.py: memcached or Redis),
   then from the database;
3. with an unknown tid, one query on the snapshot connection gives state
   and tid, and the answer is recorded for later readers.

States are immutable per (oid, tid), so no cache holds anything that can
become wrong; all MVCC reasoning lives in the index.  The local cache can
be saved to ``cache-local-dir`` on close and is validated against the
database when it is loaded at start (persistent.py).
"""
import errno
import hashlib
import logging
import re
import threading
import time

from .. import locks
from ..directories import ensure_directory
from ..interfaces import RelStorageError
from .local import LocalStateCache
from .shared import HOT_MAX
from .shared import open_shared_cache
from .mvcc import ChangeIndex
from . import persistent

log = logging.getLogger(__name__)

MB = 1024 * 1024
#: Why a directory could not be made that more room would cure.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
#: States read from the database are sent to the shared cache this many at a time
#: (and at every poll).
SHARED_BATCH = 100
#: States put into the local cache under one lock at the end of a commit.
LOCAL_BATCH = 1000
#: Seconds between two publications of the hot list to the shared cache (also
#: published on close).
HOT_INTERVAL = 300.0
#: States asked of the shared cache per request when warming a fresh process.
WARM_BATCH = 1000
#: Seconds between two DEBUG lines of statistics.
STATS_LOG_INTERVAL = 60.0
# The OIDs of this process's own recent commits of at least OWN_MIN_OIDS
# objects, the last OWN_COMMITS of them: a poll need not read them back
# (see Adapter.poll_changes).
OWN_MIN_OIDS = 32
OWN_COMMITS = 8


def safe_prefix(text, length=60):
    """A file-name and shared-cache-key safe, still unique, spelling of ``text``."""
    text = str(text)
    cleaned = re.sub(r'[^A-Za-z0-9._-]+', '_', text).strip('_.') or 'relstorage'
    if cleaned == text and len(text) <= length:
        return text
    digest = hashlib.sha1(text.encode('utf-8')).hexdigest()[:10]
    return '%s-%s' % (cleaned[:length], digest)


def shared_namespace(prefix, identity):
    """The shared cache's key prefix for a database: ``cache-prefix`` and
    a digest of ``identity``, the database's key (Adapter.database_key)
    or, before it has one, its names as its server gives them.  Two
    databases given the same cache-prefix on one memcached or Redis (a
    Plone recipe's ``cache-prefix plone`` on every site) then never meet:
    a helper agent's check found a fresh process of one database taking
    the other's hot list for its own, and serving the other's objects."""
    digest = hashlib.sha1(repr(tuple(identity)).encode('utf-8')).hexdigest()[:8]
    return '%s:%s' % (prefix, digest)


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
        self.shared = None
        # The shared cache's keys: the prefix and the database's identity
        # (see shared_namespace).
        self.shared_prefix = self.prefix
        self._to_shared = {}        # states read from the database, sent in batches
        self._hints_to_shared = {}  # and which tid was current: {oid: (tid, as_of)}
        self._to_shared_lock = threading.Lock()
        self._locks_made_with = locks.made_now(self)
        # The database's key (Adapter.database_key), for what outlives the
        # process: the shared cache's namespace and the cache file.
        self.database_key = None
        if adapter is not None and (options.cache_servers or self.persistent_path):
            self.database_key = adapter.database_key(create=not options.read_only)
        if options.cache_servers:
            if adapter is not None:
                key = self.database_key
                # (Without a key yet, a read-only storage goes by what the
                # server names the database.)
                identity = (('key', key) if key is not None
                            else tuple(adapter.database_identity()[:-1]))
                self.shared_prefix = shared_namespace(self.prefix, identity)
            self.shared = open_shared_cache(options.cache_servers,
                                            options.cache_module_name, self.shared_prefix)
        self.db_loads = 0
        self.hinted = 0             # tids learned from shared-cache hints
        self._mark_lock = threading.Lock()
        self._pack_mark = None      # None until the first snapshot
        self._newest_snapshot = 0   # the newest snapshot tid any instance began
        # {(after, upto): rows} of the last removal lists read
        # (pack_removals).
        self._removals_memo = {}
        self._hints_from = 0        # no hint as of an earlier snapshot (pack)
        self.warmed = 0             # states copied from the shared cache at start
        self._hot_published = time.monotonic()
        self._backfilled = False
        self.index_mismatches = 0
        self.persistent_loaded = self.persistent_dropped = 0
        self._replace_file = False
        self._last_stats_log = time.monotonic()
        self._closed = False
        self._own_commits = {}      # {tid: [oid]}, see OWN_COMMITS
        self._own_lock = threading.Lock()
        # The blob cache (blobs.cached.CachedBlobs, given by the storage):
        # what a pack removes goes from it as from the state cache.
        self.blob_files = None
        if adapter is not None and self.persistent_path:
            try:
                # Created like blob-dir: a missing directory would otherwise
                # only show as a failed write at every close.
                try:
                    ensure_directory('cache-local-dir', options.cache_local_dir)
                except RelStorageError as exc:
                    # A helper agent's check: on a full disk a storage
                    # whose cache directory was not there yet could not
                    # open.  The cache is a help the storage can do
                    # without until there is room (a wrong path is still
                    # refused).
                    if getattr(exc, 'errno', None) not in _NO_ROOM:
                        raise
                    log.warning("%s; the storage opens without its persistent cache.", exc)
                else:
                    self._load_persistent(adapter)
            except BaseException:
                if self.shared is not None:
                    self.shared.close()
                raise

    # ------------------------------------------------------------------
    # The read path

    def load(self, adapter, conn, oid, snapshot, mark=None):
        """(state, tid) of oid's revision current in ``snapshot``; None when
        the object does not exist there.  ``conn`` is the snapshot's
        connection, ``mark`` the pack mark it saw (ChangeIndex.fence)."""
        # A tid the index does not know costs one query, which also gives
        # the state: asking the shared cache for a hint first would only add a
        # round trip (hints are used in batches: prefetch, warm start).
        tid = self.index.tid_at(oid, snapshot)
        if tid is not None:
            state = self.local.get(oid, tid)
            if state is not None:
                return state, tid
            if self.shared is not None:
                state = self.shared.get(oid, tid)
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
        # (An instance still in a snapshot from before a pack may read a
        # removed object again: the index's fence keeps that from telling
        # later snapshots it is current.  A review finding.)
        self.index.record(oid, found, snapshot, mark)
        if state is not None:
            self.local.put(oid, found, state)
            if self.shared is not None:
                self._send_later(oid, found, state, snapshot)
        return state, found

    def _tid_from_hints(self, oids, snapshot):
        """{oid: tid} current in ``snapshot`` for those of ``oids`` whose
        shared-cache hint the index can use (see mvcc.ChangeIndex.record)."""
        index = self.index
        result = {}
        hints_from = self._hints_from
        for oid, (tid, as_of) in self.shared.get_hints(oids).items():
            if as_of < hints_from or not index.record_hint(oid, tid, as_of):
                continue
            tid = index.tid_at(oid, snapshot)
            if tid is not None:
                result[oid] = tid
        self.hinted += len(result)
        return result

    def _send_later(self, oid, tid, state, snapshot):
        with self._to_shared_lock:
            self._to_shared[(oid, tid)] = state
            self._hints_to_shared[oid] = (tid, snapshot)
            if len(self._to_shared) < SHARED_BATCH:
                return
        self.flush()

    def _send(self, states, hints, wait=False):
        """States and hints to the shared cache.  Hints as of a snapshot from
        before the last pack this process saw are dropped: an instance
        still reading such a snapshot may describe a removed object."""
        # The namespace, then the floor: note_pack_mark moves the floor
        # first, so a hint that passes is never sent under a namespace of
        # a pack it may predate (a review finding: in the other order, a
        # thread could do so).
        prefix = self.shared.hint_prefix
        hints_from = self._hints_from
        if hints_from:
            hints = {oid: hint for oid, hint in hints.items() if hint[1] >= hints_from}
        self.shared.set_many(states, hints, wait=wait, hint_prefix=prefix)

    def flush(self):
        """Send the states read from the database to the shared cache (one
        round trip per server); called at every poll and on close."""
        if self.shared is None:
            return
        with self._to_shared_lock:
            batch, self._to_shared = self._to_shared, {}
            hints, self._hints_to_shared = self._hints_to_shared, {}
        if batch or hints:
            self._send(batch, hints)

    def prefetch(self, adapter, conn, oids, snapshot, mark=None):
        """Make the current states of ``oids`` in ``snapshot`` cached, with
        one database query for those not found in a cache.  Returns
        {oid: (state, tid)} of the existing objects read from the database
        (current in ``snapshot``)."""
        # Batch calls of the index and the local cache (one lock each):
        # per-object calls cost as much as the query itself.
        oids = list(oids)
        local = self.local
        missing = []
        from_shared = []
        for oid, tid in zip(oids, self.index.tids_at(oids, snapshot)):
            if tid is None:
                missing.append(oid)
            elif (oid, tid) not in local:
                from_shared.append((oid, tid))
        if self.shared is not None:
            if missing:
                hinted = self._tid_from_hints(missing, snapshot)
                if hinted:
                    missing = [oid for oid in missing if oid not in hinted]
                    from_shared.extend(pair for pair in hinted.items()
                                         if pair not in local)
            if from_shared:
                found = self.shared.get_many(from_shared)
                local.put_many([(oid, tid, state) for (oid, tid), state in found.items()])
                missing.extend(oid for oid, tid in from_shared if (oid, tid) not in found)
        else:
            missing.extend(oid for oid, _ in from_shared)
        if not missing:
            return {}
        rows = adapter.load_current_many(conn, missing)
        self.db_loads += len(rows)
        fresh = [(oid, tid, state) for oid, (state, tid) in rows.items()]
        self.index.record_many([(oid, tid) for oid, tid, _ in fresh], snapshot, mark)
        if len(fresh) != len(missing) or any(state is None for _, _, state in fresh):
            # Deleted objects (state None) are known to the index, not
            # kept; missing ones were not there at all.
            fresh = [row for row in fresh if row[2] is not None]
            rows = {oid: (state, tid) for oid, tid, state in fresh}
        local.put_many(fresh)
        if fresh and self.shared is not None:
            self._send({(oid, tid): state for oid, tid, state in fresh},
                       {oid: (tid, snapshot) for oid, tid, _ in fresh})
        return rows

    def poll(self, adapter, conn, prev, snapshot, mark=None):
        """The (oid, tid) changes in (prev, snapshot], keeping the index's
        change log; ``prev`` None on an instance's first poll."""
        self.flush()
        fresh = prev is None and self.shared is not None and not self._backfilled
        if fresh:
            self._backfill(adapter, conn, snapshot, mark)
        with self._own_lock:
            own = dict(self._own_commits)
        changes = self.index.poll(
            prev, snapshot, lambda after, upto: adapter.poll_changes(conn, after, upto, own),
            mark)
        now = time.monotonic()
        if fresh:
            self._warm_from_shared(snapshot)
        elif self.shared is not None and now - self._hot_published >= HOT_INTERVAL:
            self.publish_hot()
        if now - self._last_stats_log >= STATS_LOG_INTERVAL and log.isEnabledFor(logging.DEBUG):
            self._last_stats_log = now
            self.log_stats()
        return changes

    def _backfill(self, adapter, conn, snapshot, mark=None):
        """A fresh process starts its change log with the newest changes
        (up to half of cache-delta-size-limit) instead of empty at its first
        snapshot, so that shared-cache hints written by other processes in
        that window tell it which tids are current without a query."""
        self._backfilled = True
        if self.index.window is not None:
            return
        limit = max(1, self.index.limit // 2)
        rows = adapter.recent_changes(conn, snapshot, limit + 1)
        if len(rows) > limit:
            # Complete only above the oldest tid seen: rows of that tid
            # may have been cut off by the limit.
            after = rows[-1][1]
            rows = [(oid, tid) for oid, tid in rows if tid > after]
        else:
            after = 0
        if self.index.backfill(after, snapshot, rows, mark):
            log.debug("Change log started at %x with %d changes up to %x",
                      after, len(rows), snapshot)

    def publish_hot(self):
        """Tell the shared cache which revisions our local cache holds, most
        recently used first, each current as of the newest snapshot the
        index knows, so that fresh processes can start warm.  The list
        already there is merged in after ours (where our change log proves
        its entries still current), so a short-lived process does not
        replace what a busy one published."""
        self._hot_published = time.monotonic()
        window = self.index.window
        if self.shared is None or window is None or not len(self.local):
            return 0
        as_of = window[1]
        if as_of < self._hints_from:
            return 0        # (until a snapshot after the last pack)
        index = self.index
        pairs = []
        seen = set()
        for oid, tid in reversed(self.local.keys()):
            if oid not in seen and index.peek(oid, as_of) == tid:
                seen.add(oid)
                pairs.append((oid, tid))
                if len(pairs) >= HOT_MAX:
                    break
        if not pairs:
            return 0
        theirs = self.shared.get_hot()
        if theirs and len(pairs) < HOT_MAX:
            their_as_of, their_pairs = theirs
            # Lazy, so that ``seen`` also skips repeats within their list.
            fresh = ((oid, tid) for oid, tid in their_pairs if oid not in seen)
            for oid, current in self._proved_current(fresh, their_as_of, as_of):
                seen.add(oid)
                pairs.append((oid, current))
                if len(pairs) >= HOT_MAX:
                    break
        return self.shared.set_hot(as_of, pairs)

    def _proved_current(self, pairs, as_of, snapshot):
        """(oid, tid current in ``snapshot``) for the hints (oid, tid) current
        as of ``as_of`` that the index can prove still hold; each hint is
        recorded like an answer from the database."""
        if as_of < self._hints_from:
            return          # (a list that may predate the last pack)
        index = self.index
        for oid, tid in pairs:
            if not index.record_hint(oid, tid, as_of):
                continue
            current = index.peek(oid, snapshot)
            if current is not None:
                yield oid, current

    def _warm_from_shared(self, snapshot):
        """Fill the local cache of a fresh process with the states another
        process published as hot (publish_hot): one request for the list,
        then one per WARM_BATCH states, at most cache-local-mb of them.
        Each entry is a hint, used only where the change log proves it
        current in ``snapshot``."""
        local = self.local
        if not local.limit:
            return
        hot = self.shared.get_hot()
        if not hot:
            return
        as_of, pairs = hot
        # No more hints than the index keeps (cache-delta-size-limit).
        wanted = [pair for pair in self._proved_current(
            pairs[:self.index.limit // 2], as_of, snapshot) if pair not in local]
        size = 0
        warmed = []
        for start in range(0, len(wanted), WARM_BATCH):
            found = self.shared.get_many(wanted[start:start + WARM_BATCH])
            for pair in wanted[start:start + WARM_BATCH]:
                state = found.get(pair)
                if state is not None:
                    warmed.append((pair, state))
                    size += len(state)
            if size >= local.limit:
                break
        # Least recently used first, so the hottest end up most recent.
        for (oid, tid), state in reversed(warmed):
            local.put(oid, tid, state)
        self.warmed += len(warmed)
        log.debug("Warmed the local cache with %d states from %s", len(warmed),
                  self.shared.kind)

    def abandoned(self, snapshot):
        """Whether ``snapshot`` belongs to a history the database left
        (see rolled_back)."""
        return self.index.abandoned(snapshot)

    def rolled_back(self, new_last, old_last, pack_mark=None):
        """The database went back in time: forget every tid we knew.
        ``pack_mark``: the pack mark it went back to, if it did."""
        self.index.rolled_back(new_last, old_last)
        # Its pack marks may count again from older values.
        self._removals_memo = {}
        self._forget_own_commits()
        self.pack_mark_at_most(pack_mark)

    def pack_mark_at_most(self, pack_mark):
        """The database went back in time, to pack mark ``pack_mark``
        (None: unknown): the marks that come next are news again (a
        helper agent's check: after zodbconvert --clear, which makes the
        tables again, a running process ignored the packs up to its old
        mark and went on serving the objects they removed).  Lower than
        needed only makes the next mark's lists read again."""
        if pack_mark is not None:
            with self._mark_lock:
                if self._pack_mark is not None and pack_mark < self._pack_mark:
                    self._pack_mark = pack_mark

    def _forget_own_commits(self):
        with self._own_lock:
            self._own_commits = {}

    def _note_own_commit(self, tid, oids):
        """Every object transaction ``tid`` (committed by this process)
        changed, for the polls that follow."""
        if len(oids) < OWN_MIN_OIDS:
            return
        with self._own_lock:
            own = self._own_commits
            own[tid] = oids
            while len(own) > OWN_COMMITS:
                del own[min(own)]

    # ------------------------------------------------------------------
    # Used by commit, loadSerial, loadBefore and pack

    def get(self, oid, tid):
        return self.local.get(oid, tid)

    def put(self, oid, tid, state):
        """A revision's state, e.g. just committed: into both caches."""
        self.local.put(oid, tid, state)
        if self.shared is not None and state is not None:
            self.shared.set(oid, tid, state)

    def committed(self, tid, rows):
        """The states of a transaction just committed as ``tid``
        (``rows``: (oid, state) pairs): into the local cache, and into
        the shared cache in batches whose replies are awaited, so that
        another process that learns of ``tid`` by polling finds them there."""
        local = self.local
        oids = []
        if self.shared is None:
            # In batches (one lock each): a huge transaction is not held whole.
            batch = []
            for oid, state in rows:
                oids.append(oid)
                if state is not None:
                    batch.append((oid, tid, state))
                    if len(batch) >= LOCAL_BATCH:
                        local.put_many(batch)
                        batch = []
            local.put_many(batch)
            self._note_own_commit(tid, oids)
            return
        fresh = {}
        hints = {}
        for oid, state in rows:
            oids.append(oid)
            local.put(oid, tid, state)
            if state is not None:
                fresh[(oid, tid)] = state
                hints[oid] = (tid, tid)
                if len(fresh) >= SHARED_BATCH:
                    # A huge transaction is sent in batches, not held whole.
                    self._send(fresh, hints, wait=True)
                    fresh, hints = {}, {}
        if fresh:
            self._send(fresh, hints, wait=True)
        self._note_own_commit(tid, oids)

    def clear(self, floor=0, mark=0):
        """After pack: revisions may be gone, forget what we knew (and
        from then on what a snapshot before ``floor`` says)."""
        self.index.clear(floor, mark)
        self.local.clear()
        self._forget_own_commits()

    def newest_pack_mark(self):
        """The newest pack mark a snapshot of this process has shown
        (None before the first)."""
        return self._pack_mark

    def renew_locks(self):
        """(relstorage/locks.py)"""
        if locks.stale(self):
            self._to_shared_lock = threading.Lock()
            self._mark_lock = threading.Lock()
            self._own_lock = threading.Lock()
        self.local.renew_locks()
        self.index.renew_locks()
        if self.shared is not None:
            self.shared.renew_locks()

    def note_pack_mark(self, mark, snapshot, removals=None, zap_mark=None):
        """A snapshot ``snapshot`` saw pack mark ``mark`` (see
        adapters/sql.py, commit_lock).  The first time a greater mark is
        seen, what is cached may describe objects or revisions the pack
        removed.  ``removals(after, upto)`` (on the snapshot's connection)
        lists them per pack batch: only those are forgotten.  Without a
        list (zap_all, or a list of an earlier pack already emptied),
        forget it all.  ``zap_mark()`` (on the same connection; without
        it, ``mark``) is the mark of the database's last zap_all, which
        names the shared cache's namespace (_use_namespace_of).  Marks
        only grow; an older snapshot still showing the previous mark
        changes nothing."""
        if self.blob_files is not None:
            # (A helper agent's check: another process's blob cache kept
            # serving the revisions a pack removed.)  The blob cache keeps
            # its own mark: it caught up with the database when the
            # storage opened, after the state cache did.
            self.blob_files.note_pack_mark(
                mark, None if removals is None else
                (lambda after, upto: self.pack_removals(after, upto, removals)))
        with self._mark_lock:
            newest = self._newest_snapshot
            if snapshot > newest:
                self._newest_snapshot = snapshot
            first = self._pack_mark is None
            if not first and mark <= self._pack_mark:
                return
            previous, self._pack_mark = self._pack_mark, mark
            if not first:
                # A pack may have removed objects of our own commits:
                # polls must read what the database holds.
                self._forget_own_commits()
            if not first and removals is not None:
                removed = self.pack_removals(previous, mark, removals)
                if removed is not None:
                    # States are immutable per (oid, tid): what the pack
                    # left is still right, and the shared cache keeps its
                    # namespace for them.  An instance still in an older
                    # snapshot may read a removed garbage object again;
                    # only a holder of a stale reference could ask for it,
                    # and it gets the state it would have had before the
                    # pack.  But hints from before the pack (any process's)
                    # may say a removed object is current: those of this
                    # mark are read and written from now on, and none
                    # from a snapshot that may predate the pack (a pack
                    # batch makes no tid: a snapshot of the same tid may
                    # be from before it).  (A helper agent's check: a
                    # process with memcached or Redis went on loading the
                    # objects a pack removed, in new transactions, from
                    # the hints of other processes, and committed a
                    # reference to one.)
                    floor = max(snapshot, newest) + 1
                    self._hints_from = floor
                    self.forget_removed(removed, floor, mark)
                    if self.shared is not None:
                        self.shared.hint_prefix = '%s:h%x' % (self.shared.prefix, mark)
                    return
            self._use_namespace_of(zap_mark() if zap_mark is not None else mark, mark)
            if first:
                return
            # Hints must describe post-pack snapshots: an instance still
            # reading an older snapshot may load a removed object.  Such a
            # snapshot may carry the same tid as ours (a pack does not
            # change it) or a greater one (zap_all resets it), hence
            # beyond the newest snapshot seen so far.
            self._hints_from = max(snapshot, newest + 1)
            with self._to_shared_lock:
                self._to_shared.clear()
                self._hints_to_shared.clear()
            # No index entry from a snapshot of this tid or before (an
            # instance still before the pack, with the same tid, may read
            # a removed object after the clear: a review finding); above
            # it, up to the newest, rolled_back fences them off.
            self.clear(floor=snapshot + 1, mark=mark)
            if snapshot < newest:
                # zap_all: the last tid went back.  What instances still in
                # a snapshot from before learn must never be taken for the
                # new history (their snapshots' tids lie above ours).
                self.index.rolled_back(snapshot, newest)
            log.info("The database was packed or zapped (pack mark %d): cleared the cache.",
                     mark)

    def _use_namespace_of(self, zap, mark):
        """The shared cache's keys at pack mark ``mark`` of a database last
        emptied by zap_all at mark ``zap`` (see note_pack_mark).  States
        live in a namespace of the zap (a copy into the emptied database
        may reuse every tid), hints in one of the pack mark as well (one
        may say that an object a pack removed is current).  Both come
        from the database alone, so that every process uses the same
        keys, whatever it saw: a helper agent's check found the processes
        started after a pack in a namespace of their own (of that pack's
        mark), sharing nothing with those started before."""
        if self.shared is not None:
            base = self.shared_prefix
            states = base if not zap else '%s:p%x' % (base, zap)
            self.shared.prefix = states
            self.shared.hint_prefix = states if mark == zap else '%s:h%x' % (states, mark)

    def pack_removals(self, after_mark, upto_mark, read):
        """``read(after_mark, upto_mark)``: the lists of what pack
        batches removed, read once for every instance of the process:
        after a batch, this cache and each instance's poll ask for the
        same marks, and reading a list is the cost a pack puts on other
        processes."""
        key = (after_mark, upto_mark)
        memo = self._removals_memo
        if key in memo:
            return memo[key]
        rows = read(after_mark, upto_mark)
        if len(memo) >= 4:
            # Instances that were idle ask for ranges from older marks.
            memo.clear()
        memo[key] = rows
        return rows

    def forget_removed(self, removed, floor=0, mark=0):
        """``removed`` (adapters/packing.py PackRemovals): the objects a
        pack removed, and the revisions older than a tid it removed of
        others: the index no longer says they are current, and the local
        cache drops their states.  From then on the index ignores what a
        snapshot before ``floor`` says (ChangeIndex.fence)."""
        for oid, tid in self.index.forget(removed.trimmed_pairs(), removed.garbage_ints(),
                                          floor, mark):
            self.local.discard(oid, tid)

    def zapped(self, mark, old_last):
        """This process emptied the database (zap_all) whose last tid was
        ``old_last``; the new pack mark is ``mark``."""
        with self._mark_lock:
            self._newest_snapshot = max(self._newest_snapshot, old_last)
        self._forget_own_commits()
        self.note_pack_mark(mark, 0)

    # ------------------------------------------------------------------
    # Statistics

    def stats(self):
        result = self.local.stats()
        index = self.index
        result.update({
            'tid_known': index.answered,
            'tid_unknown': index.unknown,
            'db_loads': self.db_loads,
            'tids_from_hints': self.hinted,
            'warmed_from_shared': self.warmed,
            'polls': index.polls,
            'polls_without_query': index.polls_free,
            'log_entries': index.log_size(),
            'checked_entries': len(index),
            'index_mismatches': self.index_mismatches,
            'persistent_loaded': self.persistent_loaded,
            'persistent_dropped': self.persistent_dropped,
        })
        if self.shared is not None:
            result['shared'] = self.shared.stats()
        return result

    def log_stats(self):
        s = self.stats()
        shared = s.get('shared')
        log.debug("cache %s: local %d hits / %d misses (%.0f%%), %d entries, %d bytes; "
                  "tids known without a query %d, unknown %d; database loads %d; "
                  "polls %d (%d without a query)%s",
                  self.prefix, s['hits'], s['misses'], s['ratio'] * 100, s['entries'],
                  s['bytes'], s['tid_known'], s['tid_unknown'], s['db_loads'], s['polls'],
                  s['polls_without_query'],
                  '; %s %d hits / %d misses / %d errors'
                  % (shared['kind'], shared['hits'], shared['misses'], shared['errors'])
                  if shared else '')

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
            snapshot, loaded, dropped, mark, zap = persistent.load_validated(
                path, adapter, self.local.put_restored, self.index.record,
                self.database_key)
            # (Ignored: this process's entries replace it, whatever its
            # mark; a review finding: a file of a mark the database, restored
            # from a backup, had not reached was kept as it was for good.)
            self._replace_file = snapshot is None
        except Exception:  # pylint:disable=broad-except
            log.warning("Could not load the cache file %s", path, exc_info=True)
            return
        self.persistent_loaded, self.persistent_dropped = loaded, dropped
        if snapshot is not None:
            # What the file's entries were checked against: a pack batch
            # before the first snapshot is then learned from its lists (a
            # review finding: taken as the first mark, it forgot nothing).
            with self._mark_lock:
                self._pack_mark = mark
                self._use_namespace_of(zap, mark)
            self.index.start_log(snapshot)
            log.info("Loaded %d cached states from %s in %.2fs (%d were out of date)",
                     loaded, path, time.time() - started, dropped)

    def save(self):
        """Write the local cache to cache-local-dir (merging with the file)."""
        path = self.persistent_path
        if path is None or not len(self.local) or self._pack_mark is None:
            return 0
        entries = list(self.local.items())
        last_tid = max([self.index.high_water] + [tid for _, tid, _ in entries])
        try:
            written = persistent.save(path, last_tid, entries, self.local.limit,
                                      self.database_key, self._pack_mark or 0,
                                      replace=self._replace_file)
        except OSError as exc:
            # (An unwritable or full cache-local-dir: one line, which says
            # why, rather than a traceback at every close.)
            log.warning("Could not write the cache file %s: %s", path, exc)
            return 0
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
        if self.shared is not None:
            self.publish_hot()
        self.save()
        if log.isEnabledFor(logging.DEBUG):
            self.log_stats()
        if self.shared is not None:
            self.shared.close()
