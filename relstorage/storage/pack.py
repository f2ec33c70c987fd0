"""Pack: remove old revisions and, with GC, unreachable objects, on a live site.

Two phases (docs/pack.rst tells the user's side):

1. The pre-pack, without the commit lock.  The references of every
   revision committed since the last analysis are extracted once (states
   streamed in batches, pages of them in short read snapshots, see
   _analyse) into ``object_ref``, with
   the progress kept in ``pack_info``, so the next pack only reads what is
   new and a killed pack resumes.  Reachability is then computed by the
   database (adapters/packing.py): the result, in ``pack_object``, lists
   the objects to remove and the revisions to trim.

2. The deletion, in batches.  Each batch is a short transaction that
   deletes candidates first, without the commit lock (commits write other
   rows meanwhile), then re-checks the commits made since the previous
   batch, takes the commit lock (as a commit does) to read the last ones,
   and commits.  Holding the lock from that last re-check to the commit
   is what makes it safe: no commit can land between them.  If a commit
   changed or references a candidate, the batch is undone, what the
   commits made reachable again is kept (with what it reaches through
   other candidates), and the batch is redone.  Where the commit lock is
   the database's write lock (SQLite) the batch holds it throughout and
   is kept short.  The batch moves the pack mark on and lists what it
   removed in ``pack_removed_list``, so other processes forget only that.
   Between batches the pack sleeps per ``pack-duty-cycle``.  Blob files go
   after the batch that removed their rows has committed.

A pack with nothing committed since the last completed one stops at once
(``_up_to_date``).

Only one pack runs at a time (``acquire_pack_lock``).
"""
import logging
import os
import queue
import threading
import time
from io import BytesIO
from itertools import repeat
from struct import error as StructError
from struct import unpack

from persistent.TimeStamp import TimeStamp
from zodbpickle.pickle import Unpickler
from ZODB.serialize import referencesf as zodb_referencesf
from ZODB.utils import p64
from ZODB.utils import u64

from ..adapters.base import chunks
from ..blobs.common import remove_file as remove_blob_file
from ..adapters.packing import next_step_size
from ..interfaces import RelStorageError
from ..interfaces import UnableToAcquireCommitLockError
from ..tids import tid_of_time

_EIGHT = {8}

log = logging.getLogger(__name__)

#: Revisions analysed per database transaction of the pre-pack.  Fewer,
#: larger transactions: the thread recording them waits for the
#: interpreter lock after every statement (up to the switch interval, 5
#: ms, while this one unpickles).  (10,000 made zodbpack's peak RSS 76 MB
#: against 52 at a million objects.)
ANALYSIS_BATCH = 5000
#: Revisions whose references are read in one pass (_references_of_rows),
#: their states joined in streams of at most JOINED_BYTES each.
READ_CHUNK = 1000
#: History-free, the analysis ends by reading the revisions committed while
#: it ran in one snapshot when there are at most this many (else in pages,
#: and then those committed meanwhile).
CATCH_UP_AT_ONCE = 20000
JOINED_BYTES = 8 * 1024 * 1024
#: Candidates deleted per statement group of a deletion batch, to start with.
FIRST_DELETE_SIZE = 100
MAX_DELETE_SIZE = 20000
#: Objects (removed or trimmed) per deletion batch at most.  Every other
#: process reads the list of what a batch removed at its next poll (one
#: query, before its next transaction can start): 125,000 rows held a
#: commit 160-210 ms on PostgreSQL, once per batch.
MAX_BATCH_ROWS = 5000
#: Attempts to take a busy commit lock before the pack gives up.
LOCK_ATTEMPTS = 20
#: The shortest pause between two deletion batches on a single-writer
#: database while a commit waits (seconds): longer than a waiting
#: commit's longest step between two tries (adapters/sqlite
#: WRITE_WAIT_MAX), so that a commit that met a batch gets the lock
#: before the next one (_writers_turn).
WRITERS_TURN = 0.0012
#: The most of the pack's own work between batches (beyond the pause that
#: one batch asked for) that counts toward the pauses of the batches after
#: it (seconds): see _Pauses.
PAUSE_CREDIT_MAX = 0.1


class PackRunningError(RelStorageError):
    """Another pack of the same database holds the pack lock."""


class PackError(RelStorageError):
    """The pack stopped before deleting anything (e.g. an unreadable state)."""


class PackReport:
    """What a pack found and did; zodbpack prints ``summary()``."""

    def __init__(self):
        self.pack_tid = 0
        self.analysed = 0           # revisions whose references were extracted
        # objects, revisions, bytes, blobs: counted for --prepack and the
        # progress display only.
        self.candidates = (0, 0, 0, 0)
        self.objects_removed = 0
        self.revisions_removed = 0
        self.blobs_removed = 0
        self.transactions_removed = 0
        self.kept_by_new_commits = 0
        self.batches = 0
        self.lock_seconds = 0.0
        self.longest_lock = 0.0
        self.seconds = 0.0
        # Seconds per phase ('analysis', 'reachability', 'deletion'), in
        # the order they ran.
        self.phases = {}
        self.prepack_only = False
        self.orphan_blob_files = []
        self.up_to_date = False     # nothing committed since the last pack
        # Objects an incremental reachability examined (None: all of them).
        self.reach_domain = None

    def summary(self):
        if self.up_to_date:
            text = ('nothing to remove: no transaction was committed since the last '
                    'completed pack (%.1fs)' % self.seconds)
            if self.blobs_removed:
                # (The files of replaced revisions a shared blob directory
                # still had: see sweep_blob_files.)
                text += '; removed %d blob files of replaced revisions' % self.blobs_removed
            return text
        if self.prepack_only:
            objects, revisions, size, blobs = self.candidates
            return ('pre-pack only: would remove %d objects, %d revisions (%d bytes), '
                    '%d blobs; nothing removed (%.1fs)'
                    % (objects, revisions, size, blobs, self.seconds))
        return ('removed %d objects, %d revisions, %d blobs in %.1fs '
                '(%scommit lock held %.2fs in %d batches, longest %.3fs)'
                % (self.objects_removed, self.revisions_removed, self.blobs_removed,
                   self.seconds, self._phases_text(), self.lock_seconds, self.batches,
                   self.longest_lock))

    def _phases_text(self):
        if not self.phases:
            return ''
        parts = []
        for name, seconds in self.phases.items():
            parts.append('%s %.1fs' % (name, seconds))
            if name == 'reachability' and self.reach_domain is not None:
                parts[-1] += ' (incremental, %d objects)' % self.reach_domain
        return ', '.join(parts) + '; '


class _NoProgress:
    def __init__(self, *args, **kw):
        pass

    def update(self, n=1):
        pass

    def close(self):
        pass


