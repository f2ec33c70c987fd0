"""RelStorage: the ZODB storage.

One ``RelStorage`` object is created from the configuration; ZODB.DB then
asks it for one ``new_instance()`` per ZODB connection.  Every instance uses
two database connections (sessions):

- a *load* connection holding one read-only snapshot from
  ``poll_invalidations`` until ``afterCompletion`` (MVCC by polling);
- a *store* connection, used only while committing.

Neither is held while idle: both come from pools shared by the instances
(``adapters/sessions.py``).  An instance takes a load session when it begins
a snapshot and gives it back at ``afterCompletion``; it takes a store
session when its commit first needs the database (``tpc_vote``; ``store``
only buffers) and gives it back after ``tpc_finish`` / ``tpc_abort``.  So
ZODB connections that are closed (in ZODB.DB's pool) hold no session, and
only those committing right now hold a store session.

The instances share the adapter (and with it the OID allocator and the
session pools) and the state cache.  ZODB does not wrap an IMVCCStorage in
its MVCC adapter, so this class implements the per-connection life cycle
itself.

Two-phase commit, in short (see commit.py for the steps):
``store`` only buffers; ``tpc_vote`` uploads, locks the changed rows,
resolves conflicts, checks ``readCurrent``, and last takes the database-wide
commit lock, chooses the transaction id and moves the rows into place;
``tpc_finish`` only commits (ZODB's contract: once vote has returned,
finish must not fail for a reason vote could have detected).
"""
import contextlib
import hashlib
import logging
import os
import struct
import threading
import types
import weakref
from operator import itemgetter

import zope.interface
from ZODB import POSException
from ZODB.ConflictResolution import ConflictResolvingStorage
from ZODB.blob import BlobFile
from ZODB.interfaces import IBlobStorage
from ZODB.interfaces import IBlobStorageRestoreable
from ZODB.interfaces import IExternalGC
from ZODB.interfaces import IMultiCommitStorage
from ZODB.interfaces import IMVCCStorage
from ZODB.interfaces import IStorage
from ZODB.interfaces import IStorageCurrentRecordIteration
from ZODB.interfaces import IStorageIteration
from ZODB.interfaces import IStorageRestoreable
from ZODB.interfaces import IStorageUndoable
from ZODB.interfaces import IStorageWrapper
from ZODB.serialize import referencesf as zodb_referencesf
from ZODB.utils import oid_repr
from ZODB.utils import p64
from ZODB.utils import u64

from .. import locks
from ..blobs import make_blobs
from ..cache.shared import missing_client
from ..cache.storage_cache import StorageCache
from ..directories import not_a_directory
from ..interfaces import DisconnectedError
from ..interfaces import EarlierSchemaError
from ..interfaces import RelStorageError as StorageError
from ..interfaces import SameDatabaseTwiceError
from ..interfaces import StorageClosedError
from ..options import Options
from . import commit
from . import history

#: ZODB.utils.p64 without its wrapper: polls convert every changed (or
#: packed away) OID, thousands per poll while a pack deletes.
_oid_bytes = struct.Struct('>Q').pack

log = logging.getLogger(__name__)


#: Sequential read-ahead (see RelStorage._read_ahead).
READ_AHEAD_AFTER = 3
READ_AHEAD = 128

#: OIDs are signed 64-bit integers in every database (BIGINT, INTEGER):
#: no object has one above this.
MAX_OID = history.MAX_OID
#: A commit stores no OID from here up, and new_oid hands none out: the
#: databases' OID counters (a sequence, a counter row that reserves blocks)
#: must stay below MAX_OID with room for a block.  (A helper agent's check:
#: OID 2**63-1 failed SQLite's vote with OverflowError, MariaDB's new_oid
#: went past 2**63, and each database gave its driver's error.)
OID_LIMIT = MAX_OID + 1 - 2 ** 20


def _refuse_oid(oid_int):
    raise POSException.StorageError(
        "OID 0x%x is beyond the OIDs a RelStorage database keeps (below 0x%x)"
        % (oid_int, OID_LIMIT))


def _check_given_tid(tid_int):
    """A tid given to a commit (tpc_begin's, a restored record's, a
    copied transaction's) must leave room for a later one: the tid
    columns are signed 64-bit, tids only go up, and the largest,
    MAX_TID, stands for "no limit" in queries (a helper agent's check:
    a copied tid of MAX_TID - 1 let the next commit take MAX_TID)."""
    if tid_int >= history.MAX_TID - 1:
        raise POSException.StorageTransactionError(
            "Transaction id %016x is beyond the largest a transaction may be given "
            "(%016x: the database must hold a later one)" % (tid_int, history.MAX_TID - 2))


#: Loads whose OIDs go forward by at most this much count as a run too:
#: every other object of a range (a container's items, each created with
#: a sub-object; zodbshootout's "conflicting updates" reads half of its
#: objects) was read one query per object.
READ_AHEAD_STRIDE = 4


def _check_local_directories(options):
    """blob-dir and cache-local-dir can be directories (made later, when
    first used), and the shared cache's client package is there;
    RelStorageError naming the key otherwise.  (ZConfig checks the
    directories as the file is parsed; Options made in code are not.)"""
    for key, path in (('blob-dir', options.blob_dir),
                      ('cache-local-dir', options.cache_local_dir)):
        problem = path and not_a_directory(path)
        if problem:
            raise StorageError('%s %s: %s' % (key, path, problem))
    problem = missing_client(options.cache_servers, options.cache_module_name)
    if problem:
        raise StorageError(problem)


def _sort_key(adapter, key):
    """The storage's sortKey: the order of a transaction's votes across its
    databases, which must be the same in every process, however each
    spells the database (a helper agent's check: ``port=5432`` written or
    left out, a SQLite data-dir through a symbolic link, a MySQL option
    file gave the same database other keys, and two processes could each
    take one commit lock and wait for the other's).  The database's key
    ``key`` where it has one (a storage that cannot write it yet commits
    nothing), then where the server says the database is: a copy made
    with its files or a dump (and its key) is another database, which one
    transaction may join with the original (a review finding: both had
    one sort key, and their order was left to chance)."""
    description = adapter.describe()
    if key is None:
        return 'RelStorage:' + description
    # (The kind of database first: MySQL's description names MariaDB.)
    sort_key = 'RelStorage:%s database key %x' % (description.partition(' database')[0], key)
    try:
        # (Names only: the server's start time, last, changes.)
        where = adapter.database_identity()[1:-1]
    except Exception:  # pylint:disable=broad-except
        log.debug("Could not ask %s where the database is", description, exc_info=True)
        return sort_key
    return '%s at %s' % (sort_key, ' '.join(str(part) for part in where))


