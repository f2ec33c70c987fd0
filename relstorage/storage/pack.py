"""Pack: remove old revisions and, with GC, unreachable objects, on a live site.

Two phases (docs/pack.rst tells the user's side):

1. The pre-pack, without the commit lock.  In one read snapshot, the
   references of every revision committed since the last analysis are
   extracted once (states streamed in batches) into ``object_ref``, with
   the progress kept in ``pack_info``, so the next pack only reads what is
   new and a killed pack resumes.  Reachability is then computed by the
   database (adapters/packing.py): the result, in ``pack_object``, lists
   the objects to remove and the revisions to trim.

2. The deletion, in batches.  Each batch is a short transaction holding
   the commit lock (taken like a commit takes it) for at most
   ``pack-batch-timeout``; before deleting, it re-checks the candidates
   against everything committed since the analysis, so that an object a
   new commit made reachable again stays, with what it references.  It
   bumps the pack mark, so other processes drop what it removed.  Between
   batches the pack sleeps per ``pack-duty-cycle``.  Blob files go after
   the batch that removed their rows has committed.

Only one pack runs at a time (``acquire_pack_lock``).
"""
import logging
import os
import time

from persistent.TimeStamp import TimeStamp
from ZODB.utils import u64

from ..interfaces import RelStorageError
from ..interfaces import UnableToAcquireCommitLockError

log = logging.getLogger(__name__)

#: Revisions analysed per database transaction of the pre-pack.
ANALYSIS_BATCH = 2000
#: Candidates deleted per statement group of a deletion batch, to start with.
FIRST_DELETE_SIZE = 100
MAX_DELETE_SIZE = 20000
#: Attempts to take a busy commit lock before the pack gives up.
LOCK_ATTEMPTS = 20


class PackRunningError(RelStorageError):
    """Another pack of the same database holds the pack lock."""


class PackError(RelStorageError):
    """The pack stopped before deleting anything (e.g. an unreadable state)."""


class PackReport:
    """What a pack found and did; zodbpack prints ``summary()``."""

    def __init__(self):
        self.pack_tid = 0
        self.analysed = 0           # revisions whose references were extracted
        self.candidates = (0, 0, 0, 0)  # objects, revisions, bytes, blobs (pre-pack)
        self.objects_removed = 0
        self.revisions_removed = 0
        self.blobs_removed = 0
        self.transactions_removed = 0
        self.kept_by_new_commits = 0
        self.batches = 0
        self.lock_seconds = 0.0
        self.longest_lock = 0.0
        self.seconds = 0.0
        self.prepack_only = False
        self.orphan_blob_files = []

    def summary(self):
        if self.prepack_only:
            objects, revisions, size, blobs = self.candidates
            return ('pre-pack only: would remove %d objects, %d revisions (%d bytes), '
                    '%d blobs; nothing removed (%.1fs)'
                    % (objects, revisions, size, blobs, self.seconds))
        return ('removed %d objects, %d revisions, %d blobs in %.1fs '
                '(commit lock held %.2fs in %d batches, longest %.3fs)'
                % (self.objects_removed, self.revisions_removed, self.blobs_removed,
                   self.seconds, self.lock_seconds, self.batches, self.longest_lock))


class _NoProgress:
    def __init__(self, *args, **kw):
        pass

    def update(self, n=1):
        pass

    def close(self):
        pass


def pack_tid_for(t):
    return u64(TimeStamp(*time.gmtime(t)[:5] + (t % 60,)).raw())


def pack(adapter, options, t, referencesf, gc, blobs=None, cache=None,
         prepack_only=False, skip_prepack=False, progress=None):
    """Pack the database of ``adapter`` to time ``t``; return a PackReport."""
    progress = progress or _NoProgress
    report = PackReport()
    report.prepack_only = prepack_only
    started = time.time()
    lock = _acquire(adapter)
    conn = None
    try:
        conn = adapter.open_pack()
        if skip_prepack:
            info = adapter.pack_info(conn)
            conn.rollback()
            if not info.get('prepared'):
                raise PackError(
                    "No pre-pack analysis of %s to use: run zodbpack --prepack "
                    "(or pack-prepack-only) first." % adapter.describe())
            report.pack_tid = info['pack_tid']
        else:
            snapshot_tid = _analyse(adapter, conn, referencesf, report, progress)
            report.pack_tid = min(pack_tid_for(t), snapshot_tid)
            bar = progress('computing reachability', None, 'steps')
            bar.update(adapter.compute_pack_candidates(conn, report.pack_tid, gc))
            bar.close()
            adapter.set_pack_info(conn, pack_tid=report.pack_tid,
                                  checked_tid=snapshot_tid, prepared=1)
            conn.commit()
        report.candidates = adapter.pack_candidate_stats(conn)
        conn.rollback()
        if not prepack_only:
            _delete(adapter, conn, options, referencesf, blobs, report, progress)
            if blobs is not None and not blobs.in_database:
                report.orphan_blob_files = orphan_blob_files(adapter, blobs)
    except BaseException:
        if conn is not None:
            conn.rollback()
        raise
    finally:
        if conn is not None:
            conn.close()
        lock.close()
        if cache is not None and not prepack_only:
            cache.clear()
    report.seconds = time.time() - started
    log.info("Pack of %s to %x: %s", adapter.describe(), report.pack_tid, report.summary())
    for path in report.orphan_blob_files[:20]:
        log.warning("Blob file without a database row: %s", path)
    return report