def pack(adapter, options, t, referencesf, gc, blobs=None, cache=None,
         prepack_only=False, skip_prepack=False, progress=None):
    """Pack the database of ``adapter`` to time ``t``; return a PackReport."""
    progress = progress or _NoProgress
    report = PackReport()
    report.prepack_only = prepack_only
    started = time.monotonic()
    lock = _acquire(adapter)
    conn = None
    try:
        conn = _when_free(adapter, adapter.open_pack)
        if gc:
            _check_copy_finished(adapter, conn)
            _check_root(adapter, conn)
        shared_blobs = blobs is not None and not blobs.in_database
        if shared_blobs and not prepack_only:
            report.blobs_removed += _forget_unfinished(adapter, conn, blobs)
        if skip_prepack:
            info = adapter.pack_info(conn)
            conn.rollback()
            if not info.get('prepared'):
                raise PackError(
                    "No pre-pack analysis of %s to use: run zodbpack --prepack "
                    "(or pack-prepack-only) first." % adapter.describe())
            made_with = info.get('prepared_gc')
            if made_with is not None and bool(made_with) != bool(gc):
                # (A helper agent's check: the deletion followed the
                # analysis's setting, and collected garbage under a
                # configuration that had turned it off, as sites do for
                # references from other databases.)
                raise PackError(
                    "The pre-pack analysis of %s was made with pack-gc %s, and this "
                    "configuration has pack-gc %s: nothing was removed. Run zodbpack "
                    "--prepack again with this configuration, or use the one the "
                    "analysis was made with." % (adapter.describe(),
                                                 'true' if made_with else 'false',
                                                 'true' if gc else 'false'))
            report.pack_tid = info['pack_tid']
        elif not prepack_only and _up_to_date(adapter, conn, gc):
            report.up_to_date = True
            # (For the log: a helper agent's check saw "to 0x0000000000000000".)
            report.pack_tid = tid_of_time(t)
        else:
            phase_start = time.monotonic()
            wanted = tid_of_time(t)
            snapshot_tid = _analyse(adapter, conn, referencesf, report, progress,
                                    pack_tid=wanted)
            _warn_if_ahead(adapter, snapshot_tid)
            report.pack_tid = min(wanted, snapshot_tid)
            report.phases['analysis'] = time.monotonic() - phase_start
            phase_start = time.monotonic()
            bar = progress('computing reachability', None, 'steps')
            steps, report.reach_domain = adapter.compute_pack_candidates(
                conn, report.pack_tid, gc, snapshot_tid=snapshot_tid)
            bar.update(steps)
            bar.close()
            report.phases['reachability'] = time.monotonic() - phase_start
            adapter.set_pack_info(conn, pack_tid=report.pack_tid,
                                  checked_tid=snapshot_tid, prepared=1,
                                  prepared_gc=1 if gc else 0)
            conn.commit()
        if not report.up_to_date and (prepack_only or progress is not _NoProgress):
            # For the report and the deletion's progress display only (a
            # second or so at a million objects).
            report.candidates = adapter.pack_candidate_stats(conn)
            if prepack_only and shared_blobs:
                # (Not left in a transaction while it walks the blob
                # directory, which may take long: the server may end a
                # store session idle in one, a review finding.  What it
                # asks next of this session was committed above.)
                conn.rollback()
                # The blob files are the count there, not blob_chunk rows.
                files, _ = sweep_blob_files(adapter, blobs, report.pack_tid,
                                            remove=False, pack_conn=conn)
                report.candidates = report.candidates[:3] + (files,)
        conn.rollback()
        if not prepack_only:
            if not report.up_to_date:
                phase_start = time.monotonic()
                _delete(adapter, conn, options, referencesf, blobs, report, progress)
                report.phases['deletion'] = time.monotonic() - phase_start
            if shared_blobs:
                # (The pack time of the rows: the analysis's, that of the
                # --prepack it goes on from, or, up to date, the one asked.)
                removed, report.orphan_blob_files = sweep_blob_files(
                    adapter, blobs, report.pack_tid or tid_of_time(t))
                report.blobs_removed += removed
    except BaseException:
        if conn is not None:
            conn.rollback()
        raise
    finally:
        if conn is not None:
            conn.close()
        lock.close()
        if cache is not None and not prepack_only and not report.up_to_date:
            cache.clear()
    report.seconds = time.monotonic() - started
    log.info("Pack of %s to 0x%016x: %s", adapter.describe(), report.pack_tid, report.summary())
    for path in report.orphan_blob_files[:20]:
        log.warning("Blob file without a database row: %s", path)
    return report


def _check_copy_finished(adapter, conn):
    """Refuse to collect garbage while a copy into the database has not
    finished (copy.unfinished): a copy cut short holds objects whose
    referrers it has not copied yet, which the pack would remove for good
    (a helper agent's check: from a history-free source, whose objects
    come under the transaction of their current revision, the root was
    copied, a container of the root's was not, and a nightly pack removed
    168 of the 169 objects copied; the copy's resume then referred to
    missing objects)."""
    try:
        _refuse_unfinished_copy(adapter, conn, 'Nothing was removed.')
    finally:
        conn.rollback()


def _refuse_unfinished_copy(adapter, conn, what_was_done):
    """Raise the refusal (_copy_not_finished) while a copy may not have
    finished (Adapter.unfinished_copy)."""
    began, copied = adapter.unfinished_copy(conn)
    if began is not None or copied is not None:
        raise _copy_not_finished(adapter, began, copied, what_was_done)


def _copy_not_finished(adapter, began, copied, what_was_done):
    """The refusal: ``began`` from zodbconvert's mark (copy.unfinished),
    ``copied`` the tid of a copied transaction that is the last committed
    (Adapter.unfinished_copy)."""
    if began is None:
        return PackError(
            "The last transaction of %s (%016x) was copied into it with its own tid (a "
            "copy by ZODB's copyTransactionsFromTo, as zc.zlibstorage's "
            "copyTransactionsFrom makes it, or a copy through ZEO), and none has been "
            "committed since: nothing tells whether the copy has finished, and objects it "
            "copied may be referenced only by objects it has not copied yet, which a pack "
            "with garbage collection would remove. %s If the copy has finished, the next "
            "transaction committed to the database ends this (as does zodbconvert "
            "--incremental with the same source, written directly into the database, "
            "which finds nothing left to copy; or DELETE FROM commit_lock WHERE id = 7); "
            "if not, finish it first. pack-gc false packs history only."
            % (adapter.describe(), copied, what_was_done))
    when = time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(began))
    return PackError(
        "A copy into %s began at %s and has not finished (zodbconvert interrupted, "
        "or still running): objects it copied may be referenced only by objects it "
        "has not copied yet, which a pack with garbage collection would remove. %s "
        "Finish the copy (zodbconvert --incremental) first; pack-gc false packs history "
        "only. (If the copy is abandoned and the database is to be used as it is, "
        "DELETE FROM commit_lock WHERE id IN (6, 7) removes this mark; after a pack, the "
        "copy can no longer be resumed: make it again with zodbconvert --clear.)"
        % (adapter.describe(), when, what_was_done))


