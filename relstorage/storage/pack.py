"""Pack: remove old revisions and, with GC, unreachable objects.

The whole pack runs in one store transaction holding the commit lock, so
no commit lands half way through the reachability analysis.  It reads the
states it needs in one pass and keeps only OIDs and references in memory.
(Batching with a duty cycle, for packing live sites, is future work.)
"""
import logging
import time

from persistent.TimeStamp import TimeStamp
from ZODB.utils import u64

log = logging.getLogger(__name__)


def pack_tid_for(t):
    return u64(TimeStamp(*time.gmtime(t)[:5] + (t % 60,)).raw())


def pack(storage, t, referencesf, gc, prepack_only=False):
    adapter = storage._adapter
    limit = pack_tid_for(t)
    conn = adapter.open_store()
    started = time.time()
    try:
        adapter.begin_store_checked(conn)
        last_tid = adapter.lock_commit_checked(conn)
        pack_tid = min(limit, last_tid)
        # keep[oid] = (tid, exists) of the revision current at pack time;
        # newer[oid] = revisions after it.  Only OIDs and references stay
        # in memory, never states: the references of the revision kept so
        # far are replaced when a newer one (up to the pack time) comes by.
        keep = {}
        newer = {}
        kept_refs = {}
        newer_refs = {}
        for oid, tid, state in adapter.iter_states(conn):
            if tid <= pack_tid:
                if tid >= keep.get(oid, (-1, False))[0]:
                    keep[oid] = (tid, state is not None)
                    if gc:
                        if state is not None:
                            kept_refs[oid] = {u64(r) for r in referencesf(bytes(state))}
                        else:
                            kept_refs.pop(oid, None)
            else:
                newer.setdefault(oid, []).append(tid)
                if gc and state is not None:
                    newer_refs.setdefault(oid, set()).update(
                        u64(r) for r in referencesf(bytes(state)))
        refs = kept_refs
        for oid, more in newer_refs.items():
            refs.setdefault(oid, set()).update(more)
        del newer_refs

        removed_objects = []
        if gc:
            reachable = set(newer)          # anything written after the pack time stays
            stack = [0] + list(newer)
            while stack:
                oid = stack.pop()
                for ref in refs.get(oid, ()):
                    if ref not in reachable:
                        reachable.add(ref)
                        stack.append(ref)
            reachable.add(0)
            removed_objects = [oid for oid in keep if oid not in reachable]
        removed = set(removed_objects)
        # Objects that did not exist at pack time and have no later revision.
        removed.update(oid for oid, (tid, exists) in keep.items()
                       if not exists and oid not in newer)
        old_revisions = [(oid, tid) for oid, (tid, _) in keep.items() if oid not in removed]
        if prepack_only:
            # An analysis: report, and leave every row in place.
            conn.rollback()
            log.info("Pre-pack of %s to %x: would remove %d objects; nothing removed",
                     adapter.describe(), pack_tid, len(removed))
            return
        adapter.pack_delete(conn, sorted(removed), old_revisions, pack_tid)
        # In the same transaction as the deletions: a snapshot that sees
        # them also sees the new mark, and its reader drops its caches.
        adapter.bump_pack_mark(conn)
        conn.commit()
        if storage._blobs is not None:
            storage._blobs.forget(removed, old_revisions)
    except BaseException:
        conn.rollback()
        raise
    finally:
        conn.close()
    storage._cache.clear()
    log.info("Packed %s to %x in %.1fs: removed %d objects%s",
             adapter.describe(), pack_tid, time.time() - started, len(removed),
             '' if gc else ' (no GC)')
