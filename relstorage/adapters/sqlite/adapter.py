"""SQLite adapter.

The data directory holds three database files: ``main.sqlite3`` (states,
transactions), ``oids.sqlite3`` (the OID counter) and, once a pack ran,
``pack.sqlite3`` (the pack's recorded references and candidates).  The OID
counter and the pack's tables live apart so that handing out OIDs, and a
pack's analysis, never wait for or hold SQLite's single writer lock of the
main file, which a committing transaction holds from vote to finish.

Every connection runs in WAL mode, so readers keep their snapshot while a
writer commits, and several processes on one host can share the directory.
Write transactions begin IMMEDIATE: the database-wide lock is taken at once
(waiting up to commit-lock-timeout) instead of failing later on upgrade.
The wait for it is ours, not SQLite's busy handler: see ``begin_store``.
"""
import ctypes
import fcntl
import logging
import os
import random
import sqlite3
import threading
import time
import weakref

from ...directories import ensure_directory
from ...interfaces import DatabaseFullError
from ...interfaces import RelStorageError
from ..base import Adapter
from ..packing import PackLock
from . import drivers
from . import sql
from .pragmas import check_pragmas
from .pragmas import pragma_is_on
from .pragmas import pragma_statement
from .walkeeper import WalKeeper

log = logging.getLogger(__name__)

MAIN_DB = 'main.sqlite3'
OID_DB = 'oids.sqlite3'
PACK_DB = 'pack.sqlite3'

#: What a commit may write at COMMIT beyond its pages' estimate (see
#: Sqlite3Adapter.check_commit_room).
COMMIT_ROOM_MARGIN = 256 * 1024
PACK_LOCK = 'pack.lock'
#: How long acquire_pack_lock asks again before it says a pack runs.
PACK_LOCK_PATIENCE = 0.05
#: A write transaction waiting for the database's write lock holds a
#: shared lock on this file meanwhile (writers_waiting).
WRITERS_WAITING = 'writers.waiting'
#: The write-ahead log is emptied (see snapshot_ended) once it is past
#: this many times wal_autocheckpoint's pages, checked at most every
#: WAL_CHECK_INTERVAL seconds.
WAL_RESTART_PAGES = 4
WAL_CHECK_INTERVAL = 0.2
WAL_RETRY_MAX = 5.0
#: Every open adapter holds a shared lock on this file, so that drop_all
#: (zodbconvert --clear) can tell that another process still uses the
#: files it would remove.
IN_USE = 'in-use.lock'
# OIDs reserved per durable round trip (allocation is a fsync'd commit):
# the first block of a process; each further block is twice the last, up to
# OID_BLOCK_MAX, so that a process allocating many OIDs syncs rarely (1000
# OIDs in 128-blocks cost 8 fsyncs, more than the commit that stores them)
# while one that allocates a few leaves a small gap when it exits.
OID_BLOCK = 128
OID_BLOCK_MAX = 16384
# How often a write transaction asks again for the write lock while
# another holds it: the first retry after WRITE_WAIT_FIRST seconds, each
# next one twice as late, up to WRITE_WAIT_MAX.  (A try that fails costs
# microseconds; the pack leaves the lock free between its batches a
# little longer than WRITE_WAIT_MAX: storage/pack.py WRITERS_TURN.)
WRITE_WAIT_FIRST = 0.0002
WRITE_WAIT_MAX = 0.001
#: Rows of a pack table moved out of an older main file deleted per write
#: transaction (see _move_pack_tables_apart).
LEGACY_DELETE_ROWS = 20000

#: Pragmas that shape a new database and cannot change an existing one in
#: WAL mode: applied before the others (journal_mode wal first of all),
#: with the names of their values where SQLite answers a number.
CREATION_PRAGMAS = {'page_size': (), 'auto_vacuum': ('none', 'full', 'incremental')}

# Applied before the user's <pragmas>, which may override any of them.
DEFAULT_PRAGMAS = (
    ('journal_mode', 'wal'),
    # FULL: a commit survives a power loss, not just a process crash.
    ('synchronous', 'full'),
    ('foreign_keys', 'off'),
)


def _unwritable(path):
    """Whether the file at ``path`` is there and this process may not
    write it.  Asked without opening it: closing a descriptor of a database
    file drops every POSIX lock this process's SQLite connections hold on
    it.  Asked again when the answer changes under it: another process's
    last connection removes its -wal and -shm files when it closes (CI saw
    one go between an exists() and an access(): "not writable")."""
    for _ in range(3):
        if os.access(path, os.W_OK) or not os.path.exists(path):
            return False
        if not os.access(path, os.W_OK) and os.path.exists(path):
            return True
    return False


def _held_elsewhere(handle, mode):
    """Whether a lock that conflicts with ``mode`` (fcntl.LOCK_SH or
    LOCK_EX) is held on ``handle``'s file through another open file
    description: tried without waiting, and let go at once.  None when
    the try fails otherwise (a closed handle)."""
    try:
        fcntl.flock(handle.fileno(), mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except (OSError, ValueError):
        return None
    fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    return False


def _library_limit(name, default):
    """The library's limit ``name`` (a ``sqlite3.SQLITE_LIMIT_*`` name),
    or ``default`` where it cannot be asked (Python 3.10: no getlimit)."""
    try:
        conn = sqlite3.connect(':memory:')
        try:
            return conn.getlimit(getattr(sqlite3, name))
        finally:
            conn.close()
    except (AttributeError, sqlite3.Error):
        return default


def _variable_limit():
    """How many values one statement may bind (SQLITE_MAX_VARIABLE_NUMBER
    of the library; 32,766 by default since 3.32, 999 before), at most
    32,766."""
    return min(32766, _library_limit(
        'SQLITE_LIMIT_VARIABLE_NUMBER',
        32766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999))


def _length_limit():
    """The longest value a row may hold (SQLITE_MAX_LENGTH of the library:
    1,000,000,000 bytes by default), less room for the row's other
    columns."""
    return _library_limit('SQLITE_LIMIT_LENGTH', 1000000000) - 1024


def _sqlite_temp_dir():
    """The directory SQLite puts its temporary files in on Unix (its
    unixTempFileDir: the first writable directory of these)."""
    for path in (os.environ.get('SQLITE_TMPDIR'), os.environ.get('TMPDIR'),
                 '/var/tmp', '/usr/tmp', '/tmp'):
        if path and os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK):
            return path
    return '.'