def _check_root(adapter, conn):
    """Refuse to collect garbage where there is no root object but other
    objects: everything would go (a helper agent's check: a cron pack of a
    history-free copy cut short before its root was copied removed every
    object, and the copy's resume could not bring them back)."""
    root = adapter.load_current(conn, 0)
    missing = root is None or root[0] is None
    count = adapter.count_objects(conn) if missing else 0
    conn.rollback()
    if missing and count:
        raise PackError(
            "%s has no root object (0x00) but holds other objects: a pack with garbage "
            "collection would remove every one of them. Nothing was removed. (A "
            "zodbconvert copy not finished yet? Finish it with --incremental first; "
            "pack-gc false packs history only.)" % adapter.describe())


def check_references(adapter, referencesf, progress=None):
    """Bring the recorded references up to date; return (oid, tid,
    missing oid) for each reference of a current revision to an object
    that does not exist."""
    lock = _acquire(adapter)
    conn = None
    try:
        conn = _when_free(adapter, adapter.open_pack)
        _analyse(adapter, conn, referencesf, PackReport(), progress or _NoProgress)
        missing = adapter.missing_references(conn)
        conn.rollback()
        return missing
    finally:
        if conn is not None:
            conn.close()
        lock.close()


# How far (seconds) the database's last transaction may be dated after
# this machine's clock before the pack says so.
CLOCK_AHEAD_WARNING = 60


def _warn_if_ahead(adapter, last_tid):
    """The pack time is counted by this machine's clock; the transaction
    ids by the committing clients' (a helper agent's check: with clocks
    apart, a pack removed history seconds old, or none of a day's)."""
    if not last_tid:
        return
    ahead = TimeStamp(p64(last_tid)).timeTime() - time.time()
    if ahead > CLOCK_AHEAD_WARNING:
        log.warning(
            "The last transaction of %s is dated %.0f seconds after this machine's "
            "clock, which the pack time is counted by: a client's clock was ahead, "
            "or this one is behind. The pack keeps what was committed after its "
            "pack time by the transactions' dates.", adapter.describe(), ahead)


def _forget_unfinished(adapter, conn, blobs):
    """Remove the blob files of what the deletion batches of an earlier
    pack removed, where that pack stopped (killed) after a batch's commit
    and before the removal of its files; returns how many went.

    Those files describe no row any more, and the end of a pack, which
    finds them, cannot tell them from a file no row ever described (of a
    database restored from an older backup than its blob directory, say:
    the only copy of data), which it leaves alone. The removal lists of
    the batches (log_pack_removals, kept until the next pack's deletion
    starts) say what the batches removed; ``files_upto`` in pack_info
    is the mark of the last batch whose files went."""
    adapter.begin_pack_write(conn)
    try:
        done = adapter.pack_info(conn).get('files_upto')
        mark = adapter.pack_mark(conn)
        removals = None
        if done is not None and done < mark:
            removals = adapter.pack_removals(conn, done, mark)
        if done != mark:
            adapter.set_pack_info(conn, files_upto=mark)
        if removals is None or not len(removals):
            conn.commit()
            return 0
        # (Idempotent: files already gone are not an error.)
        files = blobs.forget(removals.garbage_ints(), removals.trimmed_pairs())
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    log.info("Removed %d blob files of what an earlier pack of %s removed before "
             "it stopped", files, adapter.describe())
    return files


def _up_to_date(adapter, conn, gc):
    """True when the last pack completed (with GC if ``gc``) and no
    transaction was committed since its pack time: then it removed all a
    pack can remove now (a later pack time sees the same database), and
    the analysis and reachability need not run again."""
    adapter.begin_pack_write(conn)
    info = adapter.pack_info(conn)
    last = adapter.get_last_tid(conn)
    conn.rollback()
    packed = info.get('packed_tid')
    return (packed is not None and not info.get('prepared')
            and (info.get('packed_gc') or not gc) and 0 < last <= packed)


def _acquire(adapter):
    lock = adapter.acquire_pack_lock()
    if lock is None:
        raise PackRunningError("A pack of %s is already running." % adapter.describe())
    return lock


# ----------------------------------------------------------------------
# Phase 1: references.

def _analyse(adapter, conn, referencesf, report, progress, pack_tid=None):
    """Record the references of every revision committed since the last
    analysis, as of a snapshot (read in pages, each in a snapshot of its
    own: see iter_revisions); return the snapshot's tid.  With
    ``pack_tid`` (a pack, history-preserving), not those of revisions
    replaced by one of that time or before (iter_revisions)."""
    load = adapter.open_primary_load()
    try:
        adapter.begin_snapshot(load)
        snapshot_tid = adapter.get_last_tid(load)
        kept_at = None
        if pack_tid is not None and adapter.keep_history:
            kept_at = min(pack_tid, snapshot_tid)
        _when_free(adapter, lambda: adapter.pair_pack_tables(conn))
        adapter.begin_pack_write(conn)
        done = _refs_kept_at(adapter, conn, adapter.pack_refs_tid(conn), kept_at)
        # An analysis killed part way through a tid left some of its rows.
        adapter.forget_refs_after(conn, done)
        seeds = adapter.records_seeds(conn)
        # (The first analysis: object_ref is empty now.)
        fresh = not done
        conn.commit()
        # The total only for a display: counting reads every revision
        # to analyse once more (1 s at 4,000,000 objects on PostgreSQL).
        bar = progress('analysing references',
                       None if progress is _NoProgress
                       else adapter.count_revisions(load, done, snapshot_tid, kept_at),
                       'revisions')
        oids, rows = [], []
        current = None
        completed = done
        analysed = 0
        read = _reference_reader(referencesf)
        # A _record only costs the pack (it writes the pack's own tables,
        # which no commit waits for: on SQLite they are in a file of
        # their own): it runs in a thread of its own while this one reads
        # and unpickles the next batch (the database inserts while Python
        # unpickles).
        size = ANALYSIS_BATCH
        recorder = _Worker('relstorage-pack-analysis')

        def record(upto_tid, oids, rows, fresh):
            try:
                _record(adapter, conn, oids, rows, upto_tid, seeds, fresh)
            except BaseException:
                # (Not left open, holding its locks, until the error
                # reaches the caller.)
                _rollback_quietly(conn)
                raise

        def flush(upto_tid, fresh):
            nonlocal oids, rows
            recorder.submit(record, upto_tid, oids, rows, fresh)
            bar.update(len(oids))
            oids, rows = [], []

        def analyse(revisions, upto_tid, fresh):
            nonlocal current, completed, analysed
            # (A thread of its own reading the rows ahead made the
            # analysis slower: the rows are made under the interpreter
            # lock, and it changed hands at every list.)
            for chunk in chunks(revisions, READ_CHUNK):
                for (oid, tid, _), refs in zip(chunk, _references_of_rows(read, chunk),
                                               strict=True):
                    if tid != current:
                        if current is not None:
                            completed = current
                        current = tid
                        if len(oids) >= size:
                            flush(completed, fresh)
                    elif len(oids) >= 10 * size:
                        # One huge transaction: record it in pieces without
                        # advancing the progress (a rerun forgets them).
                        flush(completed, fresh)
                    oids.append(oid)
                    analysed += 1
                    if refs:
                        rows.extend(zip(repeat(oid), repeat(tid), refs))
            flush(upto_tid, fresh)

        try:
            analyse(adapter.iter_revisions(load, done, snapshot_tid, kept_at),
                    snapshot_tid, fresh)
            if not adapter.keep_history:
                # iter_revisions read in pages, each in a snapshot of its
                # own, and left out the revisions that commits made
                # meanwhile replaced before their page came (their objects
                # would reach nothing: the deletion's re-check would have
                # to bring back everything below them, at a large cost
                # when that is a container every commit changes).  So the
                # revisions committed since are read too, and those
                # committed during that, until few enough are left to read
                # in one snapshot, which the pack then goes on from: the
                # references recorded are those of that snapshot, as if
                # the whole analysis had read in it (a revision current
                # there was current when its page was read).  An object
                # read twice keeps the references of its later revision
                # (not fresh: its earlier ones go).
                completed, current = snapshot_tid, None
                while True:
                    latest = adapter.renew_snapshot(load, snapshot_tid)
                    if latest == snapshot_tid:
                        break
                    last = adapter.count_revisions(load, snapshot_tid, latest) <= CATCH_UP_AT_ONCE
                    analyse(adapter.iter_revisions(load, snapshot_tid, latest,
                                                   page=0 if last else None),
                            latest, False)
                    snapshot_tid = latest
                    if last:
                        break
            recorder.wait()
        finally:
            report.analysed += analysed
            # (conn is the caller's again only once no batch is in flight.)
            recorder.close()
            bar.close()
        return snapshot_tid
    finally:
        load.rollback()
        load.close()


