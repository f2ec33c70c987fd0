"""The shared suite on PostgreSQL, once per driver, plus PostgreSQL cases.

The server is reached with RS_PG_DSN (a libpq DSN of a user allowed to
create databases; default ``host=127.0.0.1 user=postgres``).  The tests
create their own databases, named ``relstoragetest_<driver>_<pid>...``, and
drop them when the process exits.  An unreachable server fails the run: set
RS_TEST_DATABASES without 'postgresql' to leave PostgreSQL out on purpose.
"""
import atexit
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest
from unittest import mock

import transaction
import ZODB
from persistent.mapping import PersistentMapping
from ZODB.blob import Blob
from ZODB.POSException import ConflictError
from ZODB.POSException import ReadConflictError
from ZODB.tests.MinPO import MinPO
from ZODB.tests.StorageTestBase import zodb_pickle
from ZODB.tests.StorageTestBase import zodb_unpickle
from ZODB.Connection import TransactionMetaData
from ZODB.utils import p64
from ZODB.utils import u64
from ZODB.utils import z64

from relstorage.adapters.postgresql import drivers
from relstorage.adapters.postgresql import sql as pg_sql
from relstorage.adapters.postgresql.adapter import PostgreSQLAdapter
from relstorage.interfaces import CommitFailedError
from relstorage.interfaces import DisconnectedError
from relstorage.interfaces import RelStorageError
from relstorage.interfaces import UnableToAcquireCommitLockError
from relstorage.interfaces import UnableToLockRowsError
from relstorage.options import Options
from relstorage.storage import RelStorage

from . import suite
from .blob_cases import MB
from .blob_cases import BlobCase
from .core_cases import FactoryCase
from .core_cases import begin_store
from .core_cases import check_every_idle_session_ended
from .core_cases import make_objects
from .core_cases import refused_commit
from .core_cases import vote_behind
from .privilege_cases import PackPrivilegeCases

DRIVERS = ('psycopg', 'psycopg2')


def base_dsn():
    return os.environ.get('RS_PG_DSN', 'host=127.0.0.1 user=postgres')


def _test_session_options():
    """Sessions of the test databases skip waiting for the WAL flush at
    commit (synchronous_commit off): durability across a server crash is
    PostgreSQL's business, not what this suite checks, and the suite runs
    several times faster.  Not applied when RS_PG_DSN sets options itself."""
    driver = drivers.select_driver('auto')
    if driver.parse_dsn(base_dsn()).get('options'):
        return {}
    return {'options': '-c synchronous_commit=off'}


def _dsn_with(dsn, **params):
    driver = drivers.select_driver('auto')
    values = dict(driver.parse_dsn(dsn))
    values.update(params)
    return driver.make_dsn(values)


class _Admin:
    """Autocommit connection to the maintenance database, for DDL on databases."""

    _conn = None
    _failure = None

    def conn(self):
        if self._failure is not None:
            # Every test fails, loudly, but only the first waits for the
            # connect timeout.
            raise AssertionError(self._failure)
        if self._conn is None or self._conn.closed:
            driver = drivers.select_driver('auto')
            try:
                self._conn = driver.connect(
                    _dsn_with(base_dsn(), dbname='postgres', connect_timeout='10'), 'oid')
            except driver.Error as exc:
                self._failure = (
                    "The PostgreSQL test server is not reachable with RS_PG_DSN (%s): %s. "
                    "Start it (pg_ctlcluster ... start), or set RS_TEST_DATABASES "
                    "without postgresql to leave it out."
                    % (_redact(base_dsn()), str(exc).strip().splitlines()[0]))
                raise AssertionError(self._failure) from None
        return self._conn

    def execute(self, stmt, params=None):
        cur = self.conn().cursor()
        try:
            cur.execute(stmt, params)
            return cur.fetchall() if cur.description else None
        finally:
            cur.close()

    def ensure_database(self, name):
        if not self.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)):
            self.execute('CREATE DATABASE "%s"' % name)
        _created.add(name)

    def terminate(self, dbname):
        """Cut every session on ``dbname`` (but ours): leftovers of earlier
        tests, or the victims of a disconnect test."""
        return self.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,))

    def close(self):
        if self._conn is not None:
            self._conn.close()
            self._conn = None


ADMIN = _Admin()
_created = set()
_TEST_SESSION = _test_session_options()


def _drop_created():
    try:
        for name in sorted(_created):
            ADMIN.execute('DROP DATABASE IF EXISTS "%s" WITH (FORCE)' % name)
        ADMIN.close()
    except Exception:  # pylint:disable=broad-except
        pass


atexit.register(_drop_created)


def _redact(dsn):
    return re.sub(r"password\s*=\s*('[^']*'|\S+)", 'password=***', dsn)


class PostgreSQLFactory(suite.NamedDatabases):
    """One test database per factory; ``fresh`` empties it."""

    big_blob_test = False

    def __init__(self, driver, suffix=''):
        self.driver = driver
        self.name = 'postgresql-' + driver
        self.dbname = 'relstoragetest_%s_%d%s' % (driver, os.getpid(), suffix)
        self.dsn = _dsn_with(base_dsn(), dbname=self.dbname, **_TEST_SESSION)
        self._sibling = None
        self._named = {}
        self._fresh_in = None

    def fresh(self, keep_history):
        ADMIN.ensure_database(self.dbname)
        ADMIN.terminate(self.dbname)
        self.make_adapter(Options(keep_history=keep_history)).drop_all()

    def make_adapter(self, options):
        return PostgreSQLAdapter(dsn=self.dsn, options=options, driver=self.driver)

    def sibling(self):
        if self._sibling is None:
            self._sibling = PostgreSQLFactory(self.driver, '_dst')
        return self._sibling

    def make_named(self, key):
        return PostgreSQLFactory(self.driver, '_n_' + key)

    def zconfig_adapter(self):
        """The adapter section of a ZConfig file for this database."""
        return '<postgresql>\n  dsn %s\n  driver %s\n</postgresql>\n' % (self.dsn, self.driver)

    def write_subprocess_factory(self, directory, keep_history):
        with open(os.path.join(directory, 'factory_for_subprocess.py'), 'w') as f:
            f.write(SUBPROCESS_FACTORY % (keep_history, self.dsn, self.driver))
        return directory

    def open_transactions(self):
        """The client sessions on our database (but ours) inside a
        transaction or holding a snapshot (backend_xmin holds back VACUUM)."""
        return ADMIN.execute(
            "SELECT pid, state, now() - xact_start, backend_xmin, query "
            "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend' "
            "AND (xact_start IS NOT NULL OR backend_xmin IS NOT NULL)", (self.dbname,))

    def server_session_count(self):
        return ADMIN.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
            (self.dbname,))[0][0]

    def kill_server_sessions(self):
        ADMIN.terminate(self.dbname)

    def cleanup(self):
        pass


SUBPROCESS_FACTORY = """
from relstorage.adapters.postgresql.adapter import PostgreSQLAdapter
KEEP_HISTORY = %r
DSN = %r
DRIVER = %r
def make_adapter(options):
    return PostgreSQLAdapter(dsn=DSN, options=options, driver=DRIVER)
"""


# ----------------------------------------------------------------------
# PostgreSQL cases (run once per driver by make_suite).

class PGCase(FactoryCase):

    def db(self, **kw):
        storage = self.storage(**kw)
        db = ZODB.DB(storage)
        self.addCleanup(db.close)
        return db

    def backends(self):
        """(pid, state) of the sessions on the test database but ours."""
        return ADMIN.execute(
            "SELECT pid, state FROM pg_stat_activity WHERE datname = %s "
            "AND pid <> pg_backend_pid()", (self.factory.dbname,))

    def row_locks_held(self):
        return ADMIN.execute(
            "SELECT l.pid, l.locktype, l.mode FROM pg_locks l "
            "JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE a.datname = %s AND l.granted AND l.locktype IN ('tuple', 'transactionid') "
            "AND l.mode NOT IN ('ExclusiveLock') ", (self.factory.dbname,))

    def idle_in_transaction(self):
        return [pid for pid, state in self.backends()
                if state and state.startswith('idle in transaction')]

    make_objects = staticmethod(make_objects)

    begin_store = staticmethod(begin_store)


class ParallelVoteTests(PGCase):

    def test_disjoint_commits_vote_in_parallel(self):
        a = self.storage(commit_lock_timeout=5)
        b = self.storage(commit_lock_timeout=5)
        (x, y), tid0 = self.make_objects(a, 2)
        b.poll_invalidations()
        ta = self.begin_store(a, x, tid0, 'a')
        tb = self.begin_store(b, y, tid0, 'b')
        new_a, new_b = a.new_oid(), b.new_oid()
        a.store(new_a, z64, zodb_pickle(MinPO('new a')), '', ta)
        b.store(new_b, z64, zodb_pickle(MinPO('new b')), '', tb)
        a.tpc_vote(ta)
        # A holds the commit lock from its vote to its finish; B uploads and
        # locks its disjoint rows meanwhile, then waits for that lock only.
        tid_a, tid_b = vote_behind(self, a, ta, b, tb)
        self.assertLess(tid_a, tid_b)
        c = self.storage()
        self.assertEqual(zodb_unpickle(c.load(x)[0]).value, 'a')
        self.assertEqual(zodb_unpickle(c.load(y)[0]).value, 'b')
        self.assertEqual(c.load(new_b)[1], tid_b)
        self.assertEqual(c.lastTransaction(), tid_b)


class ParallelVoteTestsHF(ParallelVoteTests):
    keep_history = False


