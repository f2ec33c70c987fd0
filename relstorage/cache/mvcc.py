"""Which revision of an object is current in a given snapshot, without a query.

Every storage instance reads in one snapshot, named by its tid ``S`` (the
last transaction committed when the snapshot began).  ``ChangeIndex``,
shared by all the instances of one storage, answers "what is oid's current
tid as of S?" from two kinds of knowledge:

The change log
    Filled by polls: for a contiguous window of transactions
    ``(start, end]`` it holds, per *segment* ``(b[i-1], b[i]]`` between two
    consecutive poll points ("boundaries"), the newest change of every
    object changed in that segment.  A poll of ``(prev, S]`` on a snapshot
    ``S`` returns exactly that for the segment (the database only shows the
    newest revision), so the log is exact at every boundary.  A snapshot
    ``S`` that falls inside a segment is still answered unless the object
    changed in that very segment after ``S`` (then we cannot know whether it
    also changed before ``S`` and say "unknown").  Every poll makes its
    snapshot a boundary, querying only what the log does not already hold:
    a poll the log covers costs nothing but the storage's last-tid query.

The checked map
    ``oid -> (tid, checked_at)``: the database said ``tid`` was current in
    snapshot ``checked_at`` (learned from loads, the persistent cache, and
    from changes dropped out of the log).  It answers for ``S`` when
    ``tid <= S <= checked_at``, or when ``checked_at`` lies in the log window
    and the log shows no change of the object in ``(checked_at, S]``.

Anything else is unknown: the caller queries the database and records the
answer with :meth:`ChangeIndex.record`.  The log holds at most ``limit``
(oid, tid) entries (``cache-delta-size-limit``); when it grows past that
the oldest segments are folded into the checked map, which is bounded by
the same number of objects.

Nothing here does I/O: ``poll`` takes a ``query(after, upto)`` callable
that runs the poll statement on the caller's snapshot connection, and
always calls it with ``upto`` equal to the caller's snapshot tid.
"""
import logging
import threading
from bisect import bisect_left
from bisect import bisect_right
from bisect import insort

from .. import locks
from ..adapters.packing import ALL_REVISIONS

log = logging.getLogger(__name__)