def _refs_kept_at(adapter, conn, done, kept_at):
    """The tid after which the analysis starts, ``done`` unless the
    recorded references lack some it needs; records ``kept_at`` (see
    PACK_REVISIONS_KEPT).  Revisions up to ``done`` were analysed without
    those replaced by one of pack_info's ``refs_kept_at`` or before: a
    pack to that time or later does not need them, a pack to an earlier
    time does, and all is analysed again (it is rare: zodbpack --prepack
    -d 0, then a pack with -d 7, say).  Without ``kept_at`` (zodbpack
    --check-refs-only, or history-free) nothing changes: the current
    revisions are never let out."""
    if kept_at is None:
        return done
    info = adapter.pack_info(conn)
    left_out = info.get('refs_kept_at')
    # (A completed pack to refs_kept_at or later removed every revision
    # left out.)
    gone = left_out is not None and info.get('packed_tid', 0) >= left_out
    if done and left_out is not None and kept_at < left_out and not gone:
        log.info("The pack of %s is to an earlier time than the last analysis, which "
                 "did not record the references of revisions it replaced before "
                 "its own pack time: analysing every revision again.", adapter.describe())
        adapter.forget_refs_after(conn, 0)
        # An earlier pre-pack's candidates were computed from what goes
        # now: no --use-prepack-state may trust them, should this pack
        # stop before its own reachability replaces them.
        adapter.set_pack_info(conn, refs_tid=None, seed_base=None, prepared=None,
                              prepared_gc=None, pack_tid=None)
        done = 0
    if not done or left_out is None or kept_at > left_out:
        adapter.set_pack_info(conn, refs_kept_at=kept_at)
    return done


class _Worker:
    """Runs one call at a time in a thread of its own (started with the
    first call, ended by close): the caller goes on with other work
    meanwhile, and each submit waits for the call before (the analysis's
    batches commit in order, so pack_info's refs_tid never passes a batch
    not recorded).  The error of a call is raised by the next submit or
    wait."""

    def __init__(self, name):
        self._name = name
        self._calls = queue.SimpleQueue()
        self._done = threading.Event()
        self._error = None          # of the last call, until wait raises it
        self._thread = None
        self._pending = False

    def submit(self, func, *args):
        self.wait()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._done.clear()
        self._pending = True
        self._calls.put((func, args))

    def _run(self):
        calls, done = self._calls, self._done
        while True:
            call = calls.get()
            if call is None:
                return
            func, args = call
            try:
                func(*args)
            except BaseException as exc:  # pylint:disable=broad-except
                self._error = exc
            done.set()

    def join(self):
        """Wait until no call is in flight, even through an interrupt
        (raised afterwards): the caller rolls back and closes the
        connection next.  A call's error is kept for wait.  (An event,
        which can be waited for again, where a queue's item taken at the
        moment of an interrupt would be lost, and the next wait
        endless.)"""
        if not self._pending:
            return
        interrupted = None
        while True:
            try:
                self._done.wait()
                break
            except BaseException as exc:  # pylint:disable=broad-except
                interrupted = exc
        self._pending = False
        if interrupted is not None:
            raise interrupted

    def wait(self):
        self.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self):
        """join, then end the thread."""
        try:
            self.join()
        finally:
            if self._thread is not None:
                self._calls.put(None)
                self._thread = None


def _reference_reader(referencesf):
    """``referencesf``, or the same done at less cost per state when it
    is ZODB's (the analysis reads a million revisions at a million
    objects): see _references_of_rows."""
    return _ZODBReferences() if referencesf is zodb_referencesf else referencesf