class Sqlite3Adapter(Adapter):
    vendor = 'sqlite'
    display_name = 'SQLite'

    @property
    def full_hint(self):
        hint = 'free disk space on the file system of its data-dir'
        if str(self.pragmas.get('temp_store', '')).lower() not in ('2', 'memory'):
            # A helper agent's check: with a small /tmp, a commit of a blob
            # larger than its free space failed naming the data-dir only.
            hint += (", or of the directory SQLite writes its temporary files to "
                     "(%s, the first usable of SQLITE_TMPDIR, TMPDIR, /var/tmp, /usr/tmp, "
                     "/tmp: a commit's blobs and a pack's work tables go through it)"
                     % _sqlite_temp_dir())
        if 'max_page_count' in self.pragmas:
            hint += ', or raise <pragmas> max_page_count (%s)' % self.pragmas['max_page_count']
        return hint
    # SQLite writes a record in about 3 us, so the scan of the fast path
    # weighs more against replaying (see Adapter).
    copy_fast_path_thresholds = dict(Adapter.copy_fast_path_thresholds,
                                     file=2.1, relstorage=90.0)
    placeholder = '?'
    max_in_list = 900
    # The analysis's inserts of references, from a thread that waits for
    # the interpreter lock after each statement (storage/pack.py): fewer,
    # larger statements.  SQLite binds up to 32,766 values since 3.32.
    max_insert_values = _variable_limit()
    max_state_bytes = _length_limit()
    max_state_reason = "SQLite's SQLITE_MAX_LENGTH, less room for the row"
    upload_batch = 1000
    statements_class = sql.SqliteStatements
    temp_table_statements = (sql.TEMP_STORE, sql.TEMP_BLOB_CHUNK)
    # BEGIN IMMEDIATE takes the whole database (see lock_commit).
    pack_lock_is_write_lock = True
    locks_rows = False
    # ... but not pack.sqlite3 unless attached, as only the pack does.
    pack_tables_apart = True

    def __init__(self, data_dir, pragmas=None, options=None, driver=None):
        super().__init__(options)
        if not data_dir:
            raise RelStorageError("The sqlite3 adapter needs a data-dir.")
        self.driver = drivers.select_driver(driver or getattr(self.options, 'driver', 'auto'))
        self.pragmas = dict(DEFAULT_PRAGMAS)
        try:
            self.pragmas.update(check_pragmas(pragmas))
        except ValueError as exc:
            raise RelStorageError(str(exc)) from None
        if getattr(self.options, 'read_only', False):
            # A read-only storage (a zodbconvert source, a dry run's
            # destination) creates nothing: a mistyped path is named, not
            # left behind as a new empty database.
            self.data_dir = os.path.abspath(os.path.expanduser(data_dir))
            if not os.path.isfile(os.path.join(self.data_dir, MAIN_DB)):
                raise RelStorageError(
                    "data-dir %s holds no database (no %s there), and a read-only "
                    "storage creates none" % (self.data_dir, MAIN_DB))
        else:
            self.data_dir = ensure_directory('data-dir', data_dir)
            self._check_writable_files()
        self._reset_oid_state()
        self._waiting_probe = None      # (writers_waiting)
        self._pack_probe = None         # (pack_running)
        self._creation_checked = False
        self._wal_checked_at = time.monotonic()
        self._wal_keeper = None         # (snapshot_ended)
        #: No keeper is started (any more): the adapter is closed, or one
        #: could not start (said once, not tried at every check).
        self._wal_no_keeper = False
        self._wal_retry = None          # (snapshot_ended) (monotonic time, delay)
        self._wal_keeper_lock = threading.Lock()
        self._in_use = self._mark_in_use()

    def _check_writable_files(self):
        """A helper agent's check: with files of the database that this
        process may not write (mode 444, another user's; the -wal and -shm
        that a read-only storage run by another user left), the storage
        opened and read, and every commit failed with SQLite's bare
        "attempt to write a readonly database"."""
        for name in (MAIN_DB, MAIN_DB + '-wal', MAIN_DB + '-shm', OID_DB):
            path = os.path.join(self.data_dir, name)
            if not _unwritable(path):
                continue
            raise RelStorageError(
                "data-dir %s: %s is not writable by this process (uid %d), and a "
                "storage that commits writes it: give every process that uses the "
                "database the same user (SQLite's -wal and -shm files too), or "
                "open it with read-only true to read only"
                % (self.data_dir, name, os.getuid()))

    def _mark_in_use(self):
        """The closing of the lock's file, called by close() or when the
        adapter is collected unclosed (which would otherwise leave an
        unclosed file to the collector); None without one."""
        try:
            handle = open(os.path.join(self.data_dir, IN_USE), 'a+b')
        except OSError:
            return None         # (a read-only data-dir: nobody drops it either)
        fcntl.flock(handle.fileno(), fcntl.LOCK_SH)
        return weakref.finalize(self, handle.close)

    def check_commit_room(self, conn, rows, nbytes):
        # SQLite writes a transaction's pages to the log as its page cache
        # overflows, and the rest at COMMIT, in finish: a file system
        # that cannot take them there fails the finish after every
        # database of the transaction voted (a helper agent's check: the
        # servers committed, SQLite did not).  So the vote makes sure
        # there is room for what can still be in the cache: at most the
        # cache, else a page or three per row (the row, its index entries)
        # and the pages of the states, and a margin (frame headers, the
        # -shm index, the transaction's own row).  An estimate from
        # above: room that fills between vote and finish still fails it.
        settings = conn.session_settings
        if 'cache_bytes' not in settings:
            page = int(conn.query_value('PRAGMA page_size'))
            cache = int(conn.query_value('PRAGMA cache_size'))
            settings['page_size'] = page
            settings['cache_bytes'] = -cache * 1024 if cache < 0 else cache * page
        page = settings['page_size']
        needed = min(settings['cache_bytes'],
                     page * (3 * rows + nbytes // page + 16)) + COMMIT_ROOM_MARGIN
        st = os.statvfs(self.data_dir)
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
        if free < needed:
            raise DatabaseFullError(
                "No room to commit to %s: %d KB free on its file system, and the "
                "commit may need %d KB (nothing was committed)"
                % (self.describe(), free // 1024, needed // 1024))

    def _reset_oid_state(self):
        self._oid_block_size = OID_BLOCK
        self._oid_high = 0          # every OID <= this is already reserved

    def forget_oid_floor(self):
        self._oid_high = 0

    def describe(self):
        return 'SQLite database in %s' % self.data_dir

    def close(self):
        super().close()
        for probe in (self._waiting_probe, self._pack_probe):
            if probe is not None:
                probe.close()
        self._waiting_probe = self._pack_probe = None
        in_use, self._in_use = self._in_use, None
        if in_use is not None:
            in_use()
        with self._wal_keeper_lock:
            keeper, self._wal_keeper = self._wal_keeper, None
            self._wal_no_keeper = True
        if keeper is not None:
            keeper.close()

    def database_identity(self):
        # The main file itself, however the data-dir is spelled or linked.
        found = os.stat(os.path.join(self.data_dir, MAIN_DB))
        return (self.vendor, found.st_dev, found.st_ino, None)

    # --- connections ------------------------------------------------------

    def connect(self, purpose):
        path = os.path.join(self.data_dir, OID_DB if purpose == 'oid' else MAIN_DB)
        if self._forked_in_a_write and purpose != 'load':
            raise RelStorageError(
                "This process was forked while its parent was writing to %s (a "
                "commit in progress): SQLite lets it read that database but never "
                "write there; fork outside of commits" % self.describe())
        timeout = float(self.options.commit_lock_timeout)
        try:
            raw = self.driver.connect(path, timeout=timeout, isolation_level=None,
                                      check_same_thread=False)
        except self.driver.Error as exc:
            raise RelStorageError("Cannot open %s: %s" % (path, exc)) from exc
        try:
            self._set_up(raw, purpose)
        except BaseException as exc:
            raw.close()
            if not isinstance(exc, self.driver.Error) or drivers.classify_error(exc) == 'lock':
                raise
            raise RelStorageError("Cannot open %s: %s%s" % (
                path, exc, self._unwritable_hint())) from exc
        return raw

    def _unwritable_hint(self):
        # A helper agent's check: a read-only storage on a data-dir of a
        # read-only mount (a backup) failed with SQLite's bare "unable to
        # open database file".  Even to read, WAL mode needs the -shm
        # file next to the database.
        if os.access(self.data_dir, os.W_OK):
            return ''
        return (" (%s is not writable: SQLite needs to create its -wal and -shm files "
                "there even to read; copy the directory somewhere writable)" % self.data_dir)

    def _set_up(self, raw, purpose):
        cur = raw.cursor()
        cur.execute('PRAGMA busy_timeout = %d' % self._busy_timeout_ms())
        # (Those SQLite takes only before journal_mode wal and the first
        # table: applied first, they shape a new database.)
        # (page_size before auto_vacuum: after it, SQLite keeps the default.)
        first = list(CREATION_PRAGMAS)
        ordered = sorted(self.pragmas.items(),
                         key=lambda kv: first.index(kv[0]) if kv[0] in first else len(first))
        for key, value in ordered:
            self._apply_pragma(cur, pragma_statement(key, value))
        if purpose == 'oid':
            cur.execute(sql.OID_SCHEMA)
        elif not self._creation_checked:
            self._creation_checked = True
            self._check_creation_pragmas(cur)
        cur.close()

    def _apply_pragma(self, cur, statement):
        """CI's check: one of six processes opening a new data-dir at once
        failed at once with "database is locked".  Turning a new file to
        WAL reads its header, then writes it: two processes that both read
        it cannot both write, and SQLite gives the one that asks second an
        error at once instead of calling the busy handler (its read would
        deadlock the other's write).  The read ends with the error, so
        asking again, briefly later, succeeds once the other has written
        the header; for as long as busy_timeout would have waited."""
        deadline = time.monotonic() + self._busy_timeout_ms() / 1000.0
        while True:
            try:
                cur.execute(statement)
                return
            except sqlite3.OperationalError as exc:
                if drivers.classify_error(exc) != 'lock' or time.monotonic() >= deadline:
                    raise
            time.sleep(random.uniform(0.001, 0.01))

    def _check_creation_pragmas(self, cur):
        """A helper agent's check: page_size and auto_vacuum were accepted
        and silently had no effect.  They shape a new database only: say so
        when the existing one differs."""
        for key, names in CREATION_PRAGMAS.items():
            if key not in self.pragmas:
                continue
            wanted = str(self.pragmas[key]).lower()
            wanted = str(names.index(wanted)) if wanted in names else wanted
            found = str(cur.execute('PRAGMA %s' % key).fetchone()[0])
            if found != wanted:
                log.warning("<pragmas> %s %s of %s applies only to a new database; %s "
                            "has %s (it changes with VACUUM, outside WAL mode)",
                            key, self.pragmas[key], self.describe(), MAIN_DB, found)

    def _busy_timeout_ms(self):
        """How long a statement other than BEGIN IMMEDIATE waits for a lock:
        ``busy_timeout`` from <pragmas>, else commit-lock-timeout."""
        if 'busy_timeout' in self.pragmas:
            return int(self.pragmas['busy_timeout'])
        return int(float(self.options.commit_lock_timeout) * 1000)

    def snapshot_ended(self, conn):
        """Keep the write-ahead log bounded.  A commit's checkpoint copies
        the log into the database file only up to the oldest snapshot, and
        the log starts again from its beginning only when a writer starts
        with every page copied and no snapshot reading the log; a ZODB
        connection polls (takes its next snapshot) right after each commit,
        so with one steady writer that never happened, and the log grew
        without end (a helper agent's check: 470 MB after 4,000 commits of
        10 objects).  So, at most every WAL_CHECK_INTERVAL seconds, where a
        snapshot just ended and the log is past WAL_RESTART_PAGES times
        wal_autocheckpoint pages:

        - the process's WalKeeper is woken: in a thread of its own, it
          copies the log (its sync is no commit's to wait for) and empties
          it if nobody reads it; a snapshot that starts once everything is
          copied lets the next commit start the log again;
        - and if the log is still past its bound the next time, and no
          pack runs, this
          thread empties it here, where its own snapshot just ended (a
          process committing without pause always has one open
          otherwise), copying what the keeper has not (a sync: 15 ms on a
          busy disk).  When that fails (someone else reads the log), the
          next such try waits twice as long (up to WAL_RETRY_MAX): a long
          reader, or a heavy writer elsewhere (a pack's deletion writes
          about 370 MB at a million objects), keeps the log past its
          bound, and this process's commits would pay a sync at every
          try, for nothing (the writer's p99 beside a pack went from 2.7
          to 20 ms).  Meanwhile the keeper copies.  (A helper agent's
          check of a rule that let this thread try only once its process
          had written a share of the log: a writer of small objects let
          it grow to 700 MB, its estimate of what it wrote far below
          the pages it did.)"""
        now = time.monotonic()
        if now < self._wal_checked_at + WAL_CHECK_INTERVAL:
            return
        self._wal_checked_at = now
        try:
            size = os.stat(os.path.join(self.data_dir, MAIN_DB + '-wal')).st_size
        except OSError:
            return
        page = conn.session_settings.get('page_size')
        if page is None:
            page = conn.session_settings['page_size'] = int(conn.query_value('PRAGMA page_size'))
            conn.rollback()
        limit = WAL_RESTART_PAGES * max(1, int(self.pragmas.get('wal_autocheckpoint', 1000)))
        if size <= limit * page:
            self._wal_retry = None
            return
        retry = self._wal_retry
        if retry is None:
            # The keeper copies first.
            self._wal_retry = (now + WAL_CHECK_INTERVAL, WAL_CHECK_INTERVAL)
            self._wake_wal_keeper()
            return
        at, delay = retry
        if now < at or self.pack_running():
            # While a pack runs, the log is past its bound for the whole
            # pack (its analysis's snapshots; its deletion writes about
            # 370 MB at a million objects), and this thread's tries, few
            # as the back-off made them, were the writer's slowest commits
            # (each a sync, or a large log's truncation: 99 ms): the
            # keeper copies meanwhile, and the first try after the pack
            # empties the log.
            self._wake_wal_keeper()
            return
        keeper = self._wal_keeper
        if keeper is not None and keeper.working:
            # Its checkpoint would only make ours give up (one at a time),
            # and count as a failure (a helper agent's check: a writer
            # committing without pause, its tries meeting the keeper's
            # copies, waited longer and longer, and its log grew to
            # 460 MB): the next check tries, the keeper not woken meanwhile.
            return
        raw = conn.raw
        busy = True
        try:
            raw.execute('PRAGMA busy_timeout = 0')
            busy, _, _ = raw.execute('PRAGMA wal_checkpoint(TRUNCATE)').fetchone()
            log.debug("%s the write-ahead log of %s (%d bytes)",
                      'Could not empty (busy)' if busy else 'Emptied', self.describe(), size)
        except sqlite3.Error:
            log.debug("Could not empty the write-ahead log of %s", self.describe(),
                      exc_info=True)
        finally:
            raw.execute('PRAGMA busy_timeout = %d' % self._busy_timeout_ms())
        if busy:
            delay = min(delay * 2, WAL_RETRY_MAX)
            self._wal_retry = (now + delay, delay)
            self._wake_wal_keeper()
        else:
            # Should the log be past its bound again at the next check, it
            # is this process's (the keeper could not empty it): this
            # thread tries again then, the keeper not woken first.
            self._wal_retry = (now + WAL_CHECK_INTERVAL, WAL_CHECK_INTERVAL)

    def set_aside_inherited(self, raw, cursor, purpose):
        # Closed now, before the child opens connections of its own: the
        # file locks SQLite took for it are the parent's (locks are per
        # process), so closing lets go of none of them, nor of the
        # child's; left open, its in-process record of a read lock on the
        # log kept the child's log from starting over (a helper agent's
        # check).  Not one that may be writing (a commit in progress at
        # the fork): closing rolls it back, and the rollback clears the
        # log index entries of its frames in the -shm file, which the
        # parent shares: the parent's commit then corrupted the database
        # (a review finding, for a commit larger than the page cache).
        # Kept open, its record of the write lock keeps the child's own
        # connections from ever writing (a helper agent's check saw them
        # wait commit-lock-timeout, and fail, every time): such a child is
        # refused writes at once (connect).
        if purpose != 'load' and raw.in_transaction:
            self._forked_in_a_write = True
            # Never freed either, not even as the interpreter ends (a
            # helper agent's check: a child's normal exit freed it from
            # connections._INHERITED, freeing closed it, and the parent's
            # database was malformed): a reference nothing drops.
            for obj in (raw, cursor):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
            return True
        for obj in (cursor, raw):
            try:
                obj.close()
            except Exception:  # pylint:disable=broad-except
                log.debug("Closing an inherited SQLite connection", exc_info=True)
        return False

    #: (In a forked child) the parent was writing as it forked: see
    #: set_aside_inherited.
    _forked_in_a_write = False
    child_of_a_writer_may_write = False

    def _make_locks(self):
        super()._make_locks()
        self._wal_keeper_lock = threading.Lock()

    def after_fork_in_child(self):
        super().after_fork_in_child()
        # The parent's keeper thread is not in this process (a new one
        # starts when needed); its lock, made again, may have been held by
        # another thread of the parent as it forked.
        self._wal_keeper = None
        # (Open file descriptions shared with the parent: a lock taken or
        # let go through one is the parent's too.)
        self._pack_probe = self._waiting_probe = None

    def _wake_wal_keeper(self):
        with self._wal_keeper_lock:
            keeper = self._wal_keeper
            if keeper is None or not keeper.alive():
                if self._wal_no_keeper:
                    return
                keeper = self._wal_keeper = self._start_wal_keeper()
                if keeper is None:
                    self._wal_no_keeper = True
                    return
        keeper.wake()

    def _start_wal_keeper(self):
        """A WalKeeper that holds only a weak reference to this adapter
        (a helper agent's check: dropped unclosed, the adapter stayed,
        its files open, and another process's zodbconvert --clear was
        refused as long as this one lived), stopped when the adapter is
        collected; None if no thread can start (a limit on threads, an
        interpreter shutting down: then snapshot_ended's own tries keep
        the log bounded, and the commit that ended its snapshot does
        not fail for it, as it did)."""
        ref = weakref.ref(self)

        def adapter():
            found = ref()
            if found is None:
                raise ReferenceError('the adapter is gone')
            return found
        try:
            keeper = WalKeeper(lambda: adapter().connect('main'),
                               lambda: adapter().describe())
        except Exception:  # pylint:disable=broad-except
            log.warning("Could not start the thread that keeps the write-ahead log of "
                        "%s bounded", self.describe(), exc_info=True)
            return None
        weakref.finalize(self, keeper.stop)
        return keeper

    def start_snapshot(self, conn):
        # A deferred transaction: the snapshot starts at the first read and
        # lasts until rollback, whatever other processes commit meanwhile.
        conn.execute('BEGIN DEFERRED')

    def begin_store(self, conn, writes_data=True, durable=True):
        self._set_commit_durability(conn, writes_data, durable)
        # SQLite's busy handler sleeps longer and longer between tries (up
        # to 100 ms each): a waiting commit or pack batch sleeps on long
        # after a short holder is done, and a process that commits
        # steadily keeps winning the lock from one that sleeps (a pack's
        # batches never got it under a live writer).  So the wait is ours,
        # in steps of at most WRITE_WAIT_MAX, bounded by
        # commit-lock-timeout; the busy handler still serves every other
        # statement.
        raw = conn.raw
        timeout = float(self.options.commit_lock_timeout)
        raw.execute('PRAGMA busy_timeout = 0')
        waiting = None
        try:
            deadline = None
            delay = WRITE_WAIT_FIRST
            while True:
                try:
                    conn.execute('BEGIN IMMEDIATE')
                    return
                except Exception as exc:
                    if self.classify_error(exc) != 'lock':
                        raise
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + timeout
                    elif now >= deadline:
                        raise
                    if waiting is None:
                        waiting = self._announce_waiting()
                    time.sleep(min(delay, max(deadline - now, 0)))
                    delay = min(delay * 2, WRITE_WAIT_MAX)
        finally:
            if waiting is not None:
                waiting.close()
            raw.execute('PRAGMA busy_timeout = %d' % self._busy_timeout_ms())

    def _open_waiting_file(self):
        path = os.path.join(self.data_dir, WRITERS_WAITING)
        try:
            return open(path, 'a+b')
        except OSError:
            # (Made by another user, say: a lock needs it open only.)
            try:
                return open(path, 'rb')
            except OSError:
                return None

    def _announce_waiting(self):
        """A file whose shared lock says a write transaction waits, until
        it is closed (or the process ends); None if that cannot be (the
        caller tries again at its next step)."""
        handle = self._open_waiting_file()
        if handle is None:
            return None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            # (The pack looking, for a few microseconds.)
            handle.close()
            return None
        return handle

    def writers_waiting(self):
        # Between the deletion batches of a pack, which hold the write lock
        # every commit needs: a waiting commit asks for it every
        # WRITE_WAIT_MAX at most, so the pack lets it pass (WRITERS_TURN)
        # when one waits, and only then.
        handle = self._waiting_probe
        if handle is None:
            handle = self._open_waiting_file()
            if handle is None:
                return True
            self._waiting_probe = handle
        # (Unknown, the handle closed by the adapter's close(): as if one
        # waited.)
        return _held_elsewhere(handle, fcntl.LOCK_EX) is not False

    def _set_commit_durability(self, conn, writes_data, durable=True):
        # A history-free commit that writes no object only publishes a new
        # last tid, and the fsync of its COMMIT (synchronous FULL) is then
        # nearly all of its cost (about 0.2 of 0.25 ms).  In WAL mode,
        # NORMAL loses nothing when a process dies, only on power loss or
        # an OS crash, which ends every process on this host too (SQLite
        # is shared only between processes of one host): nobody is left to
        # remember the tid, and nothing was stored under it.  The next
        # commit that writes data syncs the WAL, with it, at FULL again.
        # History-preserving databases keep the transaction's record (its
        # user and description), so they stay at the configured level, as
        # does a configuration asking for more (EXTRA) or less than FULL.
        # Only in WAL mode: with a rollback journal, NORMAL may corrupt the
        # database on power loss.  ``durable`` false (a pack's deletion
        # batch): a power cut may undo the last such commits, which brings
        # back garbage and old revisions, nobody's data; the references
        # of what they removed leave pack.sqlite3 only once they are on
        # disk (sync_deleted).  A batch holds the lock every commit waits
        # for through its COMMIT (a 1,000,000-object pack held it 2.2 s in
        # 1,757 batches, against 2.9 s in 1,895 with FULL).
        relax = ((not durable or (not writes_data and not self.keep_history))
                 and self._in_wal_mode(conn)
                 and self.pragmas.get('synchronous', '').lower() in ('full', '2'))
        relaxed = conn.session_settings.get('synchronous') == 'normal'
        if relax != relaxed:
            value = 'normal' if relax else self.pragmas['synchronous']
            # Not inside a transaction: SQLite refuses to change it there.
            conn.raw.execute('PRAGMA synchronous = %s' % value)
            conn.session_settings['synchronous'] = 'normal' if relax else None
        # Nor does a pack's batch run the automatic checkpoint, which
        # copies the write-ahead log into the database file and syncs it
        # while every commit waits (110 ms seen): the pack checkpoints
        # between its batches (forget_deleted).
        if durable == bool(conn.session_settings.get('no_autocheckpoint')):
            conn.raw.execute('PRAGMA wal_autocheckpoint = %d' % (
                int(self.pragmas.get('wal_autocheckpoint', 1000)) if durable else 0))
            conn.session_settings['no_autocheckpoint'] = not durable

    def _in_wal_mode(self, conn):
        """Is main.sqlite3 in WAL mode on ``conn`` (as configured, and as
        SQLite could make it)?"""
        mode = conn.session_settings.get('journal_mode')
        if mode is None:
            mode = str(conn.query_value('PRAGMA main.journal_mode')).lower()
            conn.session_settings['journal_mode'] = mode
        return mode == 'wal' and self.pragmas.get('journal_mode', '').lower() == 'wal'

    def list_tables(self, conn):
        rows = conn.query_all("SELECT name FROM sqlite_master WHERE type = 'table'")
        return {row[0].lower() for row in rows}

    def earlier_leftovers(self, conn):
        rows = conn.query_all("SELECT name FROM sqlite_master WHERE type = 'view' ORDER BY 1")
        return [('view %s' % name, 'DROP VIEW "%s";' % name)
                for (name,) in rows if name.lower() in self.EARLIER_VIEWS]

    def begin_schema_creation(self, conn):
        # (A helper agent's check: processes starting at once on a new
        # data-dir saw each other's half-made schema: "table commit_lock
        # already exists", or a history-preserving one taken for a
        # history-free one, as object_state came before current_object.)
        # DDL is transactional here: all of it, or none, under the lock.
        conn.execute('BEGIN IMMEDIATE')
        return True

    def schema_statements(self):
        return sql.HISTORY_PRESERVING_SCHEMA if self.keep_history else sql.HISTORY_FREE_SCHEMA

    def classify_error(self, exc):
        return drivers.classify_error(exc)

    # --- OIDs -----------------------------------------------------------------

    def allocate_oid_block(self, conn):
        size = self._oid_block_size
        conn.execute('BEGIN IMMEDIATE')
        try:
            row = conn.query_one('SELECT next_oid FROM oid_counter WHERE id = 0')
            first = row[0] if row else self._highest_stored_oid() + 1
            if row is None:
                conn.execute('INSERT INTO oid_counter (id, next_oid) VALUES (0, ?)',
                             (first + size,))
            else:
                conn.execute('UPDATE oid_counter SET next_oid = ? WHERE id = 0',
                             (first + size,))
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        self._oid_block_size = min(size * 2, OID_BLOCK_MAX)
        self._oid_high = max(self._oid_high, first + size - 1)
        return list(range(first, first + size))

    def _highest_stored_oid(self):
        """The highest OID of ``main.sqlite3`` (0 when empty), read on a
        load session of its own.  For a counter that starts: a helper
        agent's check restored ``main.sqlite3`` without its ``oids.sqlite3``,
        and the new counter handed out OIDs from 1, each of which failed its
        commit (39 in a row on a 505-object database).  (Not another
        connection to the file, opened and closed here: closing a file's
        descriptor drops every lock the process holds on it.)"""
        pool = self.load_sessions
        conn = pool.take()
        try:
            if not conn.query_value("SELECT COUNT(*) FROM sqlite_master "
                                    "WHERE type = 'table' AND name = 'object_state'"):
                return 0        # (an adapter used before its schema is made)
            return conn.query_value('SELECT MAX(zoid) FROM object_state') or 0
        finally:
            conn.rollback()
            pool.give_back(conn)

    def raise_oid_floor(self, conn, max_oid):
        # The usual commit stores only OIDs this process reserved: the
        # counter is already past them, no need to take its lock.
        if max_oid <= self._oid_high:
            return
        conn.execute('BEGIN IMMEDIATE')
        try:
            row = conn.query_one('SELECT next_oid FROM oid_counter WHERE id = 0')
            if row is None:
                # (A counter that starts, as in allocate_oid_block: a copy's
                # first commit may store fewer OIDs than the data has.)
                conn.execute('INSERT INTO oid_counter (id, next_oid) VALUES (0, ?)',
                             (max(max_oid, self._highest_stored_oid()) + 1,))
            elif row[0] <= max_oid:
                conn.execute('UPDATE oid_counter SET next_oid = ? WHERE id = 0',
                             (max_oid + 1,))
            conn.commit()
            self._oid_high = max(self._oid_high, max_oid)
        except BaseException:
            conn.rollback()
            raise

    # --- locks ------------------------------------------------------------------

    def lock_objects(self, conn, oids, read_current_oids):
        # BEGIN IMMEDIATE already holds the whole database (locks_rows).
        pass

    def lock_commit(self, conn):
        return self.get_last_tid(conn)

    # --- pack ------------------------------------------------------------------

    def pack_schema(self):
        return sql.PACK_MAIN_SCHEMA + sql.PACK_APART_SCHEMA

    def open_pack(self):
        """A store connection with ``pack.sqlite3`` attached as ``pack``.
        Only the pack's connection attaches it: a commit's BEGIN
        IMMEDIATE takes the lock of every attached file."""
        conn = self.open_store()
        try:
            conn.execute('ATTACH DATABASE ? AS pack', (os.path.join(self.data_dir, PACK_DB),))
            conn.raw.execute('PRAGMA pack.journal_mode = wal').fetchall()
            # Everything in this file only lets a later pack skip work
            # (references already read, a pre-pack's candidates, the last
            # pack's time), and is used only with the main file it was
            # made with (pair_pack_tables): a suffix of its commits lost
            # in a power cut is work done again, never a wrong deletion.
            # A deletion batch commits in the main file first, then here
            # (forget_deleted): a crash between leaves rows about objects
            # already gone, which no join of the pack follows (OIDs are
            # never reused, revisions are joined by their tid).
            conn.raw.execute('PRAGMA pack.synchronous = normal')
            self._move_pack_tables_apart(conn)
            existing = self.list_tables(conn)
            missing = [stmt for stmt in sql.PACK_MAIN_SCHEMA
                       if _created_table(stmt) not in existing]
            if missing:
                # The main file's, under its write lock (a commit's):
                # UnableToAcquireCommitLockError while commits keep it,
                # which the pack waits out (a helper agent's check: the
                # first pack of a busy site failed with "database is
                # locked").
                self.begin_store_checked(conn, writes_data=False)
                for stmt in missing:
                    conn.execute(stmt)
                conn.commit()
            for stmt in sql.PACK_APART_SCHEMA:
                conn.execute(stmt)
            for stmt in self.pack_temp_tables().values():
                conn.execute(stmt)
            conn.commit()
            self._check_pairing(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _move_pack_tables_apart(self, conn):
        """Databases packed before the pack's tables had a file of their
        own keep them in the main file, where they would hide the new
        ones (SQLite looks in main first): copy them over, then remove
        them.  Only a pack writes them and the pack lock is ours, so the
        copy runs without the main file's lock; one interrupted is done
        again (the main file still has the tables).  Their rows go in
        short write transactions before the tables are dropped: dropping
        a table frees all its pages under the lock commits wait for."""
        legacy = [t for t in sql.PACK_APART_TABLES if t in self.list_tables(conn)]
        if not legacy:
            return
        log.info("Moving the pack's tables of %s to %s", self.describe(), PACK_DB)
        for stmt in sql.PACK_APART_SCHEMA:
            conn.execute(stmt)
        conn.execute('BEGIN DEFERRED')
        for table in sql.PACK_APART_TABLES:
            conn.execute('DELETE FROM pack.%s' % table)
            if table in legacy:
                conn.execute('INSERT INTO pack.%s SELECT * FROM main.%s' % (table, table))
        conn.commit()
        for table in legacy:
            if table != 'pack_info':        # (a few rows, without zoid)
                self._delete_legacy_rows(conn, table)
            self.begin_store_checked(conn)
            conn.execute('DROP TABLE main.%s' % table)
            conn.commit()

    def _delete_legacy_rows(self, conn, table):
        """Empty main's ``table`` LEGACY_DELETE_ROWS rows (by zoid) per
        write transaction, leaving commits a turn between them."""
        while True:
            self.begin_store_checked(conn)
            upto = conn.query_value(
                'SELECT MAX(zoid) FROM (SELECT zoid FROM main.%s ORDER BY zoid LIMIT %d)'
                % (table, LEGACY_DELETE_ROWS))
            if upto is None:
                conn.commit()
                return
            conn.execute('DELETE FROM main.%s WHERE zoid <= ?' % table, (upto,))
            conn.commit()
            time.sleep(WRITE_WAIT_MAX * 2)

    def deleted_sync(self, conn):
        # The batches committed at synchronous NORMAL are in main's
        # write-ahead log, written but maybe not on disk: its fsync puts
        # them there (as a FULL commit's would).  A log that a checkpoint
        # has emptied since was synced before it, and the database file
        # after.  Not in WAL mode, the batches were FULL.  SQLite keeps
        # the log beside the file a symbolic link names.
        if not self._in_wal_mode(conn):
            return None
        path = os.path.realpath(os.path.join(self.data_dir, MAIN_DB)) + '-wal'
        full = pragma_is_on(self.pragmas.get('fullfsync')) and hasattr(fcntl, 'F_FULLFSYNC')
        return lambda: self._sync_file(path, full)

    def _sync_file(self, path, full):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            # (The pack's connection keeps it open: it must be there.)
            raise RelStorageError("Cannot sync the write-ahead log of %s (%s): %s"
                                  % (self.describe(), path, exc)) from exc
        try:
            if full:
                fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            else:
                os.fsync(fd)
        finally:
            os.close(fd)

    def forget_deleted(self, conn, upto_oid, final=False):
        forgot = super().forget_deleted(conn, upto_oid, final)
        # The batches' pages pile up in main's WAL, and the commit that
        # passes wal_autocheckpoint would copy them into the database file
        # and sync it: a commit of the site (the batches do not: see
        # _set_commit_durability).  The pack does it itself, each time it
        # has just synced the log (FORGET_EVERY), where it holds no lock
        # (PASSIVE: it waits for nobody and nobody waits for it), for
        # pack.sqlite3 too.
        if forgot:
            conn.raw.execute('PRAGMA wal_checkpoint(PASSIVE)').fetchall()
        return forgot

    def pair_pack_tables(self, conn):
        # pack.sqlite3 holds what the analyses found in the main file; a
        # main file restored from a backup (alone) may no longer have
        # what they read, and references recorded from revisions it lost
        # would make a pack remove what its own revisions reference.  So
        # each analysis, once its snapshot is taken, writes a new token
        # in the main file, then in pack.sqlite3: a main file holding the
        # token holds everything up to that snapshot, and open_pack
        # forgets a pack.sqlite3 whose token is not the main file's.
        token = random.SystemRandom().getrandbits(62) + 1
        self.begin_store_checked(conn)
        conn.execute('DELETE FROM pack_pairing')
        conn.execute('INSERT INTO pack_pairing (id, token) VALUES (0, ?)', (token,))
        conn.commit()
        self.begin_pack_write(conn)
        self.set_pack_info(conn, pairing=token)
        conn.commit()

    def _check_pairing(self, conn):
        main = conn.query_value('SELECT token FROM pack_pairing WHERE id = 0')
        info = self.pack_info(conn)
        conn.rollback()
        if info.get('pairing') == main:
            return
        if not info and conn.query_one('SELECT zoid FROM object_ref LIMIT 1') is None:
            conn.rollback()
            return
        log.warning("%s was not made with the main database file of %s as it is now "
                    "(restored from a backup?): the pack forgets what it recorded there "
                    "and analyses every revision again.", PACK_DB, self.describe())
        self.begin_pack_write(conn)
        for table in sql.PACK_APART_TABLES:
            conn.execute('DELETE FROM %s' % table)
        conn.commit()

    def begin_pack_write(self, conn):
        # Only pack.sqlite3 is written: a deferred transaction takes that
        # file's lock at its first write, and never the main file's.
        conn.execute('BEGIN DEFERRED')

    def pack_temp_tables(self):
        return sql.PACK_TEMP_TABLES

    def acquire_pack_lock(self):
        # An advisory lock on a file beside the database, released by the
        # system when the process ends, however it ends.  Asked a few
        # times over PACK_LOCK_PATIENCE: pack_running holds a shared lock
        # on the file for a few microseconds.
        handle = open(os.path.join(self.data_dir, PACK_LOCK), 'a+b')
        deadline = time.monotonic() + PACK_LOCK_PATIENCE
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return PackLock(handle)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.close()
                    return None
                time.sleep(0.002)

    def pack_running(self):
        """Whether a pack holds the pack lock of this data-dir now (a
        shared lock tried and let go at once; see acquire_pack_lock)."""
        handle = self._pack_probe
        if handle is None:
            try:
                handle = self._pack_probe = open(os.path.join(self.data_dir, PACK_LOCK), 'a+b')
            except OSError:
                return False
            # (Closed with an adapter collected unclosed, too.)
            weakref.finalize(self, handle.close)
        return _held_elsewhere(handle, fcntl.LOCK_SH) is True

    # --- maintenance --------------------------------------------------------

    def zap_all(self):
        # The pack's file first: a zap interrupted after it leaves a pack
        # with nothing recorded (it analyses everything), never a record
        # of a pack that says the emptied database needs none.
        self._clear_pack_db()
        return super().zap_all()

    def _clear_pack_db(self):
        path = os.path.join(self.data_dir, PACK_DB)
        if not os.path.exists(path):
            return
        raw = self.driver.connect(path, timeout=float(self.options.commit_lock_timeout),
                                  isolation_level=None)
        try:
            raw.execute('BEGIN IMMEDIATE')
            tables = {row[0] for row in raw.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            for table in sql.PACK_APART_TABLES:
                if table in tables:
                    raw.execute('DELETE FROM %s' % table)
            raw.execute('COMMIT')
        finally:
            raw.close()

    def drop_all(self):
        # The files go (a new database starts its counters and its key
        # again), which only a data-dir nobody else has open allows: a
        # helper agent's check found the processes that had it open
        # committing on into the removed files, told their commits
        # succeeded, seen by nobody else (zodbconvert --clear under a
        # running site).
        self.close()
        with open(os.path.join(self.data_dir, IN_USE), 'a+b') as lock:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RelStorageError(
                    "Cannot remove %s: other storages (processes) have it open; close "
                    "them first" % self.describe()) from None
            with self._oid_lock:
                self._oid_block = []
                self._reset_oid_state()
            for name in (MAIN_DB, OID_DB, PACK_DB, PACK_LOCK):
                for suffix in ('', '-wal', '-shm', '-journal'):
                    path = os.path.join(self.data_dir, name + suffix)
                    if os.path.exists(path):
                        os.remove(path)


def _created_table(stmt):
    """The name of the table a CREATE TABLE statement makes."""
    words = stmt.split('(', 1)[0].split()
    return words[-1].split('.')[-1].lower()
