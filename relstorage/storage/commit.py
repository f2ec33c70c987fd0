"""The two database-facing steps of two-phase commit.

vote (parallel with other committers)
  1. begin the store transaction (single-writer databases lock here);
  2. upload the buffered states into ``temp_store`` in bulk;
  3. lock the current rows of the objects we change (exclusive) and of the
     objects read with ``readCurrent`` (shared), in OID order so that two
     committers cannot deadlock;
  4. find the objects changed since their ``prev_tid`` and resolve those
     conflicts with ``_p_resolveConflict``, or raise ConflictError;
  5. check that the ``readCurrent`` objects are still current.

finish (serialized, short)
  6. take the commit lock and publish a tid strictly greater than the last
     committed one (``Adapter.advance_tid``: one statement on PostgreSQL);
  7. move the rows into place and record the transaction;
  8. commit (releasing every lock).

Anything that can fail for an application reason fails in vote; finish only
waits for the commit lock, which is held for steps 6-8 alone.
"""
import logging

from ZODB import POSException
from ZODB.utils import newTid
from ZODB.utils import p64
from ZODB.utils import u64

log = logging.getLogger(__name__)


def vote(storage, conn):
    adapter = storage._adapter
    tstore = storage._tstore
    adapter.begin_store_checked(conn)
    if conn.temp_dirty:
        adapter.clear_temp(conn)
        if storage._blobs is not None and storage._blobs.in_database:
            adapter.clear_temp_blobs(conn)
        conn.temp_dirty = False
    if len(tstore):
        conn.temp_dirty = True
        adapter.upload(conn, tstore.rows())
    read_current = {oid: tid for oid, tid in storage._read_current.items()
                    if oid not in tstore}
    if len(tstore) or read_current:
        adapter.lock_objects_checked(conn, tstore.oids(), sorted(read_current))
    if storage._restoring:
        # restore() copies history verbatim: whatever is current now is
        # simply the previous revision of what we write.
        adapter.fix_prev_tids(conn)
    elif len(tstore):
        _resolve_conflicts(storage, adapter, conn, tstore)
    if storage._btxn:
        conn.temp_dirty = True
        storage._blobs.vote(adapter, conn, storage._btxn, tstore)
    if read_current:
        current = adapter.current_tids(conn, list(read_current))
        for oid, expected in sorted(read_current.items()):
            actual = current.get(oid, 0)
            if actual != expected:
                raise POSException.ReadConflictError(
                    oid=p64(oid), serials=(p64(actual), p64(expected)))


def _resolve_conflicts(storage, adapter, conn, tstore):
    for oid, committed_tid, prev_tid in adapter.detect_conflicts(conn):
        new_state = tstore.read(oid)
        if new_state is None or prev_tid == 0:
            # Deleting a changed object, or creating one that exists:
            # nothing to merge.
            raise POSException.ConflictError(
                oid=p64(oid), serials=(p64(committed_tid), p64(prev_tid)),
                data=new_state)
        row = adapter.load_current(conn, oid)
        committed_state = bytes(row[0]) if row and row[0] is not None else None
        if committed_state is None:
            raise POSException.ConflictError(
                oid=p64(oid), serials=(p64(committed_tid), p64(prev_tid)))
        resolved = storage.tryToResolveConflict(
            p64(oid), p64(committed_tid), p64(prev_tid), new_state, committed_state)
        tstore.store(oid, committed_tid, resolved)
        adapter.replace_temp(conn, oid, committed_tid, resolved)
        storage._resolved.add(oid)


def finish(storage, conn):
    """Publish the voted transaction; return its tid (an int)."""
    adapter = storage._adapter
    tstore = storage._tstore
    user, description, extension, status = storage._meta
    try:
        tid = adapter.advance_tid(conn, u64(newTid(None)), storage._restore_tid)
        adapter.move_into_place(conn, tid, len(tstore) > 0, user, description, extension,
                                packed=(status == 'p'))
        if storage._btxn is not None:
            storage._blobs.finish(adapter, conn, storage._btxn, tid)
        if tstore.max_oid >= 0:
            adapter.note_oids_used(tstore.max_oid)
        conn.commit()
    except BaseException:
        conn.rollback()
        if storage._btxn is not None:
            storage._btxn.unplace()
        raise
    if storage._btxn is not None:
        storage._blobs.committed(storage._btxn, tid)
    storage._cache.committed(tid, ((oid, state) for oid, _, state in tstore.rows()))
    return tid