class LockTimeoutTests(PGCase):

    def test_row_lock_timeout_is_a_retryable_conflict(self):
        a = self.storage()
        b = self.storage(commit_lock_timeout=2)
        (x,), tid0 = self.make_objects(a, 1)
        ta = self.begin_store(a, x, tid0, 'a')
        a.tpc_vote(ta)
        tb = self.begin_store(b, x, tid0, 'b')
        started = time.time()
        with self.assertRaises(UnableToLockRowsError) as cm:
            b.tpc_vote(tb)
        elapsed = time.time() - started
        # (B's store session goes back to the pool with the abort.)
        b_pid = b._store_conn.raw.info.backend_pid if self.factory.driver == 'psycopg' \
            else b._store_conn.raw.get_backend_pid()
        b.tpc_abort(tb)
        self.assertTrue(1.5 <= elapsed < 6, elapsed)
        self.assertIsInstance(cm.exception, ConflictError)
        self.assertIn('0x%x' % int.from_bytes(x, 'big'), str(cm.exception))
        # (Naming the database: a helper agent's check.)
        self.assertIn(b._adapter.describe(), str(cm.exception))
        # B rolled back: it holds nothing and is not stuck in a transaction.
        self.assertNotIn(b_pid, self.idle_in_transaction())
        tid_a = a.tpc_finish(ta)
        # Nothing is left locked: B can commit the same object right away.
        b.poll_invalidations()
        tb = self.begin_store(b, x, tid_a, 'b again')
        started = time.time()
        b.tpc_vote(tb)
        b.tpc_finish(tb)
        self.assertLess(time.time() - started, 1.5)
        self.assertEqual(self.idle_in_transaction(), [])

    def test_commit_lock_timeout(self):
        a = self.storage(commit_lock_timeout=2)
        (x,), tid0 = self.make_objects(a, 1)
        # Somebody else holds the commit lock.
        holder = drivers.select_driver(self.factory.driver).connect(self.factory.dsn, 'store')
        try:
            holder.cursor().execute("SELECT tid FROM commit_lock WHERE id = 0 FOR UPDATE")
            ta = self.begin_store(a, x, tid0, 'a')
            started = time.time()
            # In vote: once vote has returned, finish must not fail.
            with self.assertRaises(UnableToAcquireCommitLockError) as cm:
                a.tpc_vote(ta)
            self.assertTrue(1.5 <= time.time() - started < 6)
            a.tpc_abort(ta)
            self.assertIsInstance(cm.exception, ConflictError)
            self.assertIn(a._adapter.describe(), str(cm.exception))
        finally:
            holder.rollback()
            holder.close()
        self.assertEqual(self.idle_in_transaction(), [])
        a.poll_invalidations()
        ta = self.begin_store(a, x, tid0, 'a again')
        a.tpc_vote(ta)
        a.tpc_finish(ta)
        self.assertEqual(zodb_unpickle(a.load(x)[0]).value, 'a again')


class LockTimeoutTestsHF(LockTimeoutTests):
    keep_history = False


INCREMENT_WORKER = r'''
import sys, transaction, ZODB
from ZODB.POSException import ConflictError
from relstorage.options import Options
from relstorage.storage import RelStorage
sys.path.insert(0, sys.argv[1])
import factory_for_subprocess as f
rounds = int(sys.argv[2])
options = Options(keep_history=f.KEEP_HISTORY, commit_lock_timeout=30)
db = ZODB.DB(RelStorage(f.make_adapter(options), options=options))
tm = transaction.TransactionManager()
conn = db.open(tm)
retries = 0
def attempt(change):
    global retries
    for _ in range(1000):
        try:
            tm.begin()
            change(conn.root())
            tm.commit()
            return
        except ConflictError:
            tm.abort()
            retries += 1
    raise AssertionError('gave up after 1000 conflicts')
def bump(root):
    root['counter'].value += 1
def grow(root):
    root['length'].change(1)
for i in range(rounds):
    attempt(grow)
    attempt(bump)
conn.close()
db.close()
print('retries=%d' % retries)
'''