def check_references(adapter, referencesf, progress=None):
    """Bring the recorded references up to date; return (oid, tid,
    missing oid) for each reference of a current revision to an object
    that does not exist."""
    lock = _acquire(adapter)
    conn = None
    try:
        conn = adapter.open_pack()
        _analyse(adapter, conn, referencesf, PackReport(), progress or _NoProgress)
        missing = adapter.missing_references(conn)
        conn.rollback()
        return missing
    finally:
        if conn is not None:
            conn.close()
        lock.close()


def _acquire(adapter):
    lock = adapter.acquire_pack_lock()
    if lock is None:
        raise PackRunningError("A pack of %s is already running." % adapter.describe())
    return lock


# ----------------------------------------------------------------------
# Phase 1: references.

def _analyse(adapter, conn, referencesf, report, progress):
    """Record the references of every revision committed since the last
    analysis, up to a snapshot; return the snapshot's tid."""
    load = adapter.open_load()
    try:
        adapter.begin_snapshot(load)
        snapshot_tid = adapter.get_last_tid(load)
        adapter.begin_store_checked(conn)
        done = adapter.pack_info(conn).get('refs_tid', 0)
        # An analysis killed part way through a tid left some of its rows.
        adapter.forget_refs_after(conn, done)
        conn.commit()
        bar = progress('analysing references',
                       adapter.count_revisions(load, done, snapshot_tid), 'revisions')
        oids, rows = [], []
        current = None
        completed = done
        try:
            for oid, tid, state in adapter.iter_revisions(load, done, snapshot_tid):
                if tid != current:
                    if current is not None:
                        completed = current
                    current = tid
                    if len(oids) >= ANALYSIS_BATCH:
                        _record(adapter, conn, oids, rows, completed)
                        bar.update(len(oids))
                        oids, rows = [], []
                elif len(oids) >= 10 * ANALYSIS_BATCH:
                    # One huge transaction: record it in pieces without
                    # advancing the progress (a rerun forgets them).
                    _record(adapter, conn, oids, rows, completed)
                    bar.update(len(oids))
                    oids, rows = [], []
                oids.append(oid)
                rows.extend((oid, tid, ref)
                            for ref in sorted(_references(referencesf, oid, tid, state)))
                report.analysed += 1
            _record(adapter, conn, oids, rows, snapshot_tid)
            bar.update(len(oids))
        finally:
            bar.close()
        return snapshot_tid
    finally:
        load.rollback()
        load.close()


def _references(referencesf, oid, tid, state):
    """The OIDs (ints) a state references; PackError if it cannot be read."""
    if state is None:
        return set()
    try:
        return {u64(r) for r in referencesf(bytes(state))}
    except Exception as exc:
        raise PackError(
            "Cannot read the references of object 0x%x at transaction 0x%x (%s: %s); "
            "the pack stopped without removing anything more."
            % (oid, tid, type(exc).__name__, exc)) from exc


def _record(adapter, conn, oids, rows, completed_tid):
    adapter.begin_store_checked(conn)
    adapter.add_refs(conn, oids, rows)
    adapter.set_pack_info(conn, refs_tid=completed_tid)
    conn.commit()


# ----------------------------------------------------------------------
# Phase 2: deletion in batches.