class _ZODBReferences:
    """What ZODB.serialize.referencesf returns, without building its
    wrapper classes for every state (a third of the per-revision cost):
    the OIDs of the ordinary references, weak and cross-database ones
    (lists) left out.  Every state is read whole, even one without any
    reference: one that cannot be read stops the pack (its references,
    lost in the damage, may be what keeps other objects alive).  The
    analysis reads states a thousand at a time (many); one state alone
    (a state many() cannot take as it is) with an unpickler of its own."""

    def __call__(self, state):
        found = []
        unpickler = Unpickler(BytesIO(state))
        unpickler.persistent_load = found.append
        unpickler.noload()      # the class
        unpickler.noload()      # the state
        return _found_oids(found)

    def many(self, states):
        """This reader's result for each of ``states`` (bytes, or None:
        None), in order, read from one stream that holds them all end to
        end (up to JOINED_BYTES at a time): a quarter less time than
        copying each into the stream in turn.  A state that fails there,
        or does not end where it should (bytes after its second pickle),
        is read again on its own, which gives exactly what reading it
        alone gives: its result, or the error.  Any error is raised as
        _Unreadable(the state's index, the error).  (Read in the joined
        stream, a state reads the same bytes as alone until it ends; only
        one cut short reads on into the next, and fails or ends
        elsewhere.)"""
        results = []
        group, size = [], 0
        for index, state in enumerate(states):
            if state is not None:
                if type(state) is not bytes:
                    # (A driver's own type may offer only __bytes__.)
                    try:
                        state = bytes(state)
                    except Exception as exc:
                        raise _Unreadable(index, exc) from exc
                if group and size + len(state) > JOINED_BYTES:
                    self._read_joined(group, len(results), results)
                    group, size = [], 0
                size += len(state)
            group.append(state)
        self._read_joined(group, len(results), results)
        return results

    def _read_joined(self, states, first, results):
        stream = BytesIO(b''.join([state for state in states if state is not None]))
        found = []
        unpickler = None
        end = 0
        for index, state in enumerate(states, first):
            if state is None:
                results.append(None)
                continue
            end += len(state)
            if unpickler is None:
                unpickler = Unpickler(stream)
                unpickler.persistent_load = found.append
                memo, noload, tell = unpickler.memo, unpickler.noload, stream.tell
            del found[:]
            memo.clear()
            try:
                noload()        # the class
                noload()        # the state
                ended = tell() == end
            except Exception:   # pylint:disable=broad-except
                ended = False
            try:
                if ended:
                    # (Malformed references raise here, as alone.)
                    results.append(_found_oids(found) if found else [])
                    continue
                unpickler = None
                results.append(self(state))
            except Exception as exc:
                raise _Unreadable(index, exc) from exc
            stream.seek(end)


class _Unreadable(Exception):
    """_ZODBReferences.many: the state at ``index`` raised ``error``."""

    def __init__(self, index, error):
        Exception.__init__(self, index, error)
        self.index = index
        self.error = error


def _found_oids(found):
    """The OIDs of the references a state's unpickling found."""
    # Most references are (oid, class) tuples: taken at once, and the
    # rest (weak and cross-database references, OIDs as text) by
    # _oids_of.
    try:
        oids = [ref[0] if type(ref) is tuple else ref for ref in found]
    except IndexError:
        return _oids_of(found)
    for oid in oids:
        if type(oid) is not bytes:
            return _oids_of(found)
    return oids


def stored_references(states):
    """The OIDs (ints) each of ``states`` (ZODB pickles, or None for a
    deletion) references, in order; none for a state whose references
    cannot be read.  For a commit's check against what a pack removed
    (Commit._check_not_removed), which leaves a state it cannot read to
    the pack's own check of it."""
    read = _ZODBReferences()
    try:
        found = read.many(states)
    except _Unreadable:
        found = []
        for state in states:
            try:
                found.append(None if state is None else read(bytes(state)))
            except Exception:   # pylint:disable=broad-except
                found.append(None)
    result = []
    for refs in found:
        try:
            result.append(_as_ints(0, 0, refs) if refs else ())
        except PackError:
            result.append(())
    return result


def _zodb_references(state):
    """_ZODBReferences for one state."""
    return _ZODBReferences()(state)


def _oids_of(found):
    oids = []
    for ref in found:
        if isinstance(ref, tuple):
            oid = ref[0]
        elif isinstance(ref, (bytes, str)):
            oid = ref
        elif isinstance(ref, list):
            continue
        else:
            raise TypeError('unexpected persistent reference %r' % (ref,))
        if not isinstance(oid, bytes):
            oid = oid.encode('ascii')
        oids.append(oid)
    return oids


def _references(referencesf, oid, tid, state):
    """The OIDs (ints, sorted, each once) a state references; PackError
    if it cannot be read."""
    if state is None:
        return ()
    try:
        refs = referencesf(state if type(state) is bytes else bytes(state))
    except Exception as exc:
        raise _unreadable(oid, tid, exc) from exc
    return _as_ints(oid, tid, refs)


def _references_of_rows(read, rows):
    """_references for each (oid, tid, state) of ``rows``, in order; a
    _reference_reader's many() reads them all in one pass."""
    if type(read) is not _ZODBReferences:
        return [_references(read, oid, tid, state) for oid, tid, state in rows]
    try:
        found = read.many([state for _, _, state in rows])
    except _Unreadable as exc:
        oid, tid, _ = rows[exc.index]
        raise _unreadable(oid, tid, exc.error) from exc.error
    return [_as_ints(oid, tid, refs) if refs else ()
            for (oid, tid, _), refs in zip(rows, found, strict=True)]


#: The largest OID the databases' signed 64-bit columns hold.
_MAX_OID = (1 << 63) - 1


def _as_ints(oid, tid, refs):
    if not refs:
        return ()
    try:
        if set(map(len, refs)) != _EIGHT:
            for ref in refs:
                if len(ref) != 8:
                    raise ValueError('a reference to an OID of %d bytes (%r)' % (len(ref), ref))
        # All converted by one unpack (a bucket holds dozens).
        oids = sorted(set(unpack('>%dQ' % len(refs), b''.join(refs))))
        if oids[-1] > _MAX_OID:
            # (A helper agent's check: the database's column refused it,
            # with an error naming neither object nor transaction.)
            raise ValueError('a reference to OID 0x%x, beyond the largest a database '
                             'holds (2**63 - 1)' % oids[-1])
        return oids
    except Exception as exc:
        raise _unreadable(oid, tid, exc) from exc


def _unreadable(oid, tid, exc):
    return PackError(
        "Cannot read the references of object 0x%x at transaction 0x%x (%s: %s); "
        "the analysis stopped there, and nothing more was removed."
        % (oid, tid, type(exc).__name__, exc))


def _rollback_quietly(conn):
    try:
        conn.rollback()
    except Exception:  # pylint:disable=broad-except
        # (The error being raised says more than this one.)
        log.debug("Rollback after a failed write of the pack failed", exc_info=True)


def _record(adapter, conn, oids, rows, completed_tid, seeds=False, fresh=False):
    """Record references, and that every revision up to completed_tid is."""
    _begin_write(adapter, conn)
    adapter.add_refs(conn, oids, rows, seeds, fresh)
    adapter.set_pack_info(conn, refs_tid=completed_tid)
    conn.commit()


# ----------------------------------------------------------------------
# Phase 2: deletion in batches.