class ConcurrentIncrementTests(PGCase):
    """4 processes x 200 increments, in one history mode per driver (the
    storage code is the same in both; the run is long): history-preserving
    with psycopg, history-free with psycopg2."""
    processes = 4
    rounds = 200

    def setUp(self):
        self.keep_history = (self.factory.driver == 'psycopg')
        super().setUp()

    def test_processes_increment_exactly(self):
        from BTrees.Length import Length
        db = self.db()
        with db.transaction() as conn:
            conn.root()['length'] = Length()
            conn.root()['counter'] = MinPO(0)
        tmp = self._tmpdir()
        self.factory.write_subprocess_factory(tmp, self.keep_history)
        started = time.time()
        procs = [subprocess.Popen([sys.executable, '-c', INCREMENT_WORKER, tmp,
                                   str(self.rounds)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(self.processes)]
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            self.assertEqual(proc.returncode, 0, err.decode()[-3000:])
            outputs.append(out.decode().strip())
        elapsed = time.time() - started
        with db.transaction() as conn:
            self.assertEqual(conn.root()['length'](), self.processes * self.rounds)
            self.assertEqual(conn.root()['counter'].value, self.processes * self.rounds)
        self.assertLess(elapsed, 90, outputs)

    def _tmpdir(self):
        import shutil
        import tempfile
        tmp = tempfile.mkdtemp(prefix='relstoragetest_pg_')
        self.addCleanup(shutil.rmtree, tmp, True)
        return tmp


KILLED_CLIENT = r'''
import os, signal, sys, transaction
from ZODB.Connection import TransactionMetaData
from ZODB.tests.MinPO import MinPO
from ZODB.tests.StorageTestBase import zodb_pickle
from ZODB.utils import p64
from relstorage.options import Options
from relstorage.storage import RelStorage
sys.path.insert(0, sys.argv[1])
import factory_for_subprocess as f
oid, serial = p64(int(sys.argv[2])), p64(int(sys.argv[3]))
options = Options(keep_history=f.KEEP_HISTORY)
storage = RelStorage(f.make_adapter(options), options=options)
txn = TransactionMetaData()
storage.tpc_begin(txn)
storage.store(oid, serial, zodb_pickle(MinPO('killed')), '', txn)
new = storage.new_oid()
storage.store(new, b'\0' * 8, zodb_pickle(MinPO('killed new')), '', txn)
storage.tpc_vote(txn)
print(int.from_bytes(new, 'big'), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
'''


class KilledClientTests(PGCase):

    def test_client_killed_between_vote_and_finish(self):
        import shutil
        import tempfile
        from ZODB.POSException import POSKeyError
        from ZODB.utils import p64
        storage = self.storage(commit_lock_timeout=5)
        (x,), tid0 = self.make_objects(storage, 1)
        tmp = tempfile.mkdtemp(prefix='relstoragetest_pg_')
        self.addCleanup(shutil.rmtree, tmp, True)
        self.factory.write_subprocess_factory(tmp, self.keep_history)
        proc = subprocess.run(
            [sys.executable, '-c', KILLED_CLIENT, tmp, str(int.from_bytes(x, 'big')),
             str(int.from_bytes(tid0, 'big'))], capture_output=True, timeout=60)
        self.assertEqual(proc.returncode, -signal.SIGKILL, proc.stderr.decode())
        new_oid = p64(int(proc.stdout.decode().split()[0]))
        # The server notices the closed socket and rolls the session back;
        # give it a moment to do so.
        deadline = time.time() + 5
        while self.idle_in_transaction() and time.time() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.idle_in_transaction(), [])
        storage.poll_invalidations()
        # Nothing of the killed transaction is visible...
        self.assertEqual(storage.load(x)[1], tid0)
        self.assertEqual(storage.lastTransaction(), tid0)
        with self.assertRaises(POSKeyError):
            storage.load(new_oid)
        # ...and nothing stays locked: we commit the same object at once.
        started = time.time()
        txn = self.begin_store(storage, x, tid0, 'survivor')
        storage.tpc_vote(txn)
        tid1 = storage.tpc_finish(txn)
        self.assertLess(time.time() - started, 2)
        self.assertEqual(zodb_unpickle(storage.load(x)[0]).value, 'survivor')
        self.assertGreater(tid1, tid0)


class KilledClientTestsHF(KilledClientTests):
    keep_history = False


class ServerDisconnectTests(PGCase):

    def kill_sessions(self):
        self.assertTrue(ADMIN.terminate(self.factory.dbname))

    def test_next_transaction_works_after_sessions_are_terminated(self):
        db = self.db()
        conn = db.open()
        conn.root()['a'] = PersistentMapping(n=1)
        transaction.commit()
        self.kill_sessions()
        # The next transaction reconnects for loads, new OIDs and the commit.
        transaction.begin()
        root = conn.root()
        self.assertEqual(root['a']['n'], 1)
        root['a']['n'] = 2
        root['b'] = PersistentMapping(n=3)
        transaction.commit()
        conn.close()
        with db.transaction() as conn2:
            self.assertEqual(conn2.root()['a']['n'], 2)
            self.assertEqual(conn2.root()['b']['n'], 3)

    def test_every_idle_session_ended_at_once(self):
        check_every_idle_session_ended(self, self.db(), self.kill_sessions)

    def test_sessions_ended_by_idle_session_timeout(self):
        # A helper agent's check: psycopg 3 reports the server's
        # idle_session_timeout (PostgreSQL 14+) as SQLSTATE 57P05, which was
        # not taken for a disconnect: the first DB.open() after an idle
        # period failed, and a commit that spanned one raised from the
        # poll after tpc_finish, though it was committed.
        dbname = self.factory.dbname
        ADMIN.execute("ALTER DATABASE \"%s\" SET idle_session_timeout = '1s'" % dbname)
        self.addCleanup(ADMIN.execute,
                        'ALTER DATABASE "%s" RESET idle_session_timeout' % dbname)
        db = self.db()
        with db.transaction() as conn:
            conn.root()['n'] = 0
        for _ in range(2):
            time.sleep(1.5)
            with db.transaction() as conn:
                conn.root()['n'] += 1
        tm = transaction.TransactionManager()
        conn = db.open(tm)
        conn.root()['n'] += 1
        time.sleep(1.5)
        tm.commit()
        conn.close()
        with db.transaction() as conn:
            self.assertEqual(conn.root()['n'], 3)

    def test_in_flight_commit_fails_with_an_error_not_to_retry(self):
        # A helper agent's check: with PostgreSQL, MariaDB and SQLite
        # joined in one transaction, sessions ended after the vote made
        # this COMMIT fail with a TransientError, and tm.attempts() ran
        # the transaction again: MariaDB, which had finished first, got
        # its part twice.  Nothing was committed here, but a failure of
        # tpc_finish is not one to retry blindly.
        storage = self.storage()
        (x,), tid0 = self.make_objects(storage, 1)
        txn = self.begin_store(storage, x, tid0, 'lost')
        storage.tpc_vote(txn)
        self.kill_sessions()
        with self.assertRaises(CommitFailedError) as cm:
            storage.tpc_finish(txn)
        self.assertNotIsInstance(cm.exception, transaction.interfaces.TransientError)
        self.assertIn('was not committed', str(cm.exception))
        self.assertIn(self.factory.dbname, str(cm.exception))
        storage.tpc_abort(txn)
        # Nothing was committed, and the next commit reconnects.
        storage.poll_invalidations()
        self.assertEqual(storage.load(x)[1], tid0)
        txn = self.begin_store(storage, x, tid0, 'retried')
        storage.tpc_vote(txn)
        storage.tpc_finish(txn)
        self.assertEqual(zodb_unpickle(storage.load(x)[0]).value, 'retried')

    def test_a_server_out_of_disk_space_is_named(self):
        # A helper agent's check on a server whose disk filled: the error
        # was PostgreSQL's line about a file of its own ("could not extend
        # file ..."), naming neither the database nor the cause.  Here a
        # trigger answers the move into place with the same error
        # (SQLSTATE 53100, disk_full), from the server.
        from relstorage.interfaces import DatabaseFullError
        db = self.db()
        with db.transaction() as conn:
            conn.root()['kept'] = PersistentMapping(v='kept')
        def drop():
            conn = db.storage._adapter.open_store()
            for statement in ("DROP TRIGGER IF EXISTS disk_full ON object_state",
                              "DROP FUNCTION IF EXISTS disk_full()",
                              "DROP TABLE IF EXISTS full_flag"):
                conn.execute(statement)
            conn.commit()
            conn.close()
        drop()
        self.addCleanup(drop)
        setup = db.storage._adapter.open_store()
        try:
            for statement in (
                    "CREATE TABLE full_flag (id INT)",
                    "CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$ "
                    "BEGIN IF EXISTS (SELECT 1 FROM full_flag) THEN RAISE EXCEPTION "
                    "'could not extend file \"base/1/2\": No space left on device' "
                    "USING ERRCODE = 'disk_full', HINT = 'Check free disk space.'; "
                    "END IF; RETURN NULL; END $$",
                    "CREATE TRIGGER disk_full BEFORE INSERT OR UPDATE ON object_state "
                    "FOR EACH STATEMENT EXECUTE FUNCTION disk_full()",
                    "INSERT INTO full_flag VALUES (1)"):
                setup.execute(statement)
            setup.commit()
        finally:
            setup.close()
        message = refused_commit(self, db, lambda root: root['kept'].update(v='changed'),
                                 DatabaseFullError)
        self.assertIn("%s has no room left (" % db.storage._adapter.describe(), message)
        self.assertIn('No space left on device', message)
        self.assertIn('free disk space on the database server', message)
        with db.transaction() as conn:
            self.assertEqual(conn.root()['kept']['v'], 'kept')
        setup = db.storage._adapter.open_store()
        setup.execute("DELETE FROM full_flag")
        setup.commit()
        setup.close()
        with db.transaction() as conn:
            conn.root()['kept']['v'] = 'changed'
        with db.transaction() as conn:
            self.assertEqual(conn.root()['kept']['v'], 'changed')

    def test_a_commit_still_running_when_its_link_went_is_not_said_failed(self):
        # A helper agent's check: a COMMIT that the server was still
        # working on (waiting for a synchronous standby) when the link
        # to it went was reported "was not committed"
        # (CommitFailedError), and the server committed it 0.7 s later:
        # the question was asked at once, while the lost session still
        # held the commit lock.  Here the COMMIT runs a deferred trigger
        # that sleeps, and the client's end of the link is cut meanwhile.
        storage = self.storage()
        (x,), tid0 = self.make_objects(storage, 1)
        setup = storage._adapter.open_store()
        try:
            for statement in (
                    "DROP TABLE IF EXISTS slow_flag",
                    "CREATE TABLE slow_flag (id INT)",
                    "CREATE OR REPLACE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$ "
                    "BEGIN IF EXISTS (SELECT 1 FROM slow_flag) THEN PERFORM pg_sleep(1.5); "
                    "END IF; RETURN NULL; END $$",
                    "CREATE CONSTRAINT TRIGGER slow_commit AFTER UPDATE ON commit_lock "
                    "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit()",
                    "INSERT INTO slow_flag VALUES (1)"):
                setup.execute(statement)
            setup.commit()
        finally:
            setup.close()
        def drop():
            conn = storage._adapter.open_store()
            for statement in ("DROP TABLE IF EXISTS slow_flag",
                              "DROP TRIGGER IF EXISTS slow_commit ON commit_lock",
                              "DROP FUNCTION IF EXISTS slow_commit()"):
                conn.execute(statement)
            conn.commit()
            conn.close()
        self.addCleanup(drop)
        txn = self.begin_store(storage, x, tid0, 'slow')
        storage.tpc_vote(txn)
        fd = storage._store_conn.raw.fileno()

        def cut():
            time.sleep(0.5)
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()
        cutter = threading.Thread(target=cut)
        cutter.start()
        try:
            storage.tpc_finish(txn)
        finally:
            cutter.join()
        # It was committed, and said so (tpc_finish returned).
        storage.poll_invalidations()
        self.assertEqual(zodb_unpickle(storage.load(x)[0]).value, 'slow')

    def test_lost_commit_asks_again_while_the_server_refuses(self):
        # A helper agent's check: during a restart, the one question
        # "was it committed?" met a refusal ("shutting down") and the
        # outcome was reported unknown (CommitUnknownError), though the
        # answer came a second later: with other databases in the
        # transaction, an avoidable split.
        storage = self.storage()
        (x,), tid0 = self.make_objects(storage, 1)
        adapter = storage._adapter
        asked = []
        commit_outcome = adapter.commit_outcome

        def refused_twice(*args):
            asked.append(args)
            if len(asked) <= 2:
                raise DisconnectedError('FATAL:  the database system is shutting down')
            return commit_outcome(*args)
        adapter.commit_outcome = refused_twice
        try:
            txn = self.begin_store(storage, x, tid0, 'lost')
            storage.tpc_vote(txn)
            self.kill_sessions()
            with self.assertRaises(CommitFailedError):
                storage.tpc_finish(txn)
            storage.tpc_abort(txn)
        finally:
            del adapter.commit_outcome
        self.assertEqual(len(asked), 3)

    def test_in_flight_snapshot_fails_with_a_retryable_error(self):
        storage = self.storage()
        (x, y), tid0 = self.make_objects(storage, 2)
        instance = storage.new_instance()
        self.addCleanup(instance.close)
        instance.poll_invalidations()
        instance.load(x)
        self.kill_sessions()
        with self.assertRaises(DisconnectedError):
            instance.load(y)
        instance.afterCompletion()
        instance.poll_invalidations()
        self.assertEqual(zodb_unpickle(instance.load(y)[0]).value, 1)


class ServerDisconnectTestsHF(ServerDisconnectTests):
    keep_history = False


class ConnectionErrorTests(unittest.TestCase):
    """No database needed: bad addresses, names and drivers."""
    factory = None

    def adapter(self, dsn, **kw):
        return PostgreSQLAdapter(dsn=dsn, options=Options(**kw), driver=self.factory.driver)

    def test_unreachable_server_fails_fast_naming_it(self):
        adapter = self.adapter("host=127.0.0.1 port=9 dbname=zodb_here user=zope_user "
                               "password=sekrit-pw connect_timeout=3")
        started = time.time()
        with self.assertRaises(DisconnectedError) as cm:
            RelStorage(adapter)
        self.assertLess(time.time() - started, 5)
        message = str(cm.exception)
        self.assertEqual(len(message.splitlines()), 1, message)
        for part in ('127.0.0.1', 'zodb_here', 'zope_user'):
            self.assertIn(part, message)
        self.assertNotIn('sekrit-pw', message)
        self.assertNotIn('sekrit-pw', repr(cm.exception.__cause__))
        self.assertNotIn('sekrit-pw', adapter.describe())

    def test_a_service_file_and_the_environment_are_honoured(self):
        # A helper agent's check: our default connect_timeout (10 s) and
        # keepalives hid a service file's (and PGCONNECT_TIMEOUT), and the
        # storage was described as "database 'root' on the local socket".
        import tempfile
        path = os.path.join(tempfile.mkdtemp(prefix='relstoragetest_svc_'), 'pg_service.conf')
        self.addCleanup(shutil.rmtree, os.path.dirname(path), True)
        with open(path, 'w') as f:
            f.write('# a comment\n[rs_test_svc]\nhost=127.0.0.1\nport=9\ndbname=svc_db\n'
                    'user=svc_user\nconnect_timeout=2\nkeepalives_idle=30\n')
        saved = {key: os.environ.get(key) for key in ('PGSERVICEFILE', 'PGCONNECT_TIMEOUT')}

        def restore():
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.addCleanup(restore)
        os.environ['PGSERVICEFILE'] = path
        adapter = self.adapter('service=rs_test_svc')
        self.assertEqual(adapter.describe(),
                         "PostgreSQL database 'svc_db' on host 127.0.0.1 port 9 as user 'svc_user'")
        started = time.time()
        with self.assertRaises(DisconnectedError):
            RelStorage(adapter)
        self.assertLess(time.time() - started, 8)
        # (Written into the DSN: psycopg 3 times the connection itself and
        # reads no service file, a helper agent's check: 130 s.)
        self.assertIn('connect_timeout=2', adapter._dsn)
        self.assertNotIn('keepalives', adapter._dsn)
        os.environ['PGCONNECT_TIMEOUT'] = '3'
        self.assertIn('connect_timeout=3', self.adapter('host=127.0.0.1 dbname=x')._dsn)
        # A schema of its own: another storage, described (and its cache
        # file named) apart.
        self.assertIn("'x' (search_path app1)",
                      self.adapter("host=h dbname=x options='-c search_path=app1'").describe())
        saved_options = os.environ.get('PGOPTIONS')
        os.environ['PGOPTIONS'] = '-c search_path=app2'
        try:
            self.assertIn("'x' (search_path app2)", self.adapter("host=h dbname=x").describe())
        finally:
            if saved_options is None:
                del os.environ['PGOPTIONS']
            else:
                os.environ['PGOPTIONS'] = saved_options

    def test_unparsable_dsn_does_not_quote_the_password(self):
        # A helper agent's check: libpq's parse errors quote the token they
        # stumbled on, often part of the password (an unquoted one with a
        # space, a stray % in a URI's), and the message passed it on.
        import ZODB.config
        for dsn in ("dbname=d user=u host=127.0.0.1 password=Top S3cretPart",
                    "postgresql://u:S3cretPart%zz@127.0.0.1:9/d",
                    "postgresql://u:ab S3cretPart@127.0.0.1:9/d"):
            config = ('%%import relstorage\n<relstorage>\n<postgresql>\ndriver %s\n'
                      'dsn %s\n</postgresql>\n</relstorage>\n' % (self.factory.driver, dsn))
            with self.assertRaises(RelStorageError) as cm:
                ZODB.config.storageFromString(config).close()
            self.assertNotIn('S3cretPart', str(cm.exception))
        with self.assertRaises(RelStorageError) as cm:
            self.adapter("dbname=d user=u password=Top S3cretPart")
        self.assertIn('missing "=" after "..."', str(cm.exception))
        with self.assertRaises(RelStorageError) as cm:
            self.adapter("dbname=d user")
        self.assertIn('"user"', str(cm.exception))

    def test_silent_host_fails_within_the_connect_timeout(self):
        # TEST-NET-1 (RFC 5737): nothing answers there.
        adapter = self.adapter("host=192.0.2.1 dbname=zodb_there user=u connect_timeout=2")
        started = time.time()
        with self.assertRaises(DisconnectedError) as cm:
            adapter.connect('load')
        self.assertLess(time.time() - started, 8)
        self.assertIn('192.0.2.1', str(cm.exception))

    def test_server_refusals_while_it_recovers_pass(self):
        # A helper agent's check: during a restart after a crash
        # (pg_ctl restart -m immediate), PostgreSQL 15 answers "not yet
        # accepting connections", which was taken for a permanent error:
        # retry loops gave up.
        from relstorage.adapters.postgresql.drivers import connect_error_is_transient
        from relstorage.adapters.postgresql.drivers import select_driver
        driver = select_driver(self.factory.driver)
        for text, transient in (
                ('the database system is not yet accepting connections\nDETAIL:  '
                 'Consistent recovery state has not been yet reached.', True),
                ('the database system is not accepting connections\nDETAIL:  '
                 'Hot standby mode is disabled.', True),
                ('the database system is starting up', True),
                ('password authentication failed for user "zope"', False),
                ('database "nowhere" does not exist', False)):
            exc = driver.OperationalError(
                'connection to server at "127.0.0.1", port 5432 failed: FATAL:  ' + text)
            self.assertEqual(connect_error_is_transient(driver, exc), transient, text)
        # The client's own configuration (a helper agent's check: retried
        # as transient): no password to give, certificates.
        for text in ('fe_sendauth: no password supplied',
                     'SSL error: certificate verify failed',
                     'server certificate for "localhost" does not match host name "127.0.0.1"',
                     'root certificate file "/nowhere/root.crt" does not exist',
                     'could not load private key file "client.key": bad decrypt'):
            exc = driver.OperationalError(
                'connection to server at "127.0.0.1", port 5432 failed: ' + text)
            self.assertFalse(connect_error_is_transient(driver, exc), text)
        exc = driver.OperationalError('connection to server at "127.0.0.1", port 5432 failed: '
                                      'Connection refused')
        self.assertTrue(connect_error_is_transient(driver, exc))

    def test_default_connect_timeout(self):
        adapter = self.adapter('host=127.0.0.1 password=x')
        self.assertEqual(adapter._params['connect_timeout'], '10')
        adapter = self.adapter('host=127.0.0.1 connect_timeout=4')
        self.assertEqual(adapter._params['connect_timeout'], '4')

    def test_silently_dead_networks_are_bounded_by_default(self):
        # A helper agent's check: a session whose network went silent
        # (no reset, nothing acknowledged) held a process without limit.
        # Keepalives and tcp_user_timeout now bound it, unless the DSN
        # sets its own.
        import socket
        dsn = _dsn_with(base_dsn(), host='127.0.0.1')
        adapter = self.adapter(dsn)
        raw = adapter.connect('oid')
        try:
            sock = socket.socket(fileno=os.dup(raw.fileno()))
            try:
                self.assertEqual(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE), 60)
                self.assertEqual(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
                                 60000)
                self.assertEqual(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE), 1)
            finally:
                sock.close()
            # The server's side too (its default follows the OS: 2 hours),
            # so that a session whose client's network died ends, and lets
            # go of the commit lock (a helper agent's check).
            cur = raw.cursor()
            cur.execute("SELECT current_setting('tcp_keepalives_idle'), "
                        "current_setting('tcp_keepalives_count')")
            self.assertEqual(cur.fetchone(), ('60', '6'))
            cur.close()
        finally:
            raw.close()
        adapter = self.adapter(dsn + ' keepalives_idle=300')
        self.assertEqual(adapter._params['keepalives_idle'], '300')
        self.assertNotIn('tcp_user_timeout', adapter._params)

    def test_unknown_database_is_a_configuration_error(self):
        dsn = _dsn_with(base_dsn(), dbname='relstoragetest_does_not_exist')
        with self.assertRaises(RelStorageError) as cm:
            RelStorage(self.adapter(dsn))
        self.assertNotIsInstance(cm.exception, DisconnectedError)
        self.assertIn('relstoragetest_does_not_exist', str(cm.exception))

    def test_bad_dsn_values_are_configuration_errors(self):
        # A helper agent's check: libpq's refusal of a value was a
        # DisconnectedError (transient): callers retried a typo.
        for key, value in (('port', '99999'), ('sslmode', 'bogus')):
            dsn = _dsn_with(base_dsn(), **{key: value})
            with self.subTest(key=key), self.assertRaises(RelStorageError) as cm:
                RelStorage(self.adapter(dsn))
            self.assertNotIsInstance(cm.exception, DisconnectedError)
            self.assertIn(value, str(cm.exception))

    def test_driver_choice(self):
        self.assertEqual(self.adapter('').driver.name, self.factory.driver)
        # auto: psycopg2 when both are installed (faster here, most of all
        # with threads), then psycopg 3.
        self.assertEqual(PostgreSQLAdapter('', options=Options()).driver.name, 'psycopg2')
        self.assertEqual(PostgreSQLAdapter('', options=Options(driver='psycopg')).driver.name,
                         'psycopg')
        saved = sys.modules.get('psycopg2')
        sys.modules['psycopg2'] = None      # makes the import fail
        try:
            self.assertEqual(PostgreSQLAdapter('', options=Options()).driver.name, 'psycopg')
        finally:
            if saved is None:
                del sys.modules['psycopg2']
            else:
                sys.modules['psycopg2'] = saved
        with self.assertRaises(RelStorageError) as cm:
            PostgreSQLAdapter('', options=Options(driver='pg8000'))
        self.assertIn('pg8000', str(cm.exception))

    def test_psycopg2_with_a_wait_callback(self):
        # A helper agent's check: with psycogreen's wait callback (gevent
        # sites install it), the first commit failed with "copy_expert
        # cannot be used with an asynchronous callback".
        import psycopg2.extensions
        import psycopg2.extras
        # psycopg2 then uploads without COPY (WaitCallbackTests); auto
        # takes psycopg, which needs no callback and runs COPY.
        self.assertIsNone(psycopg2.extensions.get_wait_callback())
        psycopg2.extensions.set_wait_callback(psycopg2.extras.wait_select)
        self.addCleanup(psycopg2.extensions.set_wait_callback, None)
        self.assertEqual(PostgreSQLAdapter('', options=Options(driver='psycopg2')).driver.name,
                         'psycopg2')
        self.assertEqual(PostgreSQLAdapter('', options=Options()).driver.name, 'psycopg')

    def test_psycopg_imported_before_gevent_patched(self):
        # A review finding: psycopg chooses how it waits when imported;
        # imported before gevent patched the process, it waits in C, and
        # a commit waiting for the commit lock stopped the process.
        try:
            import gevent  # noqa: F401 pylint:disable=unused-import
        except ImportError:
            self.skipTest('gevent is not installed')
        import subprocess
        script = ("import psycopg, logging\n"
                  "from gevent import monkey; monkey.patch_all()\n"
                  "logging.basicConfig()\n"
                  "from relstorage.adapters.postgresql.adapter import PostgreSQLAdapter\n"
                  "from relstorage.options import Options\n"
                  "print(PostgreSQLAdapter('', options=Options(driver='psycopg')).driver.name)\n")
        proc = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                              timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(proc.stdout.strip(), 'psycopg')
        self.assertIn('patch with gevent before psycopg is first imported', proc.stderr)
        quiet = script.replace('import psycopg, logging\n', 'import logging\n')
        proc = subprocess.run([sys.executable, '-c', quiet], capture_output=True, text=True,
                              timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertNotIn('gevent has patched', proc.stderr)

    def test_missing_driver_is_a_clear_error(self):
        saved = sys.modules.get(self.factory.driver)
        sys.modules[self.factory.driver] = None      # makes the import fail
        try:
            with self.assertRaises(RelStorageError) as cm:
                PostgreSQLAdapter('', options=Options(driver=self.factory.driver))
            self.assertIn(self.factory.driver, str(cm.exception))
        finally:
            if saved is None:
                del sys.modules[self.factory.driver]
            else:
                sys.modules[self.factory.driver] = saved


class WaitCallbackTests(PGCase):
    """psycopg2 with a wait callback (psycogreen's patch_psycopg, which
    gevent sites install), with which it refuses COPY."""

    def setUp(self):
        super().setUp()
        if self.factory.driver != 'psycopg2':
            self.skipTest('psycopg2 only')

    def install_callback(self):
        import psycopg2.extensions
        import psycopg2.extras
        self.assertIsNone(psycopg2.extensions.get_wait_callback())
        psycopg2.extensions.set_wait_callback(psycopg2.extras.wait_select)
        self.addCleanup(psycopg2.extensions.set_wait_callback, None)

    def check_commits(self, db):
        for n in range(3):
            with db.transaction() as conn:
                # (More rows than one INSERT carries; a state of 300 KB.)
                conn.root()['m%d' % n] = PersistentMapping(
                    n=n, kids=[PersistentMapping(k=k) for k in range(150)], big=b'x' * 300000)
        with db.transaction() as conn:
            conn.root()['m0']['n'] = 10
            del conn.root()['m1']
        db.pack(time.time() + 1)
        with db.transaction() as conn:
            self.assertEqual(sorted((key, m['n'], len(m['kids']), len(m['big']))
                                    for key, m in conn.root().items()),
                             [('m0', 10, 150, 300000), ('m2', 2, 150, 300000)])
            self.assertEqual(conn.root()['m2']['kids'][149]['k'], 149)

    def test_installed_after_the_storage_opened(self):
        # A helper agent's check: in a worker forked from a process that
        # opened the storage (gunicorn's --preload) and installed the
        # callback then, every commit failed with "copy_expert cannot be
        # used with an asynchronous callback".
        db = self.db()
        self.install_callback()
        self.check_commits(db)
        other = self.db()
        with other.transaction() as conn:
            self.assertEqual(conn.root()['m0']['n'], 10)

    def test_installed_before_the_storage_opened(self):
        # (Refused at open before, for want of COPY.)
        self.install_callback()
        self.check_commits(self.db())

    def test_big_states_go_in_pieces(self):
        # A review finding: psycopg2 spells each value out in the INSERT,
        # and PostgreSQL takes no statement of 1 GB: a commit of one state
        # of 300 MB failed ("invalid memory alloc request"), one of 3 x 180
        # MB took 7.6 GB of client memory.  States are now inserted a few
        # MB of them at a time, a big one in pieces; here the sizes are
        # scaled down.
        from unittest import mock
        from relstorage.adapters.postgresql import drivers as pg_drivers
        self.install_callback()
        db = self.db()
        states = {'one': os.urandom(2500000), 'two': os.urandom(900000),
                  'three': os.urandom(900000), 'small': b's'}
        with mock.patch.object(pg_drivers, '_INSERT_CHUNK', 1 << 20), \
                mock.patch.object(pg_drivers, '_INSERT_BYTES', 1 << 20):
            for _ in range(2):      # new objects, then changes
                with db.transaction() as conn:
                    for key, data in states.items():
                        conn.root()[key] = PersistentMapping(data=data)
                states = {key: data[::-1] for key, data in states.items()}
        states = {key: data[::-1] for key, data in states.items()}
        with self.db().transaction() as conn:
            self.assertEqual({key: conn.root()[key]['data'] for key in states}, states)


class WaitCallbackTestsHF(WaitCallbackTests):
    keep_history = False


class TempTableTests(PGCase):
    """temp_store keeps its rows across commits (no ON COMMIT DELETE ROWS,
    whose truncation at every commit made commits wait for the file
    system): each vote deletes what the last commit left, and the table is
    truncated once enough rows went through it."""

    def temp_store_bytes(self, storage):
        """Size of the largest temp_store of a session (a temporary table's file
        grows with every page it is given)."""
        # (Not a table whose TRUNCATE a held vote has not committed yet:
        # its size would wait for the lock.)
        return int(self.query(
            storage, "SELECT COALESCE(MAX(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.relname = 'temp_store' AND n.nspname LIKE %s AND NOT EXISTS ("
            "SELECT 1 FROM pg_locks l WHERE l.relation = c.oid "
            "AND l.mode = 'AccessExclusiveLock')", ('pg_temp_%',))[0][0])

    def query(self, storage, stmt, params=()):
        conn = storage._adapter.open_store()
        try:
            return conn.query_all(stmt, params)
        finally:
            conn.rollback()
            conn.close()

    def commit(self, storage, values):
        """Store {oid: value} (each at its current serial); return the tid,
        after checking that the transaction wrote those objects only."""
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        for oid, value in values.items():
            storage.store(oid, storage.load(oid)[1], zodb_pickle(MinPO(value)), '', txn)
        storage.tpc_vote(txn)
        tid = storage.tpc_finish(txn)
        written = self.query(storage, "SELECT zoid FROM object_state WHERE tid = %s",
                             (u64(tid),))
        self.assertEqual(sorted(zoid for zoid, in written), sorted(u64(oid) for oid in values))
        return tid

    def test_rows_of_one_commit_never_reach_the_next(self):
        # keep-locks-on-conflict 0: a vote that fails rolls back at once
        # (else its transaction, with its deletion of the last commit's rows
        # and its own upload, goes on in the retry).
        for keep_locks in (0, 2.0):
            with self.subTest(keep_locks_on_conflict=keep_locks):
                self.check_rows_never_reach_the_next(keep_locks)

    def check_rows_never_reach_the_next(self, keep_locks):
        storage = self.storage(keep_locks_on_conflict=keep_locks)
        storage._adapter.temp_garbage_rows = 40
        oids, _ = self.make_objects(storage, 20)
        expected = {oid: (i, None) for i, oid in enumerate(oids)}
        sizes = []
        for round_ in range(30):
            # Ten of the twenty objects: the other ten's rows of the last
            # commit must not be written again with this one's tid
            # (self.commit checks).  1.5 KB of random bytes each: rows
            # that fill pages.
            chosen = oids[(round_ % 2) * 10:(round_ % 2) * 10 + 10]
            values = {oid: 'r%d %s' % (round_, os.urandom(750).hex()) for oid in chosen}
            tid = self.commit(storage, values)
            for oid in chosen:
                expected[oid] = (values[oid], tid)
            if round_ % 7 == 3:
                # A vote that fails after its upload: an object read with
                # readCurrent changed (checked after the upload; a stale
                # serial of a stored object fails before it).
                txn = TransactionMetaData()
                storage.tpc_begin(txn)
                for oid in oids[:5]:
                    storage.store(oid, storage.load(oid)[1], zodb_pickle(MinPO('lost')),
                                  '', txn)
                storage.checkCurrentSerialInTransaction(oids[5], p64(1), txn)
                with self.assertRaises(ReadConflictError):
                    storage.tpc_vote(txn)
                storage.tpc_abort(txn)
            sizes.append(self.temp_store_bytes(storage))
        reader = self.storage()
        for oid, (value, tid) in expected.items():
            state, serial = reader.load(oid)
            self.assertEqual(zodb_unpickle(state).value, value)
            if tid is not None:
                self.assertEqual(serial, tid)
        # 300 rows (450 KB) went through temp_store; truncated every 40
        # rows, it never held much more than 40 rows' worth.
        self.assertLess(max(sizes), 200 * 1024, sizes)

    def test_a_large_commit_is_followed_by_a_truncation(self):
        # Counted as they go in: the next vote truncates the table rather
        # than deleting every row of the large commit (and leaving them in
        # the table's files, for every later statement to scan).
        storage = self.storage()
        # 150 rows in, then 150 more: past 200 only when counted as they
        # go in (counted as deleted, 150 rows would be deleted again).
        storage._adapter.temp_garbage_rows = 200
        # (New objects through temp_store too, as larger sets of them go:
        # see new_rows_direct_bytes.)
        with mock.patch.object(type(storage._adapter), 'new_rows_direct_bytes', 0):
            oids, _ = self.make_objects(storage, 150)
        self.commit(storage, {oid: os.urandom(750).hex() for oid in oids})
        large = self.temp_store_bytes(storage)
        self.commit(storage, {oids[0]: 'small'})
        small = self.temp_store_bytes(storage)
        self.assertGreater(large, 200 * 1024)
        self.assertLess(small, 64 * 1024, (large, small))


    def test_a_server_session_handed_on_by_a_pooler(self):
        # A helper agent's check through pgbouncer (session pooling without
        # server_reset_query, or transaction pooling): a new client's first
        # commit got the server session of another, whose temp_store still
        # held the rows of its last commit, and moved them into place with
        # its own: a change committed meanwhile by a third client was
        # reverted.  Here the new storage's store connection is given a
        # session whose temp_store holds a stale row (as the pooler did).
        storage = self.storage()
        oids, _ = self.make_objects(storage, 2)
        stale = storage.load(oids[0])
        self.commit(storage, {oids[0]: 'latest'})
        adapter = self.storage()._adapter
        raw = adapter.driver.connect(adapter._dsn, 'store')
        cur = raw.cursor()
        cur.execute(pg_sql.TEMP_STORE)
        cur.execute("INSERT INTO temp_store (zoid, prev_tid, state) VALUES (%s, %s, %s)",
                    (u64(oids[0]), u64(stale[1]), stale[0]))
        raw.commit()
        cur.close()
        connect = adapter.driver.connect
        handed = []

        def pooled(dsn, purpose, **kw):
            if purpose == 'store' and not handed:
                handed.append(raw)
                return raw
            return connect(dsn, purpose, **kw)
        second = self.storage()
        with mock.patch.object(second._adapter.driver, 'connect', pooled):
            self.commit(second, {oids[1]: 'other'})
        self.assertEqual(handed, [raw])
        self.assertEqual(zodb_unpickle(self.storage().load(oids[0])[0]).value, 'latest')


    def test_a_server_session_with_prepared_statements(self):
        # The same check: through pgbouncer without server_reset_query,
        # psycopg2's PREPARE of load_current failed every load on a session
        # another client had left ("prepared statement rs_load_current
        # already exists").
        storage = self.storage()
        oids, _ = self.make_objects(storage, 1)
        adapter = self.storage()._adapter
        raw = adapter.driver.connect(adapter._dsn, 'load')
        cur = raw.cursor()
        cur.execute("PREPARE rs_load_current(bigint) AS SELECT 1, 2")
        raw.commit()
        cur.close()
        connect = adapter.driver.connect

        def pooled(dsn, purpose, **kw):
            return raw if purpose == 'load' else connect(dsn, purpose, **kw)
        second = self.storage()
        with mock.patch.object(second._adapter.driver, 'connect', pooled):
            for _ in range(2):
                second.poll_invalidations()
                self.assertEqual(zodb_unpickle(second.load(oids[0])[0]).value, 0)
                second.release()


    def test_an_error_of_a_closed_link_is_a_disconnect(self):
        # The same helper agent: through pgbouncer, after the server
        # session behind it ended, psycopg 3 failed the next BEGIN with
        # "received 2 results from command ..." (an InternalError with no
        # SQLSTATE) and closed its connection; the error reached the
        # application, which transaction managers do not retry.
        storage = self.storage()
        adapter = storage._adapter
        conn = adapter.open_load()
        self.addCleanup(conn.close)
        conn.raw.close()
        driver = adapter.driver
        with self.assertRaises(DisconnectedError):
            conn.call(mock.Mock(side_effect=driver.module.InternalError(
                "received 2 results from command 'BEGIN'")))
        # (A connection still open: the error is the application's.)
        other = adapter.open_load()
        self.addCleanup(other.close)
        with self.assertRaises(driver.module.InternalError):
            other.call(mock.Mock(side_effect=driver.module.InternalError('other')))


class SortKeyTests(PGCase):

    def test_one_database_spelled_two_ways_has_one_sort_key(self):
        # A helper agent's check: the sort key (the order of a
        # transaction's votes across databases, which must be the same in
        # every process) was the description, which names the port only
        # when the DSN does: two processes spelling one database two ways
        # could each take one commit lock and wait for the other's.
        storage = self.storage()
        params = dict(re.findall(r"(\w+)=(\S+)", self.factory.dsn))
        spelled = (self.factory.dsn.replace('port=%s' % params['port'], '')
                   if 'port' in params else self.factory.dsn + ' port=5432')
        options = Options(keep_history=self.keep_history)
        other = RelStorage(PostgreSQLAdapter(dsn=spelled, options=options,
                                             driver=self.factory.driver), options=options)
        self._open.append(other)
        self.assertNotEqual(storage._adapter.describe(), other._adapter.describe())
        self.assertEqual(storage.sortKey(), other.sortKey())
        self.assertIn('PostgreSQL database key', storage.sortKey())
        second = self.factory.named('sort_key_b')
        second.fresh(self.keep_history)
        self.addCleanup(second.cleanup)
        third = RelStorage(second.make_adapter(options), options=options)
        self._open.append(third)
        self.assertNotEqual(third.sortKey(), storage.sortKey())

    def test_a_schema_named_in_mixed_case(self):
        # A review finding: with search_path naming a schema in mixed case
        # (quoted), the tables were looked for in the lower-case schema:
        # every open after the first tried to make the schema again
        # ('relation "zoid_seq" already exists').
        ADMIN.terminate(self.factory.dbname)
        storage = self.storage()
        storage.close()
        conn = drivers.select_driver('auto').connect(self.factory.dsn, 'oid')
        try:
            cur = conn.cursor()
            cur.execute('DROP SCHEMA IF EXISTS "MixedSchema" CASCADE')
            cur.execute('CREATE SCHEMA "MixedSchema"')
        finally:
            conn.close()
        options = Options(keep_history=self.keep_history)
        dsn = self.factory.dsn + " options='-c search_path=\"MixedSchema\"'"
        for _ in range(2):
            opened = RelStorage(PostgreSQLAdapter(dsn=dsn, options=options,
                                                  driver=self.factory.driver), options=options)
            self._open.append(opened)
            (oid,), tid = make_objects(opened, 1)
            self.assertEqual(opened.load(oid)[1], tid)
            opened.close()

    def test_a_copy_with_the_same_key_sorts_apart(self):
        # A review finding: the sort key came from the database's key
        # alone, which a copy made from a template (or a dump) carries:
        # a transaction joining the database and its copy left their
        # order to chance.
        storage = self.storage()
        storage.close()
        copy = self.factory.dbname + '_copy'
        ADMIN.terminate(self.factory.dbname)
        ADMIN.execute('DROP DATABASE IF EXISTS "%s"' % copy)
        ADMIN.execute('CREATE DATABASE "%s" TEMPLATE "%s"' % (copy, self.factory.dbname))
        self.addCleanup(ADMIN.execute, 'DROP DATABASE IF EXISTS "%s"' % copy)
        options = Options(keep_history=self.keep_history)
        original = self.storage()
        copied = RelStorage(PostgreSQLAdapter(
            dsn=_dsn_with(base_dsn(), dbname=copy, **_TEST_SESSION),
            options=options, driver=self.factory.driver), options=options)
        self.addCleanup(ADMIN.terminate, copy)
        self._open.append(copied)
        self.assertEqual(copied._adapter.database_key(create=False),
                         original._adapter.database_key(create=False))
        self.assertNotEqual(copied.sortKey(), original.sortKey())
        self.assertTrue(copied.sortKey().startswith(original.sortKey().split(' at ')[0]))


class TempTableTestsHF(TempTableTests):
    keep_history = False


class ReadOnlySnapshotTests(PGCase):

    def test_load_connection_is_repeatable_read_read_only(self):
        storage = self.storage()
        storage.poll_invalidations()
        conn = storage._load_conn
        self.assertEqual(conn.query_value("SHOW transaction_isolation"), 'repeatable read')
        self.assertEqual(conn.query_value("SHOW transaction_read_only"), 'on')
        store = storage._adapter.open_store()
        try:
            self.assertEqual(store.query_value("SHOW transaction_isolation"), 'read committed')
            self.assertEqual(store.query_value("SHOW lock_timeout"), '10s')
        finally:
            store.close()


    def test_a_snapshot_the_server_cancelled_is_a_transient_error(self):
        # A helper agent's check (ro-replica-conf, packs on the primary): a
        # hot standby cancelled a load snapshot ("conflict with recovery",
        # SQLSTATE 40001) and the driver's SerializationFailure reached the
        # application, which transaction managers do not retry.  (Raised
        # here by the server itself, with that SQLSTATE.)
        import transaction.interfaces
        storage = self.storage()
        storage.poll_invalidations()
        conn = storage._load_conn
        with self.assertRaises(DisconnectedError) as cm:
            conn.execute("DO $$ BEGIN RAISE EXCEPTION 'canceling statement due to conflict "
                         "with recovery' USING ERRCODE = '40001'; END $$")
        self.assertIsInstance(cm.exception, transaction.interfaces.TransientError)
        self.assertIn('conflict with recovery', str(cm.exception))
        self.assertTrue(conn.broken)

    def test_commit_lock_timeout_beyond_what_postgresql_takes(self):
        # A helper agent's check: 30 days failed every connection ("invalid
        # value for parameter lock_timeout"); the longest PostgreSQL takes
        # is used instead.
        storage = self.storage(commit_lock_timeout=2592000)
        store = storage._adapter.open_store()
        try:
            self.assertEqual(store.query_value("SHOW lock_timeout"), '2147483647ms')
        finally:
            store.close()


class ByteaOutputTests(PGCase):
    """States come back as the bytes stored whatever the server's
    bytea_output: psycopg2's values are decoded from the hex form in one
    call, and from the escape form (a server or role configured so) by
    psycopg2 itself."""

    STATES = [b'', b'\\x41', b'x\\', b'\x00\xff', bytes(range(256)) * 3,
              b'\\\\x00', b'"{}",']

    def test_states_round_trip_in_either_output_format(self):
        for output in ('hex', 'escape'):
            with self.subTest(bytea_output=output):
                self._round_trip(output)

    def _round_trip(self, output):
        base = dict(drivers.select_driver('auto').parse_dsn(self.factory.dsn))
        options = (base.get('options', '') + ' -c bytea_output=%s' % output).strip()
        dsn = _dsn_with(self.factory.dsn, options=options)
        self.factory.fresh(self.keep_history)
        opts = Options(keep_history=self.keep_history)

        def open_storage():
            storage = RelStorage(PostgreSQLAdapter(dsn=dsn, options=opts,
                                                   driver=self.factory.driver),
                                 options=opts)
            self._open.append(storage)
            return storage
        writer = open_storage()
        oids = [writer.new_oid() for _ in self.STATES]
        txn = TransactionMetaData()
        writer.tpc_begin(txn)
        for oid, state in zip(oids, self.STATES):
            writer.store(oid, z64, state, '', txn)
        writer.tpc_vote(txn)
        tid = writer.tpc_finish(txn)
        # A storage of its own: nothing in its caches, every state read.
        reader = open_storage().new_instance()
        self._open.append(reader)
        reader.poll_invalidations()
        self.assertEqual(reader._load_conn.query_value("SHOW bytea_output"), output)
        for oid, state in zip(oids, self.STATES):
            got, serial = reader.load(oid)
            self.assertIs(type(got), bytes)
            self.assertEqual((got, serial), (state, tid))
        other = open_storage().new_instance()
        self._open.append(other)
        other.poll_invalidations()
        other.prefetch(oids)
        self.assertEqual([other.load(oid)[0] for oid in oids], self.STATES)
        self.assertEqual(other.loadSerial(oids[4], tid), self.STATES[4])


class SessionDefaultsTests(PGCase):
    """Settings a DBA gives a database or role (helper agents' checks)."""

    keep_history = False

    def storage_with(self, **params):
        base = dict(drivers.select_driver('auto').parse_dsn(self.factory.dsn))
        for key, value in params.items():
            if key == 'options':
                value = (base.get('options', '') + ' ' + value).strip()
            base[key] = value
        dsn = _dsn_with(self.factory.dsn, **{key: base[key] for key in params})
        opts = Options(keep_history=self.keep_history)
        storage = RelStorage(PostgreSQLAdapter(dsn=dsn, options=opts,
                                               driver=self.factory.driver), options=opts)
        self.addCleanup(storage.close)
        return storage

    def test_a_read_only_default_for_transactions(self):
        # default_transaction_read_only on: the OID session's nextval failed
        # every commit of a new object (RelStorage 4.3 committed).
        self.factory.fresh(self.keep_history)
        storage = self.storage_with(options='-c default_transaction_read_only=on')
        oids, tid = self.make_objects(storage, 3)
        self.assertEqual(storage.load(oids[2])[1], tid)

    def test_a_sql_ascii_database(self):
        # psycopg 3 gave its text as bytes: the table names were not
        # recognised, and every open after the first made the schema again
        # ("relation zoid_seq already exists").
        name = self.factory.dbname + '_ascii'
        ADMIN.execute('DROP DATABASE IF EXISTS "%s"' % name)
        ADMIN.execute("CREATE DATABASE \"%s\" ENCODING 'SQL_ASCII' LC_COLLATE 'C' "
                      "LC_CTYPE 'C' TEMPLATE template0" % name)

        def drop():
            ADMIN.terminate(name)
            ADMIN.execute('DROP DATABASE IF EXISTS "%s"' % name)
        self.addCleanup(drop)
        for _ in range(2):
            storage = self.storage_with(dbname=name)
            oids, tid = self.make_objects(storage, 2)
            self.assertEqual(storage.load(oids[1])[1], tid)
            storage.close()

    def test_a_pack_of_one_schema_leaves_another_schema_s_alone(self):
        # The pack lock was one advisory lock for the whole database: the
        # pack of the storage in another schema was refused, "already
        # running".
        self.factory.fresh(self.keep_history)
        own = drivers.select_driver('auto').connect(
            _dsn_with(base_dsn(), dbname=self.factory.dbname), 'oid')
        try:
            cur = own.cursor()
            for schema in ('rs_one', 'rs_two'):
                cur.execute('CREATE SCHEMA IF NOT EXISTS %s' % schema)
            cur.close()
        finally:
            own.close()
        one = self.storage_with(options='-c search_path=rs_one')
        two = self.storage_with(options='-c search_path=rs_two')
        public = self.storage_with()
        held = one._adapter.acquire_pack_lock()
        self.assertIsNotNone(held)
        try:
            self.assertIsNone(self.storage_with(
                options='-c search_path=rs_one')._adapter.acquire_pack_lock())
            for other in (two, public):
                lock = other._adapter.acquire_pack_lock()
                self.assertIsNotNone(lock)
                lock.close()
        finally:
            held.close()
        # The public schema's lock is the one earlier releases took.
        held = public._adapter.acquire_pack_lock()
        try:
            self.assertEqual(ADMIN.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
                "(classid::bigint << 32) + objid::bigint = 7243910377 AND database = "
                "(SELECT oid FROM pg_database WHERE datname = %s)",
                (self.factory.dbname,))[0][0], 1)
        finally:
            held.close()