class ChangeIndex:

    def __init__(self, limit=100000):
        self.limit = max(10, int(limit))
        self._lock = threading.RLock()
        self._locks_made_with = locks.made_now(self)
        self._poisoned = []          # (low, high]: snapshots of a history rolled back
        # No knowledge from a snapshot below this tid that saw a pack mark
        # below this one (see fence).
        self._floor = 0
        self._floor_mark = 0
        self.answered = self.unknown = 0
        self.polls = self.polls_free = 0
        self._reset_log()
        self._known = {}

    # ------------------------------------------------------------------
    # State

    def renew_locks(self):
        """(relstorage/locks.py)"""
        if locks.stale(self):
            self._lock = threading.RLock()

    def _reset_log(self):
        self._start = None           # None: no log at all
        self._end = None
        self._bounds = []            # sorted poll points, start and end included
        self._changes = {}           # oid -> sorted change tids
        self._tids = []              # sorted distinct change tids
        self._by_tid = {}            # tid -> [oid, ...]
        self._count = 0              # (oid, tid) entries in the log

    @property
    def window(self):
        """(start, end) of the change log, or None."""
        with self._lock:
            return None if self._start is None else (self._start, self._end)

    @property
    def high_water(self):
        """The newest snapshot this index knows anything about (0 if none)."""
        with self._lock:
            best = self._end or 0
            for _, checked in self._known.values():
                if checked > best:
                    best = checked
            return best

    def __len__(self):
        return len(self._known)

    def log_size(self):
        return self._count

    def clear(self, floor=0, mark=0):
        """Forget everything; ``fence(floor, mark)`` first, under the same
        lock."""
        with self._lock:
            self._fence(floor, mark)
            self._reset_log()
            self._known.clear()

    def fence(self, floor, mark=0):
        """From now on, ignore what a snapshot before ``floor`` that saw a
        pack mark below ``mark`` says (record, record_many, record_hint,
        and a poll's rows for the change log): after a pack, an instance
        still in a snapshot from before it may read an object the pack
        removed, and must not tell later snapshots it is current.  (A pack
        makes no tid: a snapshot after it may have the tid of one before,
        and is told apart by its mark; knowledge that comes without one,
        a hint, goes by the tid alone.  A review finding: fenced by the
        tid alone, a process learned nothing until the next commit after
        a pack, and loaded every object from the database meanwhile.)  The
        check is made under the lock that record takes, so that a
        recording cannot pass it just before the fence and land just after
        the forget that follows (a helper agent's check: a connection in a
        snapshot after the pack then loaded the removed object, and a
        reference to it was committed)."""
        with self._lock:
            self._fence(floor, mark)

    def _fence(self, floor, mark):
        if floor > self._floor:
            self._floor = floor
        if mark > self._floor_mark:
            self._floor_mark = mark

    def _fenced(self, snapshot, mark):
        """(Lock held.)  Whether what a snapshot (its tid, and the pack
        mark it saw, None if unknown) says is to be ignored."""
        if snapshot >= self._floor:
            return False
        return mark is None or mark < self._floor_mark

    def among(self, oids):
        """Those of ``oids`` this index says anything about (set
        operations: a pack lists every object it removed, and most were
        never read here)."""
        oids = set(oids)
        with self._lock:
            return (self._known.keys() & oids) | (self._changes.keys() & oids)

    def forget(self, removed, garbage=(), floor=0, mark=0):
        """A pack removed, for each (oid, below) of ``removed``, the
        revisions of oid older than tid ``below``, and every revision of
        the objects ``garbage`` lists: forget what says one of them is
        current.  ``fence(floor, mark)`` first, under the same lock.  Returns
        the (oid, tid) pairs forgotten."""
        gone = []
        with self._lock:
            self._fence(floor, mark)
            known = self._known
            changes = self._changes
            # (Under the same lock: an instance in an older snapshot may
            # record one of them meanwhile.)
            removed = [(oid, ALL_REVISIONS) for oid in self.among(garbage)] + list(removed)
            for oid, below in removed:
                entry = known.get(oid)
                if entry is not None and entry[0] < below:
                    del known[oid]
                    gone.append((oid, entry[0]))
                tids = changes.get(oid)
                if not tids or tids[0] >= below:
                    continue
                # A trimmed object keeps its newer entries: a poll over a
                # range holding a removed tid holds ``below`` too (the pack
                # time is before every snapshot that sees the removal), so
                # it still reports the object changed.
                keep = [t for t in tids if t >= below]
                for tid in tids[:len(tids) - len(keep)]:
                    gone.append((oid, tid))
                    oids = self._by_tid[tid]
                    oids.remove(oid)
                    self._count -= 1
                    if not oids:
                        del self._by_tid[tid]
                        del self._tids[bisect_left(self._tids, tid)]
                if keep:
                    changes[oid] = keep
                else:
                    del changes[oid]
        return gone

    def rolled_back(self, new_last, old_max):
        """The database's last tid went back from ``old_max`` to ``new_last``
        (restored from a backup).  Forget everything, and never again accept
        knowledge from a snapshot in ``(new_last, old_max]``: such a snapshot
        belongs to the abandoned history."""
        with self._lock:
            old_max = max(old_max, self._end or 0)
            self._reset_log()
            self._known.clear()
            if old_max > new_last:
                self._poisoned.append((new_last, old_max))

    def abandoned(self, snapshot):
        with self._lock:
            return self._is_poisoned(snapshot)

    def _is_poisoned(self, snapshot):
        for low, high in self._poisoned:
            if low < snapshot <= high:
                return True
        return False

    # ------------------------------------------------------------------
    # Questions

    def tid_at(self, oid, snapshot):
        """The tid of oid's revision current in ``snapshot``, or None if unknown.

        A returned tid is certain; None means "ask the database".
        """
        with self._lock:
            tid = self._tid_at(oid, snapshot)
            if tid is None:
                self.unknown += 1
            else:
                self.answered += 1
            return tid

    def tids_at(self, oids, snapshot):
        """``tid_at`` for each of ``oids`` (a list of tids or Nones, in the
        same order), under one acquisition of the lock: prefetch asks
        for hundreds at a time."""
        with self._lock:
            tid_at = self._tid_at
            known, changes = self._known, self._changes
            # An object neither checked nor in the log is unknown (the
            # usual case of a cold prefetch): skip the full test.
            tids = [tid_at(oid, snapshot) if oid in known or oid in changes else None
                    for oid in oids]
            unknown = tids.count(None)
            self.unknown += unknown
            self.answered += len(tids) - unknown
            return tids

    def peek(self, oid, snapshot):
        """Like tid_at, without counting in the statistics."""
        with self._lock:
            return self._tid_at(oid, snapshot)

    def _tid_at(self, oid, snapshot):
        if self._poisoned and self._is_poisoned(snapshot):
            return None
        start = self._start
        entry = self._known.get(oid)
        if start is not None and start <= snapshot <= self._end:
            tids = self._changes.get(oid)
            if tids:
                i = bisect_right(tids, snapshot)
                if i < len(tids):
                    bound = self._bounds[bisect_left(self._bounds, snapshot)]
                    if bound != snapshot and tids[i] <= bound:
                        # Changed later in the segment holding the snapshot:
                        # an earlier change in that segment would be hidden.
                        return None
                if i:
                    return tids[i - 1]
            # No change of oid in (start, snapshot].
            if entry is not None:
                tid, checked = entry
                if tid <= snapshot and checked >= start:
                    return tid
            return None
        if entry is not None and entry[0] <= snapshot <= entry[1]:
            return entry[0]
        return None

    # ------------------------------------------------------------------
    # What the database said

    def record(self, oid, tid, snapshot, mark=None):
        """The database said ``tid`` is oid's current revision in ``snapshot``
        (which saw pack mark ``mark``: see fence)."""
        with self._lock:
            self._record_heard(oid, tid, snapshot, mark)

    def record_hint(self, oid, tid, as_of):
        """``record`` for what another process said (a shared cache's hint
        or hot list: ``tid`` was oid's current revision as of snapshot
        ``as_of``), unless the change log contradicts it: it covers
        ``tid`` and holds no change of oid there.  Such a hint comes from
        a history the database left (a backup restored, then committed to
        past it: a helper agent's check found a fresh process serving the
        abandoned history's states), or names a revision older than the
        newest of the log, which is not current anyway.  Returns whether
        it was recorded."""
        with self._lock:
            start = self._start
            if start is not None and start < tid <= self._end:
                tids = self._changes.get(oid, ())
                i = bisect_left(tids, tid)
                if i == len(tids) or tids[i] != tid:
                    return False
            return self._record_heard(oid, tid, as_of, None)

    def _record_heard(self, oid, tid, snapshot, mark):
        """(Lock held.)  ``record``'s work; False when what ``snapshot``
        says is not heard (``_unheard``)."""
        if self._unheard(snapshot, mark):
            return False
        self._record(oid, tid, snapshot)
        if len(self._known) > self.limit:
            self._shrink_known()
        return True

    def _unheard(self, snapshot, mark):
        """(Lock held.)  Whether what a snapshot says is ignored: fenced
        off by a pack, or of a history the database left."""
        return self._fenced(snapshot, mark) or (
            self._poisoned and self._is_poisoned(snapshot))

    def record_many(self, pairs, snapshot, mark=None):
        """``record`` for each (oid, tid) of ``pairs``, under one lock."""
        with self._lock:
            if self._unheard(snapshot, mark):
                return
            known = self._known
            for oid, tid in pairs:
                # _record, inlined.
                old = known.get(oid)
                if old is not None:
                    if snapshot <= old[1]:
                        continue
                    del known[oid]
                known[oid] = (tid, snapshot)
            if len(self._known) > self.limit:
                self._shrink_known()

    def _record(self, oid, tid, snapshot):
        known = self._known
        old = known.get(oid)
        if old is not None:
            if snapshot <= old[1]:
                return               # what we have is at least as recent
            del known[oid]           # re-insert: the dict's order is its age
        known[oid] = (tid, snapshot)

    def _shrink_known(self):
        drop = len(self._known) - (self.limit * 3) // 4
        for oid in list(self._known)[:drop]:
            del self._known[oid]

    def start_log(self, snapshot):
        """Start an empty change log at ``snapshot`` if there is none."""
        with self._lock:
            if self._start is None and not self._is_poisoned(snapshot):
                self._start_log_at(snapshot)

    def backfill(self, after, snapshot, rows, mark=None):
        """Start the change log at ``after`` rather than at ``snapshot``:
        ``rows`` are the newest change of every object changed in
        ``(after, snapshot]``, as read in ``snapshot``.  Only when there is
        no log yet (a fresh process): it makes older knowledge usable, such
        as a hint that says which tid was current in a snapshot in that
        window (shared.py)."""
        with self._lock:
            if self._start is not None or after > snapshot or self._unheard(snapshot, mark):
                return False
            self._merge(after, snapshot, rows)
            return True

    def _start_log_at(self, snapshot):
        self._reset_log()
        self._start = self._end = snapshot
        self._bounds = [snapshot]

    # ------------------------------------------------------------------
    # Polls

    def poll(self, prev, snapshot, query, mark=None):
        """The (oid, tid) changes in ``(prev, snapshot]`` and keep the log.

        ``prev`` None means "the caller has nothing to invalidate" (its
        first poll): the log is still extended to the snapshot.  An entry's
        tid may lie after the snapshot when the log cannot tell whether the
        object also changed before it; such over-reporting only costs the
        caller a reload.  ``query(after, snapshot)`` returns the newest
        change of every object changed in ``(after, snapshot]``.  ``mark``:
        the pack mark the snapshot saw (see fence).
        """
        with self._lock:
            self.polls += 1
            after = self._plan(prev, snapshot)
        if after is None:
            with self._lock:
                if self._covers(prev, snapshot):
                    self.polls_free += 1
                    return self._derive(prev, snapshot) if prev is not None else []
                after = prev if prev is not None else self._end
        if after is None or after >= snapshot:
            return []
        rows = [(oid, tid) for oid, tid in query(after, snapshot)]
        with self._lock:
            self._merge_above_floor(after, snapshot, rows, mark)
        if prev is None:
            return []
        if after <= prev:
            return [(oid, tid) for oid, tid in rows if tid > prev]
        with self._lock:
            if self._covers(prev, snapshot):
                return self._derive(prev, snapshot)
        # Lost a race with a restart of the log (or fenced off): ask for
        # exactly what we need.
        rows = list(query(prev, snapshot))
        with self._lock:
            self._merge_above_floor(prev, snapshot, rows, mark)
        return rows

    def _merge_above_floor(self, after, snapshot, rows, mark):
        # (Lock held.)  A poll in a snapshot below the fence, begun before
        # a pack that another thread has learned of since, may list a
        # change of an object the pack removed: in the log, it would tell
        # later snapshots that object is current (a review finding: they
        # loaded it, and a reference to it was committed).  Its changes
        # still go to its caller, for invalidation.
        if not self._fenced(snapshot, mark):
            self._merge(after, snapshot, rows)

    def _covers(self, prev, snapshot):
        """Whether the log can list the changes in (prev, snapshot] (or,
        prev None, answer for snapshot exactly)."""
        if self._start is None:
            return False
        low = snapshot if prev is None else prev
        return (self._start <= low and snapshot <= self._end
                and (prev is not None or snapshot in self._bound_set(snapshot)))

    def _bound_set(self, snapshot):
        i = bisect_left(self._bounds, snapshot)
        return self._bounds[i:i + 1]

    def _plan(self, prev, snapshot):
        """What to query, as the lower end of (after, snapshot]; None: nothing."""
        if self._poisoned and self._is_poisoned(snapshot):
            return None
        start, end = self._start, self._end
        if start is None:
            if prev is None:
                self._start_log_at(snapshot)
                return None
            return prev
        if prev is not None and (prev < start or prev > end):
            return prev                      # before the log, or a gap after it
        if snapshot > end:
            return end
        if snapshot < start:
            return None                      # prev is None: nothing to do
        i = bisect_left(self._bounds, snapshot)
        if self._bounds[i] == snapshot:
            return None
        return self._bounds[i - 1]           # split the segment holding it

    def _merge(self, after, snapshot, rows):
        """Add what the database said about (after, snapshot] in ``snapshot``."""
        if self._poisoned and self._is_poisoned(snapshot):
            return
        if self._start is None or after > self._end:
            # No log, or a gap after it: start again from here.
            if self._start is not None:
                self._fold(self._end)
            self._start_log_at(after)
            self._add_segment(snapshot, rows)
        elif snapshot < self._start:
            for oid, tid in rows:
                self._record(oid, tid, snapshot)
        else:
            if after < self._start:
                for oid, tid in rows:
                    if tid <= self._start:
                        self._record(oid, tid, snapshot)
                after = self._start
            if snapshot > self._end:
                end = self._end
                self._add_segment(snapshot, [(o, t) for o, t in rows if t > end])
            else:
                i = bisect_left(self._bounds, snapshot)
                if self._bounds[i] != snapshot and self._bounds[i - 1] >= after:
                    low = self._bounds[i - 1]
                    for oid, tid in rows:
                        if low < tid <= snapshot:
                            self._add_change(oid, tid)
                    self._bounds.insert(i, snapshot)
        if self._count > self.limit:
            self._trim()
        if len(self._known) > self.limit:
            self._shrink_known()

    def _add_segment(self, snapshot, rows):
        # _add_change, inlined for what a segment after the log's end
        # holds: tids newer than any the log has, which land at the end of
        # their lists (a 1000-object commit's poll adds 1000 rows, and the
        # general path cost about 1 us a row).  Anything else takes it.
        changes, by_tid, all_tids = self._changes, self._by_tid, self._tids
        added = 0
        for oid, tid in rows:
            tids = changes.get(oid)
            if tids is not None and tid <= tids[-1]:
                self._add_change(oid, tid)
                continue
            if tids is None:
                changes[oid] = [tid]
            else:
                tids.append(tid)
            group = by_tid.get(tid)
            if group is not None:
                group.append(oid)
            else:
                by_tid[tid] = [oid]
                if not all_tids or tid > all_tids[-1]:
                    all_tids.append(tid)
                else:
                    insort(all_tids, tid)
            added += 1
        self._count += added
        self._bounds.append(snapshot)
        self._end = snapshot

    def _add_change(self, oid, tid):
        tids = self._changes.get(oid)
        if tids is None:
            self._changes[oid] = [tid]
        elif tid in tids:
            return
        elif tid > tids[-1]:
            tids.append(tid)
        else:
            insort(tids, tid)
        oids = self._by_tid.get(tid)
        if oids is None:
            self._by_tid[tid] = [oid]
            if not self._tids or tid > self._tids[-1]:
                self._tids.append(tid)
            else:
                insort(self._tids, tid)
        else:
            oids.append(oid)
        self._count += 1

    def _derive(self, prev, snapshot):
        bounds = self._bounds
        bound = bounds[bisect_left(bounds, snapshot)]
        tids = self._tids
        result = {}
        for tid in tids[bisect_right(tids, prev):bisect_right(tids, bound)]:
            for oid in self._by_tid[tid]:
                if tid <= snapshot or oid not in result:
                    result[oid] = tid
        return list(result.items())

    # ------------------------------------------------------------------
    # Bounding the log

    def _trim(self):
        """Drop the oldest segments until the log is half full."""
        target = self.limit // 2
        removed = 0
        cut = None
        for tid in self._tids:
            if self._count - removed <= target:
                break
            removed += len(self._by_tid[tid])
            cut = tid
        if cut is None:
            return
        new_start = self._bounds[bisect_left(self._bounds, cut)]
        self._fold(new_start)

    def _fold(self, new_start):
        """Move the log's start to the boundary ``new_start``, keeping what
        the dropped part proved as checked-map entries at ``new_start``."""
        start = self._start
        latest = {}
        n = bisect_right(self._tids, new_start)
        for tid in self._tids[:n]:
            for oid in self._by_tid.pop(tid):
                latest[oid] = tid
                self._count -= 1
        del self._tids[:n]
        for oid in latest:
            tids = self._changes[oid]
            del tids[:bisect_right(tids, new_start)]
            if not tids:
                del self._changes[oid]
        known = self._known
        for oid, (tid, checked) in list(known.items()):
            if start <= checked < new_start and oid not in latest:
                known[oid] = (tid, new_start)     # unchanged since: still current
        for oid, tid in latest.items():
            self._record(oid, tid, new_start)
        del self._bounds[:bisect_left(self._bounds, new_start)]
        self._start = new_start
        if self._end < new_start:
            self._end = new_start