def _delete(adapter, conn, options, referencesf, blobs, report, progress):
    info = adapter.pack_info(conn)
    conn.rollback()
    checked = info['checked_tid']
    gc = info.get('prepared_gc', 0)
    write_lock = adapter.pack_lock_is_write_lock
    # Catch up with the commits made during the analysis without the lock
    # (it writes only the pack's tables); under the lock only the last few
    # remain to be read.
    adapter.begin_pack_write(conn)
    last = adapter.get_last_tid(conn)
    report.kept_by_new_commits += _recheck(adapter, conn, referencesf, checked, last, gc)
    adapter.set_pack_info(conn, checked_tid=last)
    adapter.prepare_pack_deletion(conn, gc)
    conn.commit()
    adapter.begin_store_checked(conn)
    adapter.clear_pack_removals(conn)
    adapter.mark_packed(conn, report.pack_tid)
    conn.commit()
    checked = last

    # (The revisions, garbage objects' included, are what the batches
    # count: a helper agent's check saw the display end at 68 % with the
    # objects added to them.)
    bar = progress('deleting', report.candidates[1] or None, 'rows')
    # How long the deletions of one batch may take.  Where the commit
    # lock is the database's write lock (SQLite), a commit waits for all
    # of it; elsewhere the deletions run before the lock is taken, and
    # the batch size only bounds the work lost when a batch is redone
    # (larger batches spread the cost of the re-check and the commit).
    target = adapter.pack_write_lock_target()
    # A batch undone by a power cut brings back only garbage and old
    # revisions, so its commit need not wait for the disk while it holds
    # the commit lock (where the database lets it): the pack syncs it
    # right after, and forget_deleted waits for that before the references
    # of what it removed go.  Unless the commit is followed by the removal
    # of blob files that are the only copy of their data (a shared blob
    # directory).
    durable = blobs is not None and not blobs.in_database
    size = FIRST_DELETE_SIZE
    # Batches go by OID; each records where it ended (a pack that goes on
    # from the pre-pack state after a stop starts there).
    after_oid = info.get('deleted_upto', -1)
    busy = 0
    prepared = None
    files_done = {}
    pauses = _Pauses(options)
    syncer = _Worker('relstorage-pack-sync')
    try:
        while True:
            batch = _Batch()
            if write_lock:
                # Every commit waits for all of the batch: its candidates
                # are chosen before the lock (only the pack writes its
                # tables; usually in the pause after the last batch), and
                # the lock holds only their deletion, one statement group
                # sized by the time the last one took.
                if prepared is None:
                    prepared = _prepare(adapter, conn, after_oid, size)
                batch, prepared = prepared, None
                if not batch.prepared:
                    break
            try:
                if write_lock:
                    locked_at, last = _lock_commit(adapter, conn, options, durable)
                    batch.delete_prepared(adapter, conn)
                    after_oid = batch.last_oid
                    size = next_step_size(size, time.monotonic() - locked_at, target,
                                          high=MAX_BATCH_ROWS)
                    touched = _touched(adapter, conn, referencesf, checked, last, batch)
                else:
                    adapter.begin_store_checked(conn, durable=durable)
                    started = time.monotonic()
                    while True:
                        part_started = time.monotonic()
                        room = MAX_BATCH_ROWS - batch.rows
                        if not batch.delete_part(adapter, conn, after_oid, min(size, room)):
                            break
                        after_oid = batch.last_oid
                        part = time.monotonic() - part_started
                        size = next_step_size(size, part, target, high=MAX_DELETE_SIZE)
                        if time.monotonic() - started + part >= target or batch.rows >= MAX_BATCH_ROWS:
                            break
                    # Most commits since the last check are read without
                    # the lock; under it, only those of the last moments.
                    seen = adapter.get_last_tid(conn)
                    touched = _touched(adapter, conn, referencesf, checked, seen, batch)
                    if not touched:
                        locked_at, last = _lock_in_batch(adapter, conn)
                        touched = _touched(adapter, conn, referencesf, seen, last, batch)
                if touched:
                    # A commit since the last check changed or referenced
                    # a candidate: undo the batch, keep what the commits
                    # brought back (and what it reaches), then redo it.
                    conn.rollback()
                    after_oid = batch.first_after
                    adapter.begin_pack_write(conn)
                    last = adapter.get_last_tid(conn)
                    report.kept_by_new_commits += _recheck(
                        adapter, conn, referencesf, checked, last, gc)
                    adapter.set_pack_info(conn, checked_tid=last)
                    conn.commit()
                    checked = last
                    continue
                if gc:
                    # A copy began since the pack did (a helper agent's
                    # reading): checked under the commit lock, which its
                    # writes take after its mark is in.
                    _refuse_unfinished_copy(adapter, conn,
                                            'The pack stopped; this batch was undone.')
                batch.log(adapter, conn)
                adapter.set_pack_info(conn, checked_tid=last, deleted_upto=after_oid,
                                      **files_done)
                conn.commit()
            except _LockBusy:
                conn.rollback()
                after_oid = batch.first_after
                busy += 1
                if busy >= LOCK_ATTEMPTS:
                    raise UnableToAcquireCommitLockError(
                        "The pack of %s could not take the commit lock %d times in a row"
                        % (adapter.describe(), busy))
                log.info("The commit lock of %s is busy; the pack waits %.1fs",
                         adapter.describe(), options.pack_commit_busy_delay)
                time.sleep(options.pack_commit_busy_delay)
                continue
            except BaseException:
                conn.rollback()
                raise
            held = time.monotonic() - locked_at
            checked = last
            busy = 0
            report.revisions_removed += batch.revisions
            report.objects_removed += batch.objects
            report.blobs_removed += batch.blobs
            report.batches += 1
            report.lock_seconds += held
            report.longest_lock = max(report.longest_lock, held)
            if blobs is not None and (batch.removed or batch.trimmed):
                # Only now that the rows are gone for good.
                files = blobs.forget(batch.removed, batch.trimmed)
                if not blobs.in_database:
                    report.blobs_removed += files
            if durable and batch.mark is not None:
                # Recorded with the next batch (or the end): a pack killed
                # before the files of a batch went removes them when it runs
                # again (_forget_unfinished).
                files_done = {'files_upto': batch.mark}
            # The duty cycle is the share of time the pack holds the commit
            # lock (what commits wait for); the pack's writes that hold no
            # lock a commit needs run in the pause.
            released = time.monotonic()
            pause_until = pauses.until(released, held)
            sync = None if durable else adapter.deleted_sync(conn)
            if sync is not None:
                # Its pages go to disk now, while no commit waits for the
                # pack.  Left there, they would go with the next commit's
                # fsync, which holds the lock every commit waits for (a
                # SQLite writer's p99 during the deletion: 8.4 ms with
                # that, 5.9 without).  In the pause: on a disk whose fsync
                # is slow, the pack is slower for it, not the site.  In a
                # thread, while this one chooses the next batch (0.3 s less
                # deletion at a million objects).
                syncer.submit(sync)
            # After the commit: a display (or a test) sees a finished batch.
            bar.update(batch.revisions)
            if write_lock and not batch.finished:
                prepared = _prepare(adapter, conn, after_oid, size)
            # Before forget_deleted, which drops the references of what
            # the batches removed once they are on disk: a sync that
            # failed stops the pack first (an fsync's error is reported to
            # one caller only).
            syncer.wait()
            adapter.forget_deleted(conn, after_oid)
            if batch.finished:
                break
            if write_lock:
                pause_until = _writers_turn(adapter, released, pause_until)
            pauses.sleep(pause_until)
        adapter.forget_deleted(conn, after_oid, final=True)
        adapter.begin_store_checked(conn)
        report.transactions_removed = adapter.finish_pack(conn, report.pack_tid)
        # What the next pack checks to know it has nothing to do.
        adapter.set_pack_info(conn, prepared=None, prepared_gc=None, pack_tid=None,
                              checked_tid=None, deleted_upto=None,
                              packed_tid=report.pack_tid, packed_gc=gc, **files_done)
        if gc:
            # All this pack's garbage is gone: the next pack with GC need
            # only look where pack_seed says, and (history-preserving)
            # at what changed since this pack time (compute_pack_candidates).
            adapter.set_pack_info(conn, seed_base=1, seed_tid=report.pack_tid)
        elif adapter.keep_history:
            # It removed older revisions of every object: those the next
            # pack would compare with may be gone.
            adapter.set_pack_info(conn, seed_base=None)
        conn.commit()
    finally:
        syncer.close()
        bar.close()