class OidAllocationTests(PGCase):

    def test_allocations_grow_and_never_overlap(self):
        one, two = self.storage(), self.storage()
        draws = []
        adapter = one._adapter
        allocate = adapter.allocate_oid_block

        def counted(conn):
            block = allocate(conn)
            draws.append(len(block))
            return block
        adapter.allocate_oid_block = counted
        first = [u64(one.new_oid()) for _ in range(5000)]
        # 128, 256, 512, 1024, 2048, then 2048 at most: six round trips,
        # not forty.
        self.assertEqual(draws, [128, 256, 512, 1024, 2048, 2048])
        mixed = []
        for _ in range(1000):
            mixed.append(u64(one.new_oid()))
            mixed.append(u64(two.new_oid()))
        everything = first + mixed
        self.assertEqual(len(set(everything)), len(everything))


class RecordIterationCostTests(PGCase):
    """record_iternext, which zodbupdate and zodbverify call once per
    object, reads what it returns, not the database up to it."""

    keep_history = True

    def test_a_call_far_into_the_database_reads_a_few_rows(self):
        # A helper agent's check (history-preserving): PostgreSQL merged
        # current_object and object_state from OID 0, and a call at OID
        # 100,000 took 61 ms (1.6 ms at OID 1,000): zodbupdate had not
        # finished 112,000 records in 15 minutes.
        storage = self.storage()
        oids, _ = self.make_objects(storage, 3000)
        adapter = storage._adapter
        conn = adapter.open_load()
        self.addCleanup(conn.close)
        # (The plan it chose on tables not analysed yet, made certain.)
        conn.execute('SET LOCAL enable_nestloop = off')
        conn.execute('SET LOCAL enable_hashjoin = off')
        read = ("SELECT COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0) "
                "FROM pg_stat_xact_user_tables WHERE relname = 'object_state'")
        before = conn.query_value(read)
        rows = adapter.record_iternext(conn, u64(oids[-10]))
        after = conn.query_value(read)
        conn.rollback()
        self.assertEqual([row[0] for row in rows], [u64(oids[-10]), u64(oids[-9])])
        self.assertLess(after - before, 100)


    def rows_read(self, conn, table):
        return conn.query_value(
            "SELECT COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0) "
            "FROM pg_stat_xact_user_tables WHERE relname = %s", (table,))

    def test_history_and_the_undo_log_read_what_they_return(self):
        # A helper agent's check (history-preserving, 31,000 transactions):
        # history() of an object changed long ago walked every transaction
        # newest first (55 ms a call); undoLog(0, 1) read and sorted them
        # all (62 ms).
        if not self.keep_history:
            return
        storage = self.storage()
        (old,), _ = self.make_objects(storage, 1)
        for _ in range(300):
            self.make_objects(storage, 1)
        adapter = storage._adapter
        conn = adapter.open_load()
        self.addCleanup(conn.close)
        # (The plans a big database gets, made certain on a small one:
        # ordered index scans, rows joined as they come.)
        for setting in ('enable_seqscan', 'enable_hashjoin', 'enable_mergejoin',
                        'enable_sort'):
            conn.execute('SET LOCAL %s = off' % setting)
        for what in ('history', 'undo log'):
            before = self.rows_read(conn, 'transaction_log')
            if what == 'history':
                self.assertEqual(len(adapter.history(conn, u64(old), 1)), 1)
            else:
                self.assertEqual(len(adapter.undo_log(conn, adapter.get_last_tid(conn), 1)), 1)
            self.assertLess(self.rows_read(conn, 'transaction_log') - before, 20, what)
        conn.rollback()
        self.assertEqual(len(storage.undoLog(0, 5)), 5)
        self.assertEqual(len(storage.undoLog(0, 500)), 301)
        self.assertEqual(len(storage.undoLog(0, 5, lambda entry: True)), 5)