@zope.interface.implementer(
    IStorage,
    IMVCCStorage,
    IMultiCommitStorage,
    IStorageRestoreable,
    IStorageIteration,
    IStorageCurrentRecordIteration,
    IExternalGC,
)
class RelStorage(ConflictResolvingStorage):
    """A ZODB storage keeping pickles in a relational database."""

    _crs_transform_record_data = _crs_untransform_record_data = staticmethod(lambda d: d)

    def __init__(self, adapter, name=None, create=None, options=None,
                 _parent=None, **kwoptions):
        if options is None:
            options = Options(**kwoptions)
        elif kwoptions:
            options = options.copy(**kwoptions)
        self._adapter = adapter
        self._options = options
        named = name or options.name
        self._name = named or 'RelStorage on %s' % adapter.describe()
        self._is_read_only = bool(options.read_only)
        self._parent = _parent
        self._before = None                 # historical instances: load before this tid
        # A storage wrapper (IStorageWrapper: <zlibstorage>) that registered
        # itself with this storage, see new_instance.
        self._wrapper = None
        self._records_ahead = None          # see record_iternext
        # (On the root storage:) how many times this process changed the
        # database (a commit through any instance, a pack, a zap), so that
        # records read ahead before one are not served after it.
        self._local_changes = 0

        if _parent is None:
            # The one place every way of opening a storage goes through.
            options.log_notices()
            if create is None:
                create = options.create_schema
            try:
                # Before the schema: a configuration refused for them
                # leaves the database as it was (a helper agent's check).
                _check_local_directories(options)
                adapter.prepare_schema(create=create, read_only=self._is_read_only)
                # Shared by every instance; loads its persistent file, if any.
                self._cache = StorageCache(options, adapter)
            except EarlierSchemaError:
                raise           # (open_storage may read it with this adapter)
            except BaseException:
                try:
                    adapter.close()
                except Exception:  # pylint:disable=broad-except
                    log.debug("Closing after a failed open failed", exc_info=True)
                raise
            try:
                self._blobs = make_blobs(options, adapter, self._cache.shared)
                if self._blobs is not None and self._blobs.in_database \
                        and not adapter.has_blob_chunk:
                    raise StorageError(
                        "The schema at %s has no blob_chunk table, so blobs cannot be "
                        "kept in the database; use shared-blob-dir true or recreate the "
                        "schema.%s" % (adapter.describe(),
                                       adapter.hidden_tables_hint('blob_chunk')))
                # (Read once: the caches, the blob directory and the sort
                # key name the database by it.)
                key = self._cache.database_key
                if key is None:
                    key = adapter.database_key(create=not self._is_read_only)
                if self._blobs is not None:
                    self._blobs.check_database(adapter, key)
                    if self._blobs.in_database:
                        # (A cache of the database's blobs: what packs
                        # remove goes from it; shared-blob-dir files are
                        # the packing process's to remove.)
                        self._cache.blob_files = self._blobs
            except BaseException:
                # (Its sessions and cache clients, not left to the collector;
                # a failure to close them must not hide why it failed.)
                for close in (self._cache.close, adapter.close):
                    try:
                        close()
                    except Exception:  # pylint:disable=broad-except
                        log.debug("Closing after a failed open failed", exc_info=True)
                raise
            # Described again now that the adapter has met its server
            # (MySQL or MariaDB), once: the sort key orders the votes of a
            # transaction's databases and must not change.
            if not named:
                self._name = 'RelStorage on %s' % adapter.describe()
            self._sort_key = _sort_key(adapter, key)
        else:
            self._cache = _parent._cache
            self._blobs = _parent._blobs
            self._crs_transform_record_data = _parent._crs_transform_record_data
            self._crs_untransform_record_data = _parent._crs_untransform_record_data
            self._sort_key = _parent._sort_key

        if adapter.keep_history:
            zope.interface.alsoProvides(self, IStorageUndoable)
        if self._blobs is not None:
            zope.interface.alsoProvides(self, IBlobStorage, IBlobStorageRestoreable)
            # ZODB.blob.copyTransactionsFromTo puts its files here.
            self.fshelper = self._blobs.fshelper

        # _lock guards the connections of this instance: a storage instance
        # may be used from several threads (ZODB's own tests do).  It is an
        # RLock because conflict resolution loads while committing.
        self._lock = threading.RLock()
        # _tpc_cond serializes two-phase commits on this instance.
        self._tpc_cond = threading.Condition()
        self._locks_made_with = locks.made_now(self)
        self._load_conn = None          # from the snapshot's start to afterCompletion
        self._store_conn = None         # from vote to the end of the commit
        # A store session keeping a lost vote's row locks for the retry
        # (commit.py, "Fairness"), outside the pool's count meanwhile.
        self._held_conn = None
        self._snapshot_open = False
        self._snapshot_pid = None       # the process that began it
        self._snapshot_tid = 0
        self._poll_tid = None          # what the ZODB connection has been told
        # (oid, tid, pack mark of that poll's snapshot) of the newest
        # changes of the last few polls that reported any, newest first, checked by the next polling snapshot
        # (see _poll_invalidations); what that check found: None, or the
        # oldest tid a witness's object has there, older than its change.
        self._witnesses = []
        self._diverged_at = None
        self._snapshot_pack_mark = 0    # the pack mark in our snapshot
        self._poll_pack_mark = None     # ... when the ZODB connection last polled
        # ... in the first snapshot of the transaction under way (set by the
        # poll, or the first snapshot after the end of the last one): what
        # it read is at least that recent (Commit._check_not_removed).
        self._read_mark = None
        # ... and this thread's count of history reads then (_history_read).
        self._history_seen = None
        # (The root's) {thread ident: reads from history by any of its
        # instances in that thread}, but those of a vote's conflict
        # resolution (made in the thread _resolving names).
        self._history_reads = {}
        self._resolving = None
        self._last_commit_tid = 0
        # Read-only replicas (ro-replica-conf) may be behind what this
        # instance has seen: the highest tid seen, see _replica_behind.
        self._seen_tid = 0
        self._seen_server = None        # where _seen_tid was seen (replica-conf)
        self._left_servers = set()      # replica-conf servers left for another
        self._commits_reverted = 0      # _last_commit_tid when reverted
        self._stale_snapshot = False    # behind: loads raise ReadConflictError
        self._reverted = False          # behind, revert-when-stale: poll drops all
        # Read-ahead state (see _read_ahead); no first OID continues a run.
        self._ra_next, self._ra_run = -READ_AHEAD_STRIDE - 1, 0
        self._ra_until = -1
        self._last_load = None          # (oid, snapshot, (state, serial)), see load
        self._prefetched = {}           # oid_int -> (state, tid_int), see load
        self._asked = set()             # oid_ints prefetch() was asked for
        self._own_tids = set()          # committed here since the last poll
        # The storage object made from the configuration is used directly by
        # ZODB.DB (undoLog, pack, lastTransaction, ...) and by tools; until
        # somebody polls it, each of its read calls runs in a snapshot of
        # its own, ended when the call returns: it sees the latest commits
        # and leaves no database transaction open (an idle one would hold
        # back VACUUM / purge for as long as the process runs).
        # Instances (one per ZODB connection) keep their snapshot until
        # afterCompletion/poll, as MVCC requires.
        self._autorefresh = _parent is None
        self._reads = 0                 # read calls in progress (see _Read)
        self._closed = False
        self._instances = weakref.WeakSet()
        # (The storage made from the configuration's) {thread ident:
        # instance} of the instances between the start of their vote and
        # the end of their commit, see _check_one_voter.
        self._voters = weakref.WeakValueDictionary()
        self._voting_as = None
        self._iterators = history.IteratorSnapshots()    # see loadBlob
        self._commit = None             # commit.Commit from tpc_begin to its end
        self._released_txn = None       # whose commit release() aborted

    # ------------------------------------------------------------------
    # Instances (IMVCCStorage)

    def new_instance(self):
        self._follow_gevent()
        return self._wrapped(self._new_instance())

    def _follow_gevent(self):
        """On the way in, before any lock is taken: if gevent has patched
        the process since this instance's locks were made (a storage opened
        in gunicorn's master with --preload, used in a gevent worker), make
        them again, and the shared parts' (relstorage/locks.py).  Called
        by every entry point that takes a lock without a read or a poll
        first (a review finding: new_oid on the storage made from the
        configuration took the stale OID lock, and the process hung)."""
        if self._locks_made_with is not threading.Lock:
            self._renew_locks()

    def _renew_locks(self):
        if locks.stale(self):
            self._lock = threading.RLock()
            self._tpc_cond = threading.Condition()
        self._adapter.renew_locks()
        self._cache.renew_locks()
        if self._blobs is not None:
            self._blobs.renew_locks()

    def before_instance(self, before=None):
        self._follow_gevent()
        instance = self._new_instance()
        instance._before = u64(before) if before is not None else None
        instance._is_read_only = True
        return self._wrapped(instance)

    def _new_instance(self):
        root = self._root
        instance = type(self)(self._adapter, name=self._name, options=self._options,
                              _parent=root)
        root._instances.add(instance)
        return instance

    def _wrapped(self, instance):
        """``instance`` inside wrappers like those this storage is inside.

        A helper agent's check: with ``<zlibstorage>`` around
        ``<relstorage>``, ZODB.DB asks the wrapper for its connections'
        instances, and the wrapper's ``__getattr__`` handed the question to
        this storage: connections used bare instances, whose states were
        neither compressed when stored nor decompressed when loaded, while
        conflict resolution compressed what it wrote (the wrapper's record
        transform): every later load of a resolved object failed.  Each
        wrapper (IStorageWrapper, registered with ``registerDB``; one
        wrapped in another registers with it, as ``db``) is made again
        around the instance, with its settings (attributes that are not
        bound to the storage it wraps: zlibstorage's ``compress false``).
        Making it registers it with the instance, which takes its record
        transforms for conflict resolution."""
        chain = []
        wrapper = self._root._wrapper
        while wrapper is not None and wrapper not in chain:
            chain.append(wrapper)
            above = getattr(wrapper, 'db', None)
            wrapper = above if IStorageWrapper.providedBy(above) else None
        for index, wrapper in enumerate(chain):
            try:
                made = type(wrapper)(instance)
            except Exception as exc:
                # (A bare instance would read the wrapper's records as
                # they are stored: transformed.)
                raise StorageError(
                    "Cannot make the storage wrapper %s again around a connection's "
                    "instance of %s (%s: %s)" % (type(wrapper).__name__, self._name,
                                                 type(exc).__name__, exc)) from exc
            for name, value in vars(wrapper).items():
                # Settings only: plain functions and immutable values (not
                # what is bound to the storage it wraps, nor state the
                # connections would share: a review finding).
                if (name in vars(made) and not name.startswith('__')
                        and name not in ('base', 'db')
                        and isinstance(value, _WRAPPER_SETTINGS)):
                    setattr(made, name, value)
            if index == len(chain) - 1 and getattr(wrapper, 'db', None) is not None:
                # (The database the top one was registered with, if any
                # (ZEO's server; ZODB.DB registers with no IMVCCStorage),
                # whose record transforms come above the wrappers'.)
                made.registerDB(wrapper.db)
            instance = made
        return instance

    def registerDB(self, wrapper):
        """IStorage.registerDB: ZODB.DB, or a storage wrapper, registers
        itself; conflict resolution takes its record transforms."""
        self._wrapper = wrapper if IStorageWrapper.providedBy(wrapper) else None
        super().registerDB(wrapper)

    def _references_function(self, referencesf):
        """The function a pack reads references with: ZODB's, given to
        the storage inside a wrapper that transforms records (zodbpack on a
        configuration with ``<zlibstorage>``, whose ``run_pack`` is this
        storage's), reads them untransformed (a helper agent's check: the
        pack stopped at the first compressed record).  A wrapper's own
        ``pack`` gives a function that untransforms already."""
        if self._root._wrapper is None or referencesf is not zodb_referencesf:
            return referencesf
        untransform = self._root._crs_untransform_record_data

        def references(data, oids=None):
            return referencesf(untransform(data), oids)
        return references

    def release(self):
        self._follow_gevent()
        # Both locks, in _end_tpc's order: the commit found here is the one
        # whose session is given back below (a helper agent's check: read
        # first under _tpc_cond alone, a commit that began and voted in
        # another thread before the give-back lost its voted session to the
        # pool, which rolled it back, and its tpc_finish returned a tid
        # with nothing committed).
        with self._tpc_cond, self._lock:
            pending = self._commit
            # A commit in progress cannot go on without its session (a
            # helper agent's check: ZODB's DB.close(), which releases the
            # instances of connections in the middle of a transaction, made
            # a tpc_finish that came after it return a tid with nothing
            # committed, as its session had been rolled back and given
            # back).  Aborted, unless its COMMIT went through; its
            # tpc_finish then says so.
            abandoned = pending is not None and not pending.committed
            if abandoned:
                pending.abort()
                # Said under the lock: a vote or finish of this commit
                # that was waiting for it refuses (_check_not_released).
                self._released_txn = pending.txn
            self._snapshot_open = False
            self._give_back_load_conn()
            self._give_back_store_conn()
            self._close_held_conn()
        if abandoned:
            log.warning("%s was released (or closed) while a transaction was "
                        "committing: the transaction was aborted", self.getName())
            with self._tpc_cond:
                current = self._commit is pending
            if current:
                self._end_tpc()

    def close(self):
        if self._closed:
            return
        self._closed = True
        self.release()
        if self._parent is None:
            # Instances nobody released (a ZODB connection never closed)
            # would otherwise keep their database sessions until garbage
            # collection.
            for instance in list(self._instances):
                instance.release()
            self._iterators.close()
            if self._blobs is not None:
                self._blobs.close()
            self._cache.close()
            self._adapter.close()

    # ------------------------------------------------------------------
    # The snapshot (load connection)

    def _get_load_conn(self):
        if self._load_conn is not None and self._load_conn.broken:
            self._give_back_load_conn()
        if self._load_conn is None:
            self._load_conn = self._adapter.load_sessions.take()
        return self._load_conn

    def _give_back_load_conn(self):
        """Outside a snapshot: the pool gets the load session (it closes a
        broken one)."""
        conn, self._load_conn = self._load_conn, None
        if conn is not None:
            self._adapter.load_sessions.give_back(conn)

    def _read(self):
        """``with self._read() as conn``: a read call on the load connection."""
        return _Read(self)

    def _check_open(self):
        """A helper agent's check: a closed storage went on loading and
        committing (its sessions made again); IStorage says it is not to be
        used after close()."""
        if self._closed or (self._parent is not None and self._parent._closed):
            raise StorageClosedError('%s is closed' % self.getName())

    def _ensure_snapshot(self, polling=False):
        if self._snapshot_open:
            if self._stale_snapshot:
                raise self._stale_error()
            return self._load_conn
        self._check_open()
        for attempt in (1, 2):
            conn = self._get_load_conn()
            try:
                self._adapter.begin_snapshot(conn)
                witnesses = self._witnesses if polling else ()
                tid, pack_mark, found, seen_there = self._adapter.snapshot_marks(
                    conn, [oid for oid, _, _ in witnesses],
                    witnesses[0][1] if witnesses else 0)
                break
            except DisconnectedError:
                # The server restarted or dropped us since the last
                # transaction: nothing was in flight, so reconnect once,
                # on a new session (the idle ones went with this one).
                conn.rollback()
                self._give_back_load_conn()
                self._adapter.load_sessions.drop_idle()
                if attempt == 2:
                    raise
            except BaseException:
                # Anything else (an exception thrown into the thread: a
                # request's timeout, KeyboardInterrupt) leaves no half-begun
                # snapshot: a helper agent's check saw such sessions idle
                # in transaction, holding back VACUUM, until garbage
                # collection (an interrupted db.open() drops its instance).
                conn.rollback()
                self._give_back_load_conn()
                raise
        self._snapshot_open = True
        self._snapshot_pid = os.getpid()
        self._snapshot_tid = tid
        self._snapshot_pack_mark = pack_mark
        if self._read_mark is None:
            self._read_mark = pack_mark
        if self._history_seen is None:
            self._history_seen = self._history_count()
        # A witness's object older than the revision a poll reported, in
        # a snapshot that has that revision's transaction: this is not the
        # history the witness came from (a restored backup, committed to
        # since, so that the last tid did not go back).  (A replica behind
        # does not have that transaction; undo, deleteObject and copies
        # write newer tids.)  Or gone, with no pack batch since that poll
        # (only packs and zap_all remove rows, and both move the pack
        # mark): a helper agent's check found the newest change of a poll
        # was often an object that commit created, which a restored backup
        # does not have at all; where that history began is then unknown,
        # and all of it is abandoned.  History-preserving, also the
        # transaction of the newest witness gone, with no pack since (the
        # lost commits' objects made again under the same OIDs by the
        # restored counter: see Adapter.snapshot_marks).
        older = []
        if (seen_there is False and witnesses[0][1] <= tid
                and pack_mark == witnesses[0][2]):
            older.append(0)
        for oid, seen, seen_mark in witnesses:
            if seen <= tid:
                now = found.get(oid)
                if now is None:
                    if pack_mark == seen_mark:
                        older.append(0)
                elif now < seen:
                    older.append(now)
        self._diverged_at = min(older) if older else None
        if conn.replica and tid < self._high_water():
            self._replica_behind(tid, polling)
        elif (conn.server in self._left_servers and tid < self._high_water()
              and self._adapter.back_after_timeout(conn.server)):
            self._server_behind(conn, tid)
        else:
            if tid >= self._seen_tid and conn.server != self._seen_server:
                if self._seen_server is not None:
                    self._left_servers.add(self._seen_server)
                self._left_servers.discard(conn.server)
                self._seen_server = conn.server
            self._seen_tid = max(self._seen_tid, tid)
        # A pack happened since the cache last looked: it drops what
        # may be gone (see StorageCache.note_pack_mark).
        self._cache.note_pack_mark(
            pack_mark, tid, lambda after, upto: self._adapter.pack_removals(conn, after, upto),
            lambda: self._adapter.zap_mark(conn))
        if self._poll_tid is None:
            self._poll_tid = tid
            # (With the tid, its mark: the next poll invalidates what packs
            # removed since.  A review finding: without it, what a new
            # connection read before its first poll stayed in its cache.)
            self._poll_pack_mark = pack_mark
        return conn

    def _high_water(self):
        """The newest tid this instance has seen or committed (commits
        before a revert to an older replica state excepted)."""
        if self._last_commit_tid > self._commits_reverted:
            return max(self._seen_tid, self._last_commit_tid)
        return self._seen_tid

    def _server_behind(self, conn, tid):
        """A helper agent's check: after replica-timeout, processes went
        back to the first server of replica-conf, a primary restarted after
        its standby had been promoted and committed to; they read and wrote
        there, and the commits made on the promoted server were lost to
        them.  A server this instance left for another, behind what it saw
        since, when replica-timeout brought it back there, is left again for
        the next one of the list, and this transaction fails with a
        transient error.  (Not a failover, to a server used before or not,
        because the one in use failed: a promoted standby may lack what
        asynchronous replication had not sent (a review finding: a second
        failover, back to the first server, was refused for good); the
        poll then invalidates the caches.)"""
        reason = ("%s is behind what this process saw on %s (its last transaction %x, "
                  "already seen %x: a primary restarted after a failover? Edit "
                  "replica-conf)" % (conn.server, self._seen_server, tid, self._high_water()))
        self._adapter.step_off_server(conn.server, reason)
        self._snapshot_open = False
        conn.rollback()
        conn.broken = True
        self._give_back_load_conn()
        raise DisconnectedError(reason)

    def _replica_behind(self, tid, polling):
        """The snapshot just begun on a read-only replica is older than
        what this instance already saw: replication lag, not a restore
        from backup (the primary's history is intact)."""
        server = self._load_conn.server
        if self._options.revert_when_stale:
            log.info("The read-only replica %s is behind (its last transaction %x, "
                     "already seen %x); serving its older state (revert-when-stale).",
                     server, tid, self._high_water())
            self._seen_tid = tid
            self._commits_reverted = self._last_commit_tid
            self._reverted = True
            return
        self._stale_snapshot = True
        if not polling:
            raise self._stale_error()

    def _stale_error(self):
        return POSException.ReadConflictError(
            "The read-only replica %s is behind this connection's snapshot (its last "
            "transaction %x, already seen %x); retry the transaction"
            % (self._load_conn.server, self._snapshot_tid, self._high_water()))

    def _end_snapshot(self):
        self._stale_snapshot = self._reverted = False
        self._ra_until = -1
        self._close_snapshot()

    def _close_snapshot(self):
        # A later snapshot may carry the same tid yet differ (a pack does
        # not change the last tid).
        self._last_load = None
        self._prefetched = {}
        self._asked = set()
        if self._snapshot_open:
            self._snapshot_open = False
            conn = self._load_conn
            if conn is not None:
                conn.rollback()
                if conn.broken:
                    self._give_back_load_conn()
                else:
                    self._adapter.snapshot_ended(conn)

    def poll_invalidations(self):
        self._follow_gevent()
        with self._lock:
            try:
                return self._poll_invalidations()
            except DisconnectedError as exc:
                # The database is out of reach (restarting, failing over).
                # ZODB polls after every commit and abort too
                # (Connection.afterCompletion): raising there failed a
                # transaction that had committed, with an error transaction
                # managers retry, so the retry applied it twice, and made
                # abort() raise.  Nothing is read now: the ZODB connection
                # invalidates all it caches (None), and the next load opens a
                # snapshot, or raises the error where a retry is safe.
                self._end_snapshot()
                self._give_back_load_conn()
                log.warning("Could not poll %s for changes (%s); every object the "
                            "connection caches is invalidated, and the next load "
                            "tries again.",
                            self._adapter.describe(), exc)
                return None
            except StorageClosedError:
                # Closed by another thread (ZODB's DB.close()) between this
                # thread's tpc_finish and the poll after it: raising here
                # reported a committed transaction as failed (a review
                # finding).  The next load says the storage is closed.
                self._end_snapshot()
                self._give_back_load_conn()
                return None

    def _poll_invalidations(self):
        self._autorefresh = False
        self._records_ahead = None
        previous = self._poll_tid
        self._end_snapshot()
        self._forget_reads()
        conn = self._ensure_snapshot(polling=True)
        current = self._snapshot_tid
        if self._stale_snapshot:
            # Nothing to invalidate: the connection keeps what it has,
            # and its loads raise ReadConflictError until the replica
            # catches up.  What it caches is as of the last poll's mark
            # (a review finding: a commit of objects it holds was checked
            # from the replica's mark only).
            if self._poll_pack_mark is not None:
                self._read_mark = (self._poll_pack_mark if self._read_mark is None
                                   else min(self._read_mark, self._poll_pack_mark))
            return []
        self._poll_tid = current
        if self._reverted:
            # revert-when-stale: back to the replica's older state;
            # what the connection caches may be newer.
            self._poll_pack_mark = self._snapshot_pack_mark
            self._own_tids = set()
            return None
        mark, self._poll_pack_mark = self._poll_pack_mark, self._snapshot_pack_mark
        if previous is not None and self._cache.abandoned(previous):
            # Another instance of this process found that the database's
            # history changed under the snapshot we polled last (see
            # below): what our ZODB connection caches is from it.
            self._cache.pack_mark_at_most(self._marks_from(conn))
            self._forget_history()
            return None
        if (previous is not None and mark is not None
                and self._snapshot_pack_mark < mark and not conn.replica):
            # The pack mark only moves on (packs, zap_all): it went back
            # with a restored backup, whatever the last tid did.  (A
            # read-only replica may not have replayed a pack's batches yet.)
            log.warning("The database's pack mark went backwards (from %d to %d; restored "
                        "from a backup?); invalidating all caches.",
                        mark, self._snapshot_pack_mark)
            self._restored(0, max(previous, current), conn)
            return None
        removed = []
        if previous is not None and mark is not None and mark != self._snapshot_pack_mark:
            # Pack batches since our last poll: the objects they removed
            # are invalidated (a ghost of one raises POSKeyError when
            # loaded).  Revisions they trimmed were not current.
            removed = self._pack_removals(conn, mark, self._snapshot_pack_mark)
        if removed is None:
            # zap_all, or a pack whose list we cannot read: objects
            # our ZODB connection caches may be gone, so it must drop
            # everything.  The shared change log restarts at this
            # (post-pack) snapshot.
            self._forget_history()
            # After zap_all our commits are history that is gone.
            self._last_commit_tid = 0
            self._cache.poll(self._adapter, conn, None, current, self._snapshot_pack_mark)
            return None
        if previous is None or current == previous:
            self._own_tids = set()
            # Nothing to invalidate, but keep the shared change log
            # up to this snapshot.
            self._cache.poll(self._adapter, conn, previous, current,
                             self._snapshot_pack_mark)
            return removed
        if current < previous:
            # The database went back in time (restored from a backup):
            # nothing the connection caches can be trusted.
            log.warning("The database's last transaction went backwards "
                        "(from %x to %x); invalidating all caches.", previous, current)
            self._restored(current, previous, conn)
            return None
        if self._diverged_at is not None:
            # Restored from a backup, then committed to: the last tid
            # moved forward, but over another history than ours (a helper
            # agent's check: the poll read the new commits only, and the
            # transactions the restore removed stayed in every cache).
            # Snapshots after the oldest state a witness found belong to
            # the abandoned history (the other instances of this process
            # learn it from the cache: see abandoned above).
            log.warning("The database's history changed after transaction %x (objects "
                        "older than this connection saw them; restored from a backup?); "
                        "invalidating all caches.", self._diverged_at)
            self._restored(self._diverged_at, previous, conn)
            return None
        # One query at most, often none: the change log shared by all
        # instances may already hold (previous, current].
        changes = self._cache.poll(self._adapter, conn, previous, current,
                                   self._snapshot_pack_mark)
        if changes:
            # (The newest change; its object is checked by the next polls.)
            newest = max(changes, key=itemgetter(1)) + (self._snapshot_pack_mark,)
            if not self._witnesses or newest[1] > self._witnesses[0][1]:
                keep = self._adapter.snapshot_witnesses - 1
                self._witnesses = [newest] + self._witnesses[:keep]
        own = self._own_tids
        self._own_tids = set()
        # What this instance committed itself is already in its ZODB
        # connection's cache: invalidating it would only cost reloads.
        return [_oid_bytes(oid) for oid, tid in changes if tid not in own] + removed

    def _marks_from(self, conn):
        """The pack mark the process's cache goes back to when the
        database went back in time (its marks may count again from there:
        zodbconvert --clear makes the tables again); None on a read-only
        replica, whose mark may only be behind."""
        return None if conn.replica else self._snapshot_pack_mark

    def _forget_history(self):
        """After a restored backup: what this instance knew of the
        history it polled is gone with it."""
        self._own_tids = set()
        self._witnesses = []

    def _restored(self, current, previous, conn):
        """This instance noticed that the database was restored from a
        backup: what it knew of the history after ``current`` is gone,
        and so are the OIDs the process reserved (a helper agent's check:
        drawn from the counter after the backup point, they were drawn
        again from the restored counter by other processes, and every
        commit of one of them failed).  (The other instances of the
        process learn it from the cache: see abandoned.)"""
        self._cache.rolled_back(current, previous, self._marks_from(conn))
        self._forget_history()
        self._adapter.forget_oids()

    def _pack_removals(self, conn, after_mark, upto_mark):
        """OIDs (bytes) the pack batches of marks (after_mark, upto_mark]
        removed, or None when anything may be gone (see pack_removed_list in
        adapters/sql.py)."""
        if upto_mark < after_mark:
            return None
        rows = self._cache.pack_removals(
            after_mark, upto_mark,
            lambda after, upto: self._adapter.pack_removals(conn, after, upto))
        if rows is None:
            return None
        return rows.garbage_oids()

    def sync(self, force=True):
        self._follow_gevent()
        with self._lock:
            self._end_snapshot()
            self._forget_reads()

    def afterCompletion(self):
        self._follow_gevent()
        # The end of a transaction, or the ZODB connection was closed: the
        # next snapshot (poll_invalidations) takes a session again.
        # ZODB calls it once every resource of the transaction has finished
        # or aborted: a commit still here is left over (see
        # _abandon_commit), and holds its store session, perhaps locks.
        stale = self._commit
        if stale is not None and self._parent is not None:
            self._abandon_commit(stale)
        with self._lock:
            self._end_snapshot()
            self._give_back_load_conn()
            self._forget_reads()

    # ------------------------------------------------------------------
    # Loading

    def load(self, oid, version=''):
        if self._before is not None:
            result = self.loadBefore(oid, p64(self._before))
            if result is None:
                raise POSException.POSKeyError(oid)
            return result[:2]
        with self._lock:
            if self._snapshot_open and not self._autorefresh and not self._stale_snapshot:
                # An instance inside its snapshot (ZODB's usual case): what
                # _Read would do comes down to this lock.
                return self._load_in_snapshot(self._load_conn, oid)
        with self._read() as conn:
            return self._load_in_snapshot(conn, oid)

    def _load_in_snapshot(self, conn, oid):
        snapshot = self._snapshot_tid
        last = self._last_load
        if last is not None and last[0] == oid and last[1] == snapshot:
            # ZODB's Connection.get loads a state to make the ghost and
            # again to activate it; in one snapshot the answer is the
            # same, so the second load costs nothing.
            return last[2]
        oid_int = u64(oid)
        if oid_int > MAX_OID:
            raise POSException.POSKeyError(oid)     # (the driver's overflow)
        self._read_ahead(conn, oid_int)
        # Read by prefetch or read-ahead in this snapshot, not loaded
        # since: the answer without asking the index and the cache.
        result = self._prefetched.pop(oid_int, None)
        if result is None:
            # The revision current in our snapshot: from the caches when
            # the shared index knows its tid, else from the database.
            result = self._cache.load(self._adapter, conn, oid_int, snapshot,
                                      self._snapshot_pack_mark)
            if result is None or result[0] is None:
                raise POSException.POSKeyError(oid)
        answer = result[0], p64(result[1])
        self._last_load = (oid, snapshot, answer)
        return answer

    def _read_ahead(self, conn, oid_int):
        """Sequential read-ahead by OID.

        Objects created together get consecutive OIDs and tend to be read
        together (a container and its items, a BTree's buckets).  After
        READ_AHEAD_AFTER loads of consecutive OIDs on this connection (or
        OIDs at most READ_AHEAD_STRIDE apart, going forward), the next
        READ_AHEAD OIDs not already known to the cache are read in one
        query, in the same snapshot, instead of one round trip each.
        Random access never triggers it; a scan of cached objects costs no
        query (prefetch only asks for what the cache does not know), nor
        does the last of the objects an application prefetched itself: it
        named what it needs, and the run is read ahead only once it goes
        past them.
        """
        if 0 <= oid_int - self._ra_next < READ_AHEAD_STRIDE:
            self._ra_run += 1
        elif oid_int == self._ra_next - 1:
            # The same object again: ZODB's Connection.get loads a state to
            # make the ghost and again to activate it.  Neither breaks
            # nor extends the run.
            return
        else:
            self._ra_run = 0
        self._ra_next = oid_int + 1
        if (self._ra_run >= READ_AHEAD_AFTER and oid_int > self._ra_until
                and self._cache.local.limit and oid_int + 1 not in self._prefetched
                and oid_int not in self._asked):
            # (The next object already read by a prefetch: nothing to
            # read ahead yet; asked again at the next load.)
            self._ra_until = oid_int + READ_AHEAD - 1
            prefetched = self._prefetched
            if len(prefetched) > READ_AHEAD:
                # What the reader went past without loading (the objects
                # between a strided run's): the caches still have them.
                for passed in [oid for oid in prefetched if oid < oid_int]:
                    del prefetched[passed]
            prefetched.update(self._cache.prefetch(
                self._adapter, conn, range(oid_int, min(oid_int + READ_AHEAD, MAX_OID + 1)),
                self._snapshot_tid, self._snapshot_pack_mark))

    def _forget_reads(self):
        """The reading transaction ended: what the next one reads starts
        its pack mark (_read_mark) and its count of history reads
        (_history_seen) again."""
        self._read_mark = None
        self._history_seen = None

    def _history_read(self):
        """Note a read from history (loadSerial, loadBefore): old states
        may reference what a pack removed since, and a transaction that
        stores them checks that what they reference exists
        (Commit._check_not_removed).  Counted on the root storage, per
        thread, which the commit compares with the count of its thread
        when its transaction began: the application may read through one
        instance (``db.storage``, another connection's) and store through
        another (a helper agent's check).  Per thread: a historical
        connection of another thread (``db.open(at=...)``, every load a
        loadBefore) does not make every commit pay for the check (a
        review finding).  Not the reads of a vote's own conflict
        resolution, which merges states the commit checks as it always
        does."""
        me = threading.get_ident()
        if self._resolving == me:
            return
        if self._history_seen is None:
            self._history_seen = self._history_count()
        counts = self._root._history_reads
        # (Only this thread writes its entry.)
        counts[me] = counts.get(me, 0) + 1

    def _history_count(self):
        return self._root._history_reads.get(threading.get_ident(), 0)

    def loadBefore(self, oid, tid):
        self._history_read()
        if u64(oid) > MAX_OID:
            # No such object, as for a smaller OID never used (a helper
            # agent's check: None, which ZODB reads as "no revision before
            # tid", a ReadConflictError that transaction managers retry).
            raise POSException.POSKeyError(oid)
        with self._read() as conn:
            result = history.revision_before(self._adapter, conn, oid,
                                             min(u64(tid), history.MAX_TID))
        if result is None:
            return None
        state, start, end = result
        self._cache.put(u64(oid), start, state)
        return state, p64(start), (p64(end) if end is not None else None)

    def getTid(self, oid):
        """The tid of the current revision; POSKeyError when there is none."""
        return self.load(oid)[1]

    def loadSerial(self, oid, serial):
        self._check_open()      # (its cache hit opens no snapshot)
        self._history_read()
        oid_int, tid_int = u64(oid), u64(serial)
        if history.beyond_range(oid_int, tid_int):
            raise POSException.POSKeyError(oid)
        state = self._cache.get(oid_int, tid_int)
        if state is not None:
            return state
        with self._read() as conn:
            found, state = self._adapter.load_revision(conn, oid_int, tid_int)
            if not found:
                # A revision committed after our snapshot began: revisions
                # never change, so reading it outside the snapshot is safe.
                with self._fresh_read() as fresh:
                    found, state = self._adapter.load_revision(fresh, oid_int, tid_int)
        if not found or state is None:
            raise POSException.POSKeyError(oid)
        self._cache.put(oid_int, tid_int, state)
        return state

    def prefetch(self, oids):
        """Load many objects in one query, warming the state cache."""
        # int.from_bytes is u64 without a Python call per OID.
        oid_ints = [int.from_bytes(oid, 'big') for oid in oids]
        if oid_ints and max(oid_ints) > MAX_OID:
            oid_ints = [oid_int for oid_int in oid_ints if oid_int <= MAX_OID]
        if not oid_ints or self._before is not None:
            return
        with self._read() as conn:
            fetched = self._cache.prefetch(self._adapter, conn, oid_ints, self._snapshot_tid,
                                           self._snapshot_pack_mark)
            if not self._autorefresh:
                # Kept for this snapshot's loads (see load); the root
                # storage's snapshot ends with this call.
                self._prefetched.update(fetched)
                self._asked.update(oid_ints)

    def lastTransaction(self):
        if self._before is not None:
            return p64(self._before - 1)
        with self._read():
            return p64(max(self._snapshot_tid, self._last_commit_tid))

    def lastTransactionInt(self):
        """lastTransaction() as an int (earlier releases had it; tools call it)."""
        return u64(self.lastTransaction())

    # ZODB 3's API, which earlier releases kept for old tools: no versions.

    def supportsVersions(self):
        return False

    def modifiedInVersion(self, oid):
        return ''

    def loadEx(self, oid, version=''):
        state, serial = self.load(oid, version)
        return state, serial, ''

    # ------------------------------------------------------------------
    # Two-phase commit

    # Store sessions: taken from the pool when the commit first needs the
    # database, given back by _end_tpc.

    def _take_store_conn(self):
        if self._store_conn is None:
            self._check_open()
            pool = self._adapter.store_sessions
            held, self._held_conn = self._held_conn, None
            if held is not None:
                # The retry votes in the held transaction.
                pool.attach()
                self._store_conn = held
            else:
                self._store_conn = pool.take()
        return self._store_conn

    def _give_back_store_conn(self, keep_held=False):
        """Return the store session to the pool.  One that holds the row
        locks of a lost vote for its retry (commit.py, "Fairness") stays
        with this instance when ``keep_held``, outside the pool's count:
        the retry may never come (the server then ends the hold), and the
        other connections of the process must not wait for it."""
        conn, self._store_conn = self._store_conn, None
        if conn is None:
            return
        pool = self._adapter.store_sessions
        if conn.holding_locks and keep_held:
            self._held_conn = conn
            pool.detach()
            return
        try:
            if conn.holding_locks:
                self._end_hold(conn)
        finally:
            pool.give_back(conn)

    def _end_hold(self, conn):
        commit.end_hold_and_roll_back(self._adapter, conn)

    def _close_held_conn(self):
        held, self._held_conn = self._held_conn, None
        if held is not None:
            self._end_hold(held)
            held.close()

    @contextlib.contextmanager
    def _fresh_read(self):
        """A session that sees what was committed after our snapshot
        began (a store session, so on the primary): the commit's own while
        it holds one, else one borrowed for this read."""
        if self._store_conn is not None:
            yield self._store_conn
            return
        pool = self._adapter.store_sessions
        conn = pool.take()
        try:
            # (On the server chosen now: a helper agent's check found
            # deleteObject asking a server replica-conf no longer named.)
            self._adapter.follow_server(conn)
            yield conn
        finally:
            try:
                conn.rollback()
            finally:
                # (Given back even when the rollback was interrupted: the
                # pool closes it and counts it back; a review finding.)
                pool.give_back(conn)

    def _check_txn(self, txn):
        if self._commit is None or txn is not self._commit.txn:
            if txn is not None and txn is self._released_txn:
                raise self._released_error()
            raise POSException.StorageTransactionError(self, txn)
        return self._commit

    def _check_unvoted(self, txn):
        """The commit of ``txn``, which may still take changes: everything
        it writes comes before its vote (a helper agent's check: a store
        after tpc_vote was accepted, left out of the commit, and still
        given to this process's cache, which then disagreed with the
        database; a readCurrent after it was never checked)."""
        pending = self._check_txn(txn)
        if pending.voted:
            raise POSException.StorageTransactionError(
                "%s: the transaction has voted (tpc_vote); it takes no more changes "
                "before tpc_finish or tpc_abort" % self.getName())
        return pending

    def _check_not_released(self, pending):
        """(self._lock held.)  A vote or finish that passed _check_txn
        and then waited for the lock: release() may have aborted its commit
        meanwhile (a review finding: a finish then returned a tid with
        nothing committed, and a vote took the commit lock that no
        tpc_abort would give back)."""
        if self._commit is not pending or pending.txn is self._released_txn:
            raise self._released_error()

    def _released_error(self):
        return StorageClosedError(
            "%s was released (or closed) while this transaction was committing "
            "(ZODB's DB.close()?): it was aborted, and nothing of it was "
            "committed" % self.getName())

    def tpc_transaction(self):
        return self._commit.txn if self._commit is not None else None

    def tpc_begin(self, txn, tid=None, status=' '):
        # (What a commit does next, under the locks, comes after this.)
        self._follow_gevent()
        if self._is_read_only:
            if self._before is not None:
                # A historical connection (db.open(at=...)), as ZODB's own
                # storages say it (a subclass of ReadOnlyError).
                raise POSException.ReadOnlyHistoryError()
            raise POSException.ReadOnlyError()
        ext = getattr(txn, 'extension_bytes', None)
        if ext is None:
            ext = history.dump_extension(getattr(txn, 'extension', None) or {})
        meta = (_as_bytes(txn.user), _as_bytes(txn.description), ext, status)
        if tid is not None:
            _check_given_tid(u64(tid))
        self._begin_commit(txn, meta, u64(tid) if tid is not None else None)

    def _begin_commit(self, txn, meta=None, tid=None):
        self._check_open()
        if self._snapshot_open and self._snapshot_pid != os.getpid():
            # A helper agent's check: a worker forked while its parent had
            # changes pending in a transaction committed them, and so did
            # the parent: applied twice (a conflict-resolving counter went
            # up by 10 for a change of 5).
            raise DisconnectedError(
                "This transaction of %s began in the parent of this forked process, "
                "which may commit it too: abort it and begin again" % self.getName())
        with self._tpc_cond:
            if self._commit is not None and self._commit.txn is txn:
                raise POSException.StorageTransactionError(
                    "Duplicate tpc_begin calls for same transaction")
            stale = self._commit
        if stale is not None and stale.thread == threading.get_ident():
            # This thread cannot be in two commits of one storage at once:
            # the earlier one's transaction ended without its tpc_abort
            # running to the end (an exception thrown into the thread
            # there: a helper agent's check saw the next commit wait for
            # it for good).
            self._abandon_commit(stale)
        self._released_txn = None
        with self._tpc_cond:
            while self._commit is not None:
                self._tpc_cond.wait()
            # (What the transaction read came from snapshots at or after
            # _read_mark: see Commit._check_not_removed.  A review finding:
            # the mark of the last poll never moved for a storage used
            # without ZODB.DB.)
            self._commit = commit.Commit(self._adapter, self._cache, self._blobs,
                                         txn, meta, tid, read_mark=self._read_mark,
                                         untransform=(None if self._root._wrapper is None
                                                      else self._crs_untransform_record_data))
        return self._commit

    def store(self, oid, serial, data, version, txn):
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        # (_check_unvoted's usual case inlined: once per object.)
        pending = self._commit
        if pending is None or txn is not pending.txn or pending.voted:
            pending = self._check_unvoted(txn)
        if version:
            raise POSException.Unsupported("Versions aren't supported")
        if len(oid) != 8:
            raise POSException.StorageError("Invalid OID %r: not 8 bytes" % (oid,))
        # int.from_bytes: u64 without a Python call, once per object.
        oid_int = int.from_bytes(oid, 'big')
        if oid_int >= OID_LIMIT:
            _refuse_oid(oid_int)
        if data is None:
            # (A helper agent's check: it committed the object's deletion,
            # as deleteObject does; FileStorage raises TypeError.)
            raise TypeError("store() of object %s was given no state (None): a "
                            "deletion is deleteObject()'s" % oid_repr(oid))
        pending.store(oid_int, _tid_int(serial), data)
        return None

    def restore(self, oid, serial, data, version, prev_txn, txn):
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        pending = self._check_unvoted(txn)
        if version:
            raise POSException.Unsupported("Versions aren't supported")
        if data is None and prev_txn is not None:
            # A back pointer: the record repeats the state of prev_txn.
            data = self._state_of_revision(oid, prev_txn)
        oid_int = u64(oid)
        if oid_int >= OID_LIMIT:
            _refuse_oid(oid_int)
        _check_given_tid(u64(serial))
        pending.restore(oid_int, u64(serial), data)

    def _state_of_revision(self, oid, serial):
        """loadSerial, but None for a revision that has no state (an undone
        creation: the record of an undo of its undo points back to it; a
        helper agent's check found such a source, which FileStorage and
        RelStorage 4.3 copy, failing zodbconvert with POSKeyError)."""
        try:
            return self.loadSerial(oid, serial)
        except POSException.POSKeyError:
            with self._fresh_read() as conn:
                found, _ = self._adapter.load_revision(conn, u64(oid), u64(serial))
            if not found:
                raise
            return None

    def deleteObject(self, oid, oldserial, txn):
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        pending = self._check_unvoted(txn)
        oid_int = u64(oid)
        if oid_int > MAX_OID:
            raise POSException.POSKeyError(oid)
        # An object that never existed cannot be deleted, as FileStorage
        # says (a helper agent's check: a row without a state was written
        # for it); that oldserial is still current is checked at vote.
        # (On the primary, as the vote will see it; tids only.)
        with self._fresh_read() as conn:
            current = self._adapter.current_tids(conn, [oid_int]).get(oid_int)
        if current is None:
            raise POSException.POSKeyError(oid)
        if oldserial and current != u64(oldserial):
            # Already stale: said now, as FileStorage says it (a helper
            # agent's check: zc.zodbdgc skips an object whose deleteObject
            # raises ConflictError; raised by the vote instead, it failed
            # the whole collection).  The vote still checks, for a commit
            # made meanwhile.
            raise POSException.ConflictError(oid=oid, serials=(p64(current), oldserial))
        pending.store(oid_int, u64(oldserial) if oldserial else 0, None)

    def checkCurrentSerialInTransaction(self, oid, serial, txn):
        # Called once per object read with readCurrent (a catalog query
        # may read thousands): _check_txn and _tid_int's usual case are
        # inlined, and int.from_bytes is u64 without a Python call.
        if len(oid) != 8:
            raise POSException.StorageError("Invalid OID %r: not 8 bytes" % (oid,))
        pending = self._commit
        if pending is None or txn is not pending.txn or pending.voted:
            self._check_unvoted(txn)    # raises the error that says why
        oid_int = int.from_bytes(oid, 'big')
        if oid_int > MAX_OID:
            # No such object, as FileStorage says (a helper agent's check:
            # the vote failed with the drivers' overflow errors).
            raise POSException.POSKeyError(oid)
        pending.read_current[oid_int] = (
            int.from_bytes(serial, 'big') if type(serial) is bytes else _tid_int(serial))

    def tpc_vote(self, txn):
        pending = self._check_txn(txn)
        if pending.voted:
            # A second vote answers as the first did, as FileStorage's.  (A
            # helper agent's check: it voted again, failed against its own
            # uncommitted rows and rolled them back; tpc_finish then
            # returned a tid for a transaction that was not committed.)
            return [p64(oid) for oid in sorted(pending.resolved)]
        self._check_one_voter()
        with self._lock:
            self._check_not_released(pending)
            resolved = self._vote(pending)
        return [p64(oid) for oid in resolved]

    @property
    def _root(self):
        """The storage made from the configuration, whose instances this
        one's siblings are.  (Not ``self._parent or self``: a storage's
        truth is its __len__, a query.)"""
        return self._parent if self._parent is not None else self

    def _check_one_voter(self):
        """Refuse a vote while another instance of this database voted in
        this thread and is not finished: it holds the commit lock until
        its tpc_finish or tpc_abort, which this thread would never reach
        (a helper agent's check: an undo beside other changes in one
        transaction, ZODB's TransactionalUndo voting through an instance of
        its own, waited commit-lock-timeout and failed with a transient
        error, which transaction managers retry in vain; FileStorage
        hangs)."""
        root = self._root
        me = threading.get_ident()
        other = root._voters.setdefault(me, self)
        if other is not self and (other._commit is None or not other._commit.voted
                                  or other._voting_as != me or other._closed
                                  or other._commit.pid != os.getpid()):
            # (Left by an instance released or closed in its commit, or
            # whose vote failed: only a vote that succeeded holds the
            # commit lock; or by the parent of this forked process, whose
            # lock it is.)
            root._voters[me] = other = self
        if other is not self:
            raise SameDatabaseTwiceError(
                "%s: another connection to this database voted in this transaction "
                "and holds the commit lock until the transaction ends; a second "
                "vote would wait for it forever. Two ZODB connections of one "
                "database, or an undo beside other changes of it, cannot commit "
                "in one transaction: commit them in transactions of their own."
                % self._name)
        self._voting_as = me

    def _vote(self, pending):
        if pending.read_mark is None:
            # What it read since tpc_begin (an undo reads then).
            pending.read_mark = self._read_mark
        seen = self._history_seen
        if seen is not None and self._history_count() != seen:
            pending.from_history = True
        for attempt in (1, 2):
            conn = self._take_store_conn()
            self._resolving = threading.get_ident()
            try:
                return pending.vote(conn, self.tryToResolveConflict)
            except DisconnectedError:
                # Lost the store connection (server restarted, session
                # killed) before anything was moved into place: nothing of
                # this transaction was committed and everything to vote is
                # still buffered, so vote once more on a new connection.
                if attempt == 2 or pending.tid is not None:
                    raise
                self._give_back_store_conn()    # broken: the pool closes it
                self._adapter.store_sessions.drop_idle()
            finally:
                self._resolving = None

    def tpc_finish(self, txn, f=None):
        pending = self._check_txn(txn)
        self._records_ahead = None      # (read before this commit)
        if not pending.voted:
            raise POSException.StorageTransactionError(
                "tpc_finish called without tpc_vote")
        try:
            with self._lock:
                self._check_not_released(pending)
                self._finish(pending, f)
            return p64(pending.tid)
        finally:
            with self._tpc_cond:
                current = self._commit is pending
            if current:
                # (Not when release() ended it: another commit may be
                # under way on this instance by now.)
                self._end_tpc()

    def _finish(self, pending, f=None):
        tid_int = pending.finish()
        self._changed_here()
        self._last_commit_tid = tid_int
        self._own_tids.add(tid_int)
        if f is not None:
            f(p64(tid_int))
        # Later loads through this instance must see what it wrote.
        self._end_snapshot()

    def tpc_abort(self, txn):
        pending = self._commit
        if pending is None or txn is not pending.txn:
            return
        try:
            with self._lock:
                pending.abort()
        finally:
            self._end_tpc()

    def _abandon_commit(self, pending):
        """Abort ``pending``, a commit whose transaction is over without
        its tpc_finish or tpc_abort having run to the end."""
        log.warning("Aborting a commit of %s left over from a transaction that "
                    "ended without finishing or aborting it (interrupted?)",
                    self.getName())
        try:
            with self._lock:
                pending.abort()
        finally:
            with self._tpc_cond:
                current = self._commit is pending
            if current:
                self._end_tpc()

    def _end_tpc(self):
        if not self._snapshot_open:
            # (An open snapshot goes on serving the next transaction's
            # reads: a review finding.)
            self._forget_reads()
        if self._voting_as is not None:
            voters = self._root._voters
            if voters.get(self._voting_as) is self:
                del voters[self._voting_as]
            self._voting_as = None
        with self._tpc_cond:
            if self._commit is not None:
                self._commit.close()
            self._commit = None
            with self._lock:
                self._give_back_store_conn(keep_held=True)
            self._tpc_cond.notify_all()

    def copy_transactions_in(self, copied):
        """Commit ``copied`` (commit.CopiedTransaction, in tid order, each
        after the last committed one) in one database transaction, through
        the same steps as a commit.  zodbconvert's fast path."""
        self._follow_gevent()
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        for c in copied:
            _check_given_tid(c.tid)
            for oid_int, _ in c.rows:
                if oid_int >= OID_LIMIT:
                    _refuse_oid(oid_int)
        pending = self._begin_commit(object())
        try:
            for c in copied:
                pending.add_copied(c)
            with self._lock:
                self._vote(pending)
                self._finish(pending)
        except BaseException:
            with self._lock:
                pending.abort()
            raise
        finally:
            self._end_tpc()

    # ------------------------------------------------------------------
    # Blobs (IBlobStorage, IBlobStorageRestoreable; only with a blob-dir)

    def storeBlob(self, oid, oldserial, data, blobfilename, version, txn):
        self.store(oid, oldserial, data, version, txn)
        self._commit.add_blob(u64(oid), blobfilename)

    def restoreBlob(self, oid, serial, data, blobfilename, prev_txn, txn):
        self.restore(oid, serial, data, '', prev_txn, txn)
        self._commit.add_blob(u64(oid), blobfilename)

    def loadBlob(self, oid, serial):
        self._follow_gevent()
        self._check_blob_ids(oid, serial)
        return self._blobs.load(self._read_blob_chunks, u64(oid), u64(serial))

    def _check_blob_ids(self, oid, serial):
        if self._blobs is None:
            raise POSException.Unsupported("No blob-dir is configured")
        if history.beyond_range(u64(oid), u64(serial)):
            # No such blob (a helper agent's check: SQLite's driver failed
            # on the serial with OverflowError).
            raise POSException.POSKeyError(oid)

    def openCommittedBlobFile(self, oid, serial, blob=None):
        self._follow_gevent()
        self._check_blob_ids(oid, serial)
        if blob is None:
            def opener(path):
                return open(path, 'rb')
        else:
            def opener(path):
                return BlobFile(path, 'r', blob)
        # (Opened before a prune of the cache can remove it: see open_file.)
        return self._blobs.open_file(self._read_blob_chunks, u64(oid), u64(serial), opener)

    def temporaryDirectory(self):
        return self._blobs.temporary_directory()

    def stored_blob_digest(self, oid, serial):
        """The SHA-256 (hex) of a blob revision's bytes as the database
        holds them, not the blob-dir's copy (zodbconvert --verify: right
        after a copy, the cache holds the files the copy itself wrote);
        None where the database holds no blob bytes (shared-blob-dir)."""
        if self._blobs is None or not self._blobs.in_database:
            return None
        digest = hashlib.sha256()
        if self._read_blob_chunks(u64(oid), u64(serial), digest.update) is None:
            raise POSException.POSKeyError("No blob for object %r at %r" % (oid, serial))
        return digest.hexdigest()

    def _read_blob_chunks(self, oid_int, tid_int, write):
        """Stream a blob's chunks to ``write``; its size, or None if absent."""
        adapter = self._adapter
        with self._read() as conn:
            count = adapter.blob_chunk_count(conn, oid_int, tid_int)
            if count:
                return self._copy_blob_chunks(conn, oid_int, tid_int, count, write)
            # Committed after our snapshot began? Revisions never change,
            # so the latest committed data is as good.
            with self._fresh_read() as fresh:
                count = adapter.blob_chunk_count(fresh, oid_int, tid_int)
                if count:
                    return self._copy_blob_chunks(fresh, oid_int, tid_int, count, write)
        # Packed away since an open iterator's snapshot began? (zodbconvert)

        def in_snapshot(conn):
            count = adapter.blob_chunk_count(conn, oid_int, tid_int)
            return self._copy_blob_chunks(conn, oid_int, tid_int, count, write) if count else None
        return self._iterators.read(in_snapshot)

    def _copy_blob_chunks(self, conn, oid_int, tid_int, count, write):
        """The blob's size, or None if a chunk is gone (see
        Adapter.stream_blob_chunk)."""
        adapter = self._adapter
        total = 0
        for num in range(count):
            size = adapter.stream_blob_chunk(conn, oid_int, tid_int, num, write)
            if size is None:
                return None
            total += size
        return total

    def new_oid(self):
        self._follow_gevent()
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        self._check_open()
        oid_int = self._adapter.new_oid()
        if oid_int >= OID_LIMIT:
            raise POSException.StorageError(
                "The OIDs of %s are used up: the next would be 0x%x, and a RelStorage "
                "database keeps OIDs below 0x%x" % (self._name, oid_int, OID_LIMIT))
        # (Not p64: its wrapper is a tenth of a call here.)
        return _oid_bytes(oid_int)

    # ------------------------------------------------------------------
    # History, undo, iteration

    def supportsUndo(self):
        return self._adapter.keep_history

    @property
    def keep_history(self):
        """Whether the database keeps history (earlier releases had it)."""
        return self._adapter.keep_history

    def history(self, oid, size=1):
        if u64(oid) > MAX_OID:
            raise POSException.POSKeyError(oid)
        with self._read() as conn:
            return history.object_history(self._adapter, conn, oid, size)

    def undoLog(self, first=0, last=-20, filter=None):
        if not self._adapter.keep_history:
            return []
        with self._read() as conn:
            return history.undo_log(self._adapter, conn, self._snapshot_tid,
                                    first, last, filter)

    def undoInfo(self, first=0, last=-20, specification=None):
        if specification:
            def filter(desc):
                return all(desc.get(k) == v for k, v in specification.items())
        else:
            filter = None
        return self.undoLog(first, last, filter)

    def undo(self, transaction_id, txn):
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        pending = self._check_unvoted(txn)
        if not self._adapter.keep_history:
            raise POSException.UndoError("Undo is not supported by history-free storages")
        with self._read() as conn:
            tid = history.undo_tid(transaction_id)
            oids = history.undo(self._adapter, conn, tid, pending, self.tryToResolveConflict)
        pending.undone_tids.add(tid)
        return None, [p64(oid) for oid in oids]

    def iterator(self, start=None, stop=None):
        self._check_open()
        return self._iterators.add(history.TransactionIterator(self._adapter, start, stop))

    def record_iternext(self, next=None):
        start = u64(next) if next is not None else 0
        changes = self._root._local_changes
        with self._lock:
            ahead = self._records_ahead
            if ahead is not None and ahead.changes == changes:
                record = ahead.take(start)
                if record is not None:
                    return record
        with self._read() as conn:
            record, ahead = history.record_iternext(self._adapter, conn, next, ahead)
        if ahead is not None:
            # Read after ``changes`` was taken: a change of this process
            # since (a commit through another instance: ZODB's connections
            # commit through their own) makes them stale.  (A helper
            # agent's check: the record of an object this process had just
            # changed came back with its old state.)
            ahead.changes = changes
        self._records_ahead = ahead
        return record

    def _changed_here(self):
        """This process changed the database: records read ahead before
        are not to be served (record_iternext)."""
        self._records_ahead = None
        self._root._local_changes += 1

    def copyTransactionsFrom(self, other, verbose=False):
        """Copy every transaction of ``other`` (any IStorageIteration),
        keeping their tids, many per database transaction; blobs go through
        ``restoreBlob`` (see copy.py)."""
        from . import copy
        copy.copy_transactions(other, self)

    def pack(self, t, referencesf, gc=None):
        """IStorage.pack; see run_pack."""
        self.run_pack(t, referencesf, gc=gc)

    def run_pack(self, t, referencesf, gc=None, prepack_only=None, skip_prepack=None,
                 progress=None):
        """Pack to time ``t`` (see storage/pack.py); returns a PackReport.
        ``gc``, ``prepack_only`` and ``skip_prepack`` default to the
        pack-gc, pack-prepack-only and pack-skip-prepack options (either
        mode asked for replaces both: zodbpack's --prepack and
        --use-prepack-state);
        ``progress`` makes a progress display per phase (zodbpack)."""
        self._follow_gevent()
        if self._is_read_only:
            # (Said: zodbpack printed the bare class name, a helper agent's
            # check.)
            raise POSException.ReadOnlyError(
                "%s is opened read-only (read-only true): it cannot be packed"
                % self.getName())
        self._check_open()
        from . import pack
        options = self._options
        # One mode asked for replaces the configuration's other one (they
        # contradict each other: with both, nothing was analysed and
        # nothing deleted, a helper agent's check).
        if prepack_only and skip_prepack:
            raise ValueError('prepack_only and skip_prepack contradict each other')
        if prepack_only:
            skip_prepack = False
        elif skip_prepack:
            prepack_only = False
        report = pack.pack(
            self._adapter, options, t, self._references_function(referencesf),
            gc=options.pack_gc if gc is None else gc,
            blobs=self._blobs, cache=self._cache,
            prepack_only=options.pack_prepack_only if prepack_only is None else prepack_only,
            skip_prepack=options.pack_skip_prepack if skip_prepack is None else skip_prepack,
            progress=progress)
        self._changed_here()
        with self._lock:
            self._end_snapshot()
        return report

    def check_references(self, referencesf, progress=None):
        """References from current revisions to objects that do not exist,
        as (oid, tid, missing oid) integers; removes nothing."""
        self._check_open()
        from . import pack
        return pack.check_references(self._adapter, self._references_function(referencesf),
                                     progress=progress)

    def refresh_statistics(self):
        """Give the database's query planner fresh statistics of the
        tables, after a bulk load (zodbconvert does it after a copy)."""
        self._check_open()
        self._adapter.refresh_statistics()

    def mark_copy(self, started, copied_too=True):
        """Record that a copy into this database began at ``started``
        (seconds since the epoch) and has not finished, or, with None,
        that it has (copy.py: zodbconvert, copyTransactionsFrom); returns
        the mark of an earlier copy not finished, which stays (or None).
        Until the copy has finished, a pack with garbage collection refuses
        to run: a copy cut
        short holds objects whose referrers it has not copied yet (from a
        history-free source, every object's current revision comes under
        its own transaction), and a pack removed them for good (a helper
        agent's check).  A copy's end also ends, ``copied_too``, what a
        transaction committed with its own tid marks (commit.py: a copy
        that does not say when it ends)."""
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        self._check_open()
        conn = self._adapter.open_connection('store')
        try:
            earlier = self._adapter.set_copy_mark(conn, started, copied_too)
            conn.commit()
            return earlier
        except BaseException:
            conn.rollback()
            raise
        finally:
            conn.close()

    def zap_all(self, **kwargs):
        """Remove every object and transaction, leaving an empty, usable
        database with its schema (zodbshootout's ``--zap``, test tools).

        Afterwards ``lastTransaction()`` is z64 again, so history with any
        tids can be copied in.  Every process, this one included, drops what
        it cached with its next snapshot: the zap moves the pack mark on.
        ``kwargs`` are accepted for callers written for older versions.
        """
        self._follow_gevent()
        if self._is_read_only:
            raise POSException.ReadOnlyError()
        self._check_open()
        with self._lock:
            self._end_snapshot()
            old_last, mark = self._adapter.zap_all()
            self._last_commit_tid = 0
        self._changed_here()
        self._cache.zapped(mark, old_last)
        if self._blobs is not None:
            self._blobs.forget_all()

    @property
    def adapter(self):
        """The database adapter (``interfaces.IRelStorageAdapter``), for
        tools such as zodbconvert; ZODB itself never needs it."""
        return self._adapter

    @property
    def options(self):
        """The ``Options`` this storage was opened with (read only)."""
        return self._options

    # ------------------------------------------------------------------
    # Small IStorage methods

    def getName(self):
        return self._name

    def sortKey(self):
        return self._sort_key

    def isReadOnly(self):
        return self._is_read_only

    def getSize(self):
        with self._read() as conn:
            return self._adapter.database_size(conn)

    def __len__(self):
        with self._read() as conn:
            return self._adapter.count_objects(conn)

    def cache_stats(self):
        """Hit/miss statistics of the storage-wide state cache."""
        return self._cache.stats()

    def __repr__(self):
        return '<%s %r at 0x%x>' % (type(self).__name__, self._name, id(self))