def _prepare(adapter, conn, after_oid, size):
    """A batch whose candidates are chosen (without the commit lock)."""
    batch = _Batch()
    adapter.begin_pack_write(conn)
    try:
        batch.prepare(adapter, conn, after_oid, size)
        conn.commit()
    except BaseException:
        conn.rollback()
        raise
    return batch


class _LockBusy(Exception):
    """The commit lock stayed busy while a batch waited for it."""


class _Batch:
    """What one deletion batch removed (counted once it commits)."""

    def __init__(self):
        self.first_after = None
        self.last_oid = None
        self.removed = []           # garbage OIDs
        self.removed_set = set()
        self.trimmed = []           # (oid, below): older revisions removed
        self.rows = 0               # objects removed or trimmed
        self.revisions = self.objects = self.blobs = 0
        self.finished = False
        self.mark = None
        self.prepared = None
        self.extra = ()

    def log(self, adapter, conn):
        """Move the pack mark on and list what the batch removed under it
        (under the commit lock, before the batch's commit).  In the batch's
        transaction: whoever sees its deletions sees the new mark, and
        under it the list of what went, so other processes drop only that
        from their caches, and a commit that began before the batch checks
        what it references against the list (Commit._check_not_removed)."""
        if self.rows:
            self.mark = adapter.new_removal_mark(conn)
            adapter.log_pack_removals(conn, self.mark, self.removed, self.trimmed)

    def delete_part(self, adapter, conn, after_oid, size):
        """Delete the next ``size`` candidates; False when none is left."""
        if self.first_after is None:
            self.first_after = after_oid
        rows, extra, revisions, objects, blobs = adapter.delete_pack_batch(
            conn, after_oid, size)
        if not rows:
            self.finished = True
            return False
        self._sort_out(rows, extra)
        self._add(revisions, objects, blobs)
        return True

    def prepare(self, adapter, conn, after_oid, size):
        """Choose the next ``size`` candidates (the whole batch, for
        delete_prepared); False when none is left."""
        self.first_after = after_oid
        self.prepared, self.extra, last = adapter.prepare_pack_batch(conn, after_oid, size)
        if self.prepared:
            # Sorted out now: delete_prepared runs under a lock that every
            # commit waits for, and the duty cycle doubles its time.
            self._sort_out(self.prepared, self.extra)
            # (Before its last candidate when that one is only trimmed of
            # its oldest revisions, its blobs too large for one batch.)
            self.last_oid = last
        return bool(self.prepared)

    def delete_prepared(self, adapter, conn):
        revisions, objects, blobs = adapter.delete_prepared_batch(conn, self.extra)
        self._add(revisions, objects, blobs)

    def _sort_out(self, rows, extra):
        # The deletion goes on after the last candidate of the range; what
        # went with them (``extra``, garbage after it that leads to them:
        # see PackVerbs.prepare_pack_batch) is listed as removed, and
        # re-checked against commits like the rest.
        self.last_oid = rows[-1][0]
        self.rows += len(rows) + len(extra)
        removed = [oid for oid, _below, garbage in rows if garbage]
        if len(removed) < len(rows):
            self.trimmed.extend([(oid, below) for oid, below, garbage in rows if not garbage])
        removed.extend(extra)
        self.removed.extend(removed)
        self.removed_set.update(removed)

    def _add(self, revisions, objects, blobs):
        self.revisions += revisions
        self.objects += objects
        self.blobs += blobs


def _lock_in_batch(adapter, conn):
    """Take the commit lock inside a batch's transaction, which already
    holds the row locks of its deletions.  A commit that waits for one of
    those rows holds the commit lock: waiting for it would be a deadlock,
    so a busy lock makes the batch start again later (_LockBusy)."""
    try:
        last = adapter.lock_commit_checked(conn)
    except UnableToAcquireCommitLockError:
        raise _LockBusy()
    # (The time it is held from: a wait for it is not holding it.)
    return time.monotonic(), last


def _touched(adapter, conn, referencesf, after_tid, upto_tid, batch):
    """Did a commit in (after_tid, upto_tid] change or reference a garbage
    candidate, of this batch or still to come?"""
    if upto_tid <= after_tid:
        return False
    oids = set()
    for oid, tid, state in adapter.new_revisions(conn, after_tid, upto_tid):
        oids.add(oid)
        oids.update(_references(referencesf, oid, tid, state))
    if not oids:
        return False
    if not oids.isdisjoint(batch.removed_set):
        return True
    return adapter.any_garbage_candidate(conn, oids, batch.first_after)


def _begin_write(adapter, conn):
    """begin_pack_write, tried again when the database says it is busy
    (UnableToAcquireCommitLockError: where beginning a write transaction
    waits for a lock, a busy site may keep it commit-lock-timeout)."""
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            adapter.begin_pack_write(conn)
            return
        except UnableToAcquireCommitLockError:
            conn.rollback()
            if attempt == LOCK_ATTEMPTS:
                raise
            log.info("%s is busy; the pack's analysis tries again", adapter.describe())


def _when_free(adapter, call, delay=None):
    """``call()``, tried again after pack-commit-busy-delay while the
    commit lock it needs stays busy (UnableToAcquireCommitLockError).  On
    SQLite, the pack writes the main file (its tables there, the pairing
    token of each analysis) under the lock commits take: a helper agent's
    check found the pack of a busy site failing with "database is
    locked" where the option says it waits.  ``delay``: the pack's
    pack-commit-busy-delay, by default the adapter's."""
    if delay is None:
        delay = adapter.options.pack_commit_busy_delay
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            return call()
        except UnableToAcquireCommitLockError:
            if attempt == LOCK_ATTEMPTS:
                raise
            log.info("The commit lock of %s is busy; the pack waits %.1fs",
                     adapter.describe(), delay)
            time.sleep(delay)
    raise AssertionError('unreachable')