class RecordIterationCostTestsHF(RecordIterationCostTests):
    keep_history = False


class UnloggedPackTablesTests(PGCase):
    """object_ref and pack_object are UNLOGGED (their rows do not go
    through the WAL, where they made a live site's commits wait).  Crash
    recovery, or a promoted standby, empties them while pack_info still
    says which revisions were analysed: the next pack must analyse again,
    not compute reachability without the lost references."""
    keep_history = False

    def _pack(self, db):
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logger = logging.getLogger('relstorage')
        logger.addHandler(handler)
        try:
            db.pack(time.time() + 1)
        finally:
            logger.removeHandler(handler)
        return [r.getMessage() for r in records if r.levelno >= logging.WARNING]

    def _query(self, db, stmt):
        conn = db.storage.adapter.open_load()
        try:
            return conn.query_all(stmt)
        finally:
            conn.close()

    def test_references_lost_by_crash_recovery_are_analysed_again(self):
        db = self.db()
        with db.transaction() as conn:
            root = conn.root()
            root['a'] = PersistentMapping(b=PersistentMapping(value=42))
            root['garbage'] = PersistentMapping()
        with db.transaction() as conn:
            del conn.root()['garbage']
        self.assertEqual(self._pack(db), [])
        self.assertEqual(
            sorted(self._query(db, "SELECT relname, relpersistence FROM pg_class WHERE "
                                   "relname IN ('object_ref', 'pack_object', 'pack_info')")),
            [('object_ref', 'u'), ('pack_info', 'p'), ('pack_object', 'u')])
        # Only the root changes: without its references recorded, a -> b
        # would be unknown and b collected.
        self._lose_the_tables_then_pack(db)
        db.cacheMinimize()
        db.storage._cache.clear()
        with db.transaction() as conn:
            self.assertEqual(conn.root()['a']['b']['value'], 42)
        self.assertGreater(self._query(db, 'SELECT count(*) FROM object_ref')[0][0], 0)

    def test_a_database_without_references_is_not_taken_for_a_crash(self):
        # A helper agent's check: objects that reference nothing leave
        # object_ref empty, which every later pack took for a table lost
        # by crash recovery (a warning, and every revision analysed again).
        db = self.db()
        for n in range(3):
            with db.transaction() as conn:
                conn.root()['n'] = n
            self.assertEqual(self._pack(db), [])
        self.assertEqual(self._query(db, 'SELECT count(*) FROM object_ref')[0][0], 0)
        # Once references are recorded, an empty table is a lost one again.
        with db.transaction() as conn:
            conn.root()['a'] = PersistentMapping()
        self.assertEqual(self._pack(db), [])
        self._lose_the_tables_then_pack(db)

    def test_a_pack_that_removed_every_reference_is_not_taken_for_a_crash(self):
        # A helper agent's check: a pack whose garbage held the only
        # references left object_ref empty, and the next pack took it for
        # a table lost by crash recovery.
        db = self.db()
        with db.transaction() as conn:
            conn.root()['a'] = PersistentMapping(b=PersistentMapping())
        self.assertEqual(self._pack(db), [])
        with db.transaction() as conn:
            del conn.root()['a']
        self.assertEqual(self._pack(db), [])
        self.assertEqual(self._query(db, 'SELECT count(*) FROM object_ref')[0][0], 0)
        with db.transaction() as conn:
            conn.root()['n'] = 1
        self.assertEqual(self._pack(db), [])

    def _lose_the_tables_then_pack(self, db):
        """Empty object_ref and pack_object as crash recovery does, commit a
        change to the root, pack: one warning, and every revision is
        analysed again."""
        store = db.storage.adapter.open_store()
        try:
            store.execute('TRUNCATE object_ref, pack_object')
            store.commit()
        finally:
            store.close()
        with db.transaction() as conn:
            conn.root()['n'] = 1
        warnings = self._pack(db)
        self.assertEqual(len(warnings), 1, warnings)
        self.assertIn('analysing every revision again', warnings[0])