#: The attribute values of a wrapper that new_instance copies to the one it
#: makes again around an instance (zlibstorage's _transform, a function).
_WRAPPER_SETTINGS = (types.FunctionType, types.BuiltinFunctionType,
                     bool, int, float, str, bytes, type(None))


class _Read:
    """One read call: holds the instance's lock and its snapshot.

    The root storage (``_autorefresh``) ends the snapshot when the
    outermost read call returns (conflict resolution and undo read inside
    other calls); instances keep it until afterCompletion or the next poll.
    """

    __slots__ = ('storage',)

    def __init__(self, storage):
        self.storage = storage

    def __enter__(self):
        storage = self.storage
        # (_follow_gevent, inline: every read call passes here.)
        if storage._locks_made_with is not threading.Lock:
            storage._renew_locks()
        # An interrupt (Ctrl-C, an exception sent to the thread) landing
        # between the lock and the count left the lock taken for good, and
        # every later read of the storage hung (a helper agent's check).
        lock = storage._lock
        was_owned = lock._is_owned()
        before = None
        try:
            lock.acquire()
            before = storage._reads
            storage._reads = before + 1
            return storage._ensure_snapshot()
        except BaseException:
            if before is not None and storage._reads == before + 1:
                self.__exit__()
            elif not was_owned and lock._is_owned():
                lock.release()
            raise

    def __exit__(self, *exc_info):
        storage = self.storage
        storage._reads -= 1
        try:
            if storage._autorefresh and not storage._reads:
                storage._close_snapshot()
                storage._give_back_load_conn()
        finally:
            storage._lock.release()


def _tid_int(serial):
    if type(serial) is bytes:
        return int.from_bytes(serial, 'big')
    if not serial:
        return 0
    if isinstance(serial, str):
        # Old callers (and ZODB's own doctests) pass '\0' * 8.
        serial = serial.encode('latin-1')
    return u64(serial)


def _as_bytes(value):
    if value is None:
        return b''
    if isinstance(value, str):
        return value.encode('utf-8')
    return bytes(value)