def _lock_commit(adapter, conn, options, durable=True):
    """Take the commit lock the way a commit does; when it stays busy
    (UnableToAcquireCommitLockError), wait pack-commit-busy-delay and try
    again.  Returns the time it was taken and the last committed tid."""
    def take():
        try:
            adapter.begin_store_checked(conn, durable=durable)
            last = adapter.lock_commit_checked(conn)
        except UnableToAcquireCommitLockError:
            conn.rollback()
            raise
        return time.monotonic(), last
    return _when_free(adapter, take, options.pack_commit_busy_delay)


def _recheck(adapter, conn, referencesf, after_tid, upto_tid, gc=True):
    """Drop from the candidates what commits in (after_tid, upto_tid] made
    reachable again; return how many."""
    if upto_tid <= after_tid:
        return 0
    referenced, changed = set(), set()
    for oid, tid, state in adapter.new_revisions(conn, after_tid, upto_tid):
        changed.add(oid)
        referenced.update(_references(referencesf, oid, tid, state))
    kept = adapter.rescue_candidates(conn, after_tid, referenced)
    if gc:
        # (Unreached objects those commits changed are kept, and looked
        # at again by the next pack.)
        adapter.seed_unreached(conn, changed)
    if kept:
        log.info("%d pack candidates of %s were made reachable again by new commits "
                 "and are kept", kept, adapter.describe())
    return kept


def _duty_cycle_sleep(held, options):
    duty = options.pack_duty_cycle
    return 0 if duty >= 1 else min(options.pack_max_delay, held * (1 - duty) / duty)


class _Pauses:
    """The pauses between deletion batches, by the duty cycle.  The pack's
    own work after a batch (syncing it, forgetting what the batches
    removed, choosing the next batch) holds no lock a commit waits for,
    and counts as pause.  When it took longer than the pause the batch
    asked for, what it took beyond counts toward the next batches' pauses
    (up to PAUSE_CREDIT_MAX): on average the pack still holds the lock no
    more than the duty cycle allows.  (On SQLite, at a million objects,
    every 50 ms the pack removes what the batches before deleted from its
    own tables and checkpoints the log, about 10 ms; paused as well after
    each of the batches that followed, the deletion took 0.6 s longer.)"""

    def __init__(self, options):
        self.options = options
        self.credit = 0.0
        self.released = self.pause = 0.0

    def until(self, released, held):
        """When the pause after a batch that held the lock ``held``
        seconds, released at ``released``, ends."""
        self.released = released
        self.pause = _duty_cycle_sleep(held, self.options)
        return released + max(0.0, self.pause - self.credit)

    def sleep(self, until):
        now = time.monotonic()
        if until > now:
            time.sleep(until - now)
            self.credit = 0.0
        else:
            worked = now - self.released
            self.credit = min(PAUSE_CREDIT_MAX, self.credit + worked - self.pause)


def _writers_turn(adapter, released, pause_until):
    """When the pause after a batch that released a single-writer
    database's lock at ``released`` ends (``pause_until`` by the duty
    cycle).  A commit waiting for that lock asks again every millisecond
    at most (adapters/sqlite): a pack that took it again at once would
    keep it from every commit.  So when one waits, the pause lasts
    WRITERS_TURN at least; when none does, it is not made longer (at a
    million objects, 5,000 batches paused 1.2 ms each where the duty cycle
    asked for 0.8)."""
    turn = released + WRITERS_TURN
    if pause_until < turn and time.monotonic() < turn and adapter.writers_waiting():
        return turn
    return pause_until


# ----------------------------------------------------------------------
# The files of a shared blob directory against the database.

def sweep_blob_files(adapter, blobs, pack_tid, remove=True, pack_conn=None):
    """Go through the blob files of a shared blob directory; return
    ``(files, orphans)``.

    ``files`` counts the files of revisions that a pack to ``pack_tid``
    removes but that are still there: a revision replaced at or before
    ``pack_tid`` whose row is gone.  A history-free database keeps no
    replaced revision, so every update of a blob leaves its old file to
    the pack; a pack killed between its deletion and the files' removal
    leaves some too.  They are removed when ``remove``.  With
    ``pack_conn`` (the analysis of a ``--prepack`` in its transaction),
    the files of the revisions and objects it found to remove are
    counted as well.

    A file of a revision replaced after ``pack_tid`` stays, and counts as
    neither.  So does the file of a commit in flight: it has not committed
    its tid yet, which the snapshot compared with is past.  ``orphans``
    lists the other files that no row describes (an object that no longer
    exists): left alone, and reported.

    A shared blob directory belongs to one database: another database's
    files there (a staging copy pointed at production's directory) look
    like this one's old revisions or garbage, and its packs remove them."""
    found = {}
    for dirpath, _dirnames, filenames in os.walk(blobs.blob_dir):
        for name in filenames:
            if not name.endswith('.blob'):
                continue
            try:
                oid = u64(blobs.fshelper.getOIDForPath(dirpath))
                tid = int(name[:-5].replace('0x', ''), 16)
            except (ValueError, TypeError, StructError):
                continue      # not a blob revision (temporary files)
            found.setdefault(oid, []).append((tid, os.path.join(dirpath, name)))
    if not found:
        return 0, []
    oids = sorted(found)
    candidates = {}
    if pack_conn is not None:
        # (Both verbs split long lists as the vendor needs.)
        candidates = {oid: (keep_tid, garbage) for oid, keep_tid, garbage
                      in adapter.pack_candidates_of(pack_conn, oids)}
    files, orphans = 0, []
    conn = adapter.open_primary_load()
    try:
        adapter.begin_snapshot(conn)
        last = adapter.get_last_tid(conn)
        current = adapter.current_tids(conn, oids)
        for oid in oids:
            now = current.get(oid)
            keep_tid, garbage = candidates.get(oid, (None, 0))
            for tid, path in found[oid]:
                if tid > last:
                    continue        # a commit in flight
                if garbage or (keep_tid is not None and tid < keep_tid):
                    files += 1      # the analysis removes it (--prepack)
                    continue
                if tid == now or (adapter.keep_history and tid < (now or 0)
                                  and adapter.load_revision(conn, oid, tid)[0]):
                    continue        # its row is there
                if now is not None and tid < now:
                    # Replaced: removed by a pack to the time it was.
                    # (One that cannot be removed is logged, not an error
                    # that stops the pack: its rows are gone.)
                    if now <= pack_tid and (not remove or remove_blob_file(path)):
                        files += 1
                    continue
                orphans.append(path)
    finally:
        conn.rollback()
        conn.close()
    return files, orphans