class PrivilegeTests(PackPrivilegeCases, unittest.TestCase):
    """PackPrivilegeCases on PostgreSQL: a role of its own, with the rows
    and sequences of a database it does not own."""
    factory = None
    refused_per_statement = True

    def setUp(self):
        import uuid
        self.dbname = 'relstoragetest_priv_%s' % uuid.uuid4().hex[:8]
        self.role = self.app_user = 'relstoragetest_app_%s' % uuid.uuid4().hex[:8]
        ADMIN.ensure_database(self.dbname)
        ADMIN.execute('CREATE ROLE %s LOGIN' % self.role)
        # (PostgreSQL 15's default; before it, every role could create
        # in the public schema.)
        self.as_owner('REVOKE CREATE ON SCHEMA public FROM PUBLIC')
        self.owner = drivers.select_driver('auto').parse_dsn(base_dsn()).get('user')

    def tearDown(self):
        transaction.abort()
        ADMIN.execute('DROP DATABASE IF EXISTS "%s" WITH (FORCE)' % self.dbname)
        ADMIN.execute('DROP ROLE IF EXISTS %s' % self.role)

    def db(self, owner):
        import ZODB.config
        params = {'dbname': self.dbname}
        user = self.owner if owner else self.role
        if user:                # (None: the owner as RS_PG_DSN names it, or not)
            params['user'] = user
        dsn = _dsn_with(base_dsn(), **params)
        return ZODB.config.databaseFromString(
            "%%import relstorage\n<zodb>\n<relstorage>\n keep-history false\n"
            " create-schema %s\n <postgresql>\n  driver %s\n  dsn %s\n </postgresql>\n"
            "</relstorage>\n</zodb>\n" % ('true' if owner else 'false',
                                          self.factory.driver, dsn))

    def test_zodbconvert_clear_by_an_application_role_says_what_it_needs(self):
        # A helper agent's check: the driver's bare "InsufficientPrivilege:
        # must be owner of table blob_chunk".
        import contextlib
        import io
        import tempfile
        import ZODB.FileStorage
        from relstorage import zodbconvert
        tmp = tempfile.mkdtemp(prefix='relstoragetest_conv_')
        self.addCleanup(shutil.rmtree, tmp, True)
        source = os.path.join(tmp, 'source.fs')
        db = ZODB.DB(ZODB.FileStorage.FileStorage(source))
        with db.transaction() as conn:
            conn.root()['x'] = 1
        db.close()
        self.db(True).close()
        self.grant()
        dsn = _dsn_with(base_dsn(), dbname=self.dbname, user=self.role)
        config = os.path.join(tmp, 'convert.conf')
        with open(config, 'w') as f:
            f.write('%%import relstorage\n<filestorage source>\n path %s\n</filestorage>\n'
                    '<relstorage destination>\n keep-history false\n <postgresql>\n'
                    '  driver %s\n  dsn %s\n </postgresql>\n</relstorage>\n'
                    % (source, self.factory.driver, dsn))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = zodbconvert.main(['--clear', config])
        self.assertEqual(status, 1)
        self.assertIn('cannot clear', err.getvalue())
        self.assertIn("schema's owner", err.getvalue())
        self.assertNotIn('Traceback', err.getvalue())

    def as_owner(self, *statements):
        driver = drivers.select_driver('auto')
        own = driver.connect(_dsn_with(base_dsn(), dbname=self.dbname), 'oid')
        try:
            cur = own.cursor()
            for stmt in statements:
                cur.execute(stmt)
            cur.close()
            own.commit()
        finally:
            own.close()

    def grant(self, temporary=True):
        if not temporary:
            # (Every role may create temporary tables through PUBLIC.)
            ADMIN.execute('REVOKE TEMPORARY ON DATABASE "%s" FROM PUBLIC' % self.dbname)
        self.as_owner('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public '
                      'TO %s' % self.role,
                      # (What allocating OIDs needs, and all: a helper
                      # agent's check found every process's first commit
                      # reading the sequence, which needs SELECT.)
                      'GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO %s' % self.role)