def _delete(adapter, conn, options, referencesf, blobs, report, progress):
    info = adapter.pack_info(conn)
    conn.rollback()
    checked = info['checked_tid']
    # Catch up with the commits made during the analysis without the lock;
    # under the lock only the last few remain to be read.
    adapter.begin_store_checked(conn)
    last = adapter.get_last_tid(conn)
    report.kept_by_new_commits += _recheck(adapter, conn, referencesf, checked, last)
    adapter.set_pack_info(conn, checked_tid=last)
    conn.commit()
    checked = last

    bar = progress('deleting', report.candidates[0] + report.candidates[1] or None, 'rows')
    size = FIRST_DELETE_SIZE
    after_oid = -1
    try:
        while True:
            locked_at, last = _lock_commit(adapter, conn, options)
            try:
                report.kept_by_new_commits += _recheck(adapter, conn, referencesf, checked, last)
                removed, trimmed = [], []
                batch_revisions = 0
                finished = False
                while True:
                    part_started = time.time()
                    rows, revisions, objects, blob_count = adapter.delete_pack_batch(
                        conn, after_oid, size)
                    if not rows:
                        finished = True
                        break
                    after_oid = rows[-1][0]
                    for oid, below, garbage in rows:
                        if garbage:
                            removed.append(oid)
                        else:
                            trimmed.append((oid, below))
                    report.revisions_removed += revisions
                    report.objects_removed += objects
                    report.blobs_removed += blob_count
                    batch_revisions += revisions
                    part = time.time() - part_started
                    size = _next_size(size, part, options.pack_batch_timeout)
                    if time.time() - locked_at + part >= options.pack_batch_timeout:
                        break
                adapter.set_pack_info(conn, checked_tid=last)
                if removed or trimmed:
                    # In the batch's transaction: whoever sees the deletions
                    # sees the new mark, and drops its caches.
                    adapter.bump_pack_mark(conn)
                conn.commit()
            except BaseException:
                conn.rollback()
                raise
            held = time.time() - locked_at
            checked = last
            report.batches += 1
            report.lock_seconds += held
            report.longest_lock = max(report.longest_lock, held)
            if blobs is not None and (removed or trimmed):
                # Only now that the rows are gone for good.
                files = blobs.forget(removed, trimmed)
                if not blobs.in_database:
                    report.blobs_removed += files
            # After the commit: a display (or a test) sees a finished batch.
            bar.update(batch_revisions)
            if finished:
                break
            time.sleep(_duty_cycle_sleep(held, options))
        adapter.begin_store_checked(conn)
        report.transactions_removed = adapter.finish_pack(conn, report.pack_tid)
        adapter.set_pack_info(conn, prepared=None, pack_tid=None, checked_tid=None)
        conn.commit()
    finally:
        bar.close()


def _lock_commit(adapter, conn, options):
    """Take the commit lock the way a commit does; when it stays busy
    (UnableToAcquireCommitLockError), wait pack-commit-busy-delay and try
    again.  Returns the time it was taken and the last committed tid."""
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            adapter.begin_store_checked(conn)
            last = adapter.lock_commit_checked(conn)
            return time.time(), last
        except UnableToAcquireCommitLockError:
            conn.rollback()
            if attempt == LOCK_ATTEMPTS:
                raise
            log.info("The commit lock of %s is busy; the pack waits %.1fs",
                     adapter.describe(), options.pack_commit_busy_delay)
            time.sleep(options.pack_commit_busy_delay)
    raise AssertionError('unreachable')


def _recheck(adapter, conn, referencesf, after_tid, upto_tid):
    """Drop from the candidates what commits in (after_tid, upto_tid] made
    reachable again; return how many."""
    if upto_tid <= after_tid:
        return 0
    referenced = set()
    for oid, tid, state in adapter.new_revisions(conn, after_tid, upto_tid):
        referenced.update(_references(referencesf, oid, tid, state))
    kept = adapter.rescue_candidates(conn, after_tid, referenced)
    if kept:
        log.info("%d pack candidates of %s were made reachable again by new commits "
                 "and are kept", kept, adapter.describe())
    return kept


def _next_size(size, seconds, timeout):
    if seconds > timeout / 4:
        return max(50, size // 2)
    if seconds < timeout / 20:
        return min(MAX_DELETE_SIZE, size * 2)
    return size


def _duty_cycle_sleep(held, options):
    duty = options.pack_duty_cycle
    if duty >= 1:
        return 0
    return min(options.pack_max_delay, held * (1 - duty) / duty)


# ----------------------------------------------------------------------
# Blob files that no row describes (shared blob directories).

def orphan_blob_files(adapter, blobs):
    """Paths of blob files under the shared blob directory whose revision
    has no row in the database (left by an interrupted pack, say)."""
    found = []
    root = blobs.blob_dir
    pending = []
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            if not name.endswith('.blob'):
                continue
            try:
                oid = blobs.fshelper.getOIDForPath(dirpath)
                tid = int(name[:-5].replace('0x', ''), 16)
            except (ValueError, TypeError):
                continue      # not a blob revision (temporary files)
            pending.append((oid, tid, os.path.join(dirpath, name)))
    if not pending:
        return found
    conn = adapter.open_load()
    try:
        adapter.begin_snapshot(conn)
        for oid, tid, path in pending:
            exists, _state = adapter.load_revision(conn, u64(oid), tid)
            if not exists:
                found.append(path)
    finally:
        conn.rollback()
        conn.close()
    return found