class BlobChunkTests(BlobCase):
    """A helper agent's check: blob-chunk-size 512MB (its largest then)
    stored blobs that could never be read back ("invalid memory alloc
    request size": a 512 MB value sent as text is over 1 GB), and with
    psycopg2 lost the connection at commit."""

    keep_history = False

    def _blob_round_trip(self, size, **options):
        import hashlib
        path = os.path.join(self.tmp, 'source')
        written = hashlib.sha256()
        with open(path, 'wb') as f:
            piece = bytes(range(256)) * 4096      # 1 MB
            left, n = size, 0
            while left:
                part = (b'%012d' % n + piece)[:min(left, MB)]
                f.write(part)
                written.update(part)
                left -= len(part)
                n += 1
        db = ZODB.DB(self.blob_storage('writer-cache', **options))
        self.addCleanup(db.close)
        with db.transaction() as conn:
            blob = conn.root()['blob'] = Blob()
            blob.consumeFile(path)
        self.assertEqual(self._read_back(**options), written.hexdigest())
        own = drivers.select_driver('auto').connect(
            _dsn_with(base_dsn(), dbname=self.factory.dbname), 'oid')
        try:
            cur = own.cursor()
            cur.execute('SELECT octet_length(chunk) FROM blob_chunk ORDER BY chunk_num')
            return cur.fetchall()
        finally:
            own.close()

    def _read_back(self, **options):
        """The SHA-256 of root['blob'] read by another storage, its cache
        empty: every chunk read from the server."""
        import hashlib
        reader = ZODB.DB(self.blob_storage('reader-cache', **options))
        self.addCleanup(reader.close)
        read = hashlib.sha256()
        with reader.transaction() as conn:
            with conn.root()['blob'].open() as f:
                for part in iter(lambda: f.read(MB), b''):
                    read.update(part)
        return read.hexdigest()

    def test_chunks_are_read_in_parts(self):
        # A chunk larger than one read (BLOB_PART, 16 MB) comes in parts.
        sizes = self._blob_round_trip(40 * MB + 123, blob_chunk_size=40 * MB)
        self.assertEqual([row[0] for row in sizes], [40 * MB, 123])

    def test_a_chunk_of_512_mb_reads_back(self):
        # What the storage could write before (psycopg 3): the chunk is made
        # here by the server itself.  Read whole, it failed for good.
        import hashlib
        if self.factory.secondary_driver:
            self.skipTest('512 MB through the server: with one driver only')
        db = ZODB.DB(self.blob_storage('writer-cache'))
        self.addCleanup(db.close)
        with db.transaction() as conn:
            conn.root()['blob'] = Blob(b'x')
        own = drivers.select_driver('auto').connect(
            _dsn_with(base_dsn(), dbname=self.factory.dbname), 'oid')
        try:
            cur = own.cursor()
            cur.execute("UPDATE blob_chunk SET chunk = (SELECT string_agg("
                        "decode(repeat('61', 1048576), 'hex'), ''::bytea) "
                        "FROM generate_series(1, 512))")
            own.commit()
        finally:
            own.close()
        expected = hashlib.sha256()
        for _ in range(512):
            expected.update(b'a' * MB)
        self.assertEqual(self._read_back(), expected.hexdigest())

    def test_chunks_no_larger_than_postgresql_carries(self):
        # (A helper agent's check: the warning came with the first blob
        # written, not at open; and 1GB warned at open of 512MB, where
        # 128MB was used.)
        with self.assertLogs('relstorage', 'WARNING') as logs:
            sizes = self._blob_round_trip(129 * MB, blob_chunk_size=512 * MB)
        self.assertEqual([row[0] for row in sizes], [128 * MB, MB])
        for line in logs.output:        # (one per storage opened)
            self.assertIn('relstorage.options:blob-chunk-size 536870912 is outside 65536 to '
                          '134217728 bytes (the most PostgreSQL', line)
            self.assertIn('using 134217728', line)


PG_CASES = (ParallelVoteTests, ParallelVoteTestsHF, LockTimeoutTests, LockTimeoutTestsHF,
            ConcurrentIncrementTests,
            KilledClientTests, KilledClientTestsHF,
            ServerDisconnectTests, ServerDisconnectTestsHF,
            ConnectionErrorTests, ReadOnlySnapshotTests, ByteaOutputTests,
            OidAllocationTests, SessionDefaultsTests, RecordIterationCostTests, RecordIterationCostTestsHF,
            TempTableTests, TempTableTestsHF, SortKeyTests, WaitCallbackTests, WaitCallbackTestsHF,
            UnloggedPackTablesTests, PrivilegeTests, BlobChunkTests)


def _big_blob_wanted():
    return bool(os.environ.get('RS_BIG_BLOB_MB') or os.environ.get('RS_PG_BIG_BLOB'))


def _wanted():
    names = os.environ.get('RS_TEST_DATABASES')
    if not names:
        return True
    return 'postgresql' in [n.strip() for n in names.split(',')]


def _test_suite():
    result = unittest.TestSuite()
    if not _wanted():
        return result
    for driver in DRIVERS:
        try:
            drivers.select_driver(driver)
        except RelStorageError as exc:
            # One failure naming the missing driver (a helper agent's check:
            # its whole suite failed, and the temporary directories its
            # failed set-ups left nested every later test's, psycopg 3's
            # too, until their names were too long).
            result.addTest(_missing_driver(driver, str(exc)))
            continue
        factory = PostgreSQLFactory(driver)
        # Several GB through the server take minutes (3 GB: about 2.5 min
        # here): only when asked for, and with one driver.
        factory.big_blob_test = (driver == 'psycopg' and _big_blob_wanted())
        factory.secondary_driver = driver != DRIVERS[0]
        driver_suite = suite.make_suite(factory, extra_cases=PG_CASES)
        _rehome(driver_suite, factory)
        result.addTest(driver_suite)
    return result


def _missing_driver(driver, reason):
    return suite.cannot_run(__name__, 'DriverMissing_%s' % driver, 'test_driver_installed',
                            reason)


def _rehome(test, factory):
    """Give the test classes make_suite built for ``factory`` this module's
    name, so that their ids say where they run (``-t test_postgresql``)."""
    if isinstance(test, unittest.TestSuite):
        for sub in test:
            _rehome(sub, factory)
        return
    cls = type(test)
    # Only the per-factory subclasses make_suite creates, never shared ones.
    if cls.__module__ == suite.__name__ and factory.name.replace('-', '_') in cls.__name__:
        cls.__module__ = __name__


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
