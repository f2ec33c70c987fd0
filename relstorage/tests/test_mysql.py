"""The shared suite, and MySQL-specific cases, on MySQL / MariaDB.

Connection settings come from RS_MYSQL_HOST, RS_MYSQL_PORT, RS_MYSQL_USER
and RS_MYSQL_PASSWD (default 127.0.0.1, 3306, root, empty).  The suite runs
once per driver (mysqlclient's MySQLdb and PyMySQL) on two databases per
driver, ``relstoragetest_<pid>_<driver>`` and a sibling, created on first
use and dropped when the process exits.

When RS_TEST_DATABASES is set and does not name mysql, nothing runs.
Otherwise an unreachable server, or a missing driver, is a test failure,
never a silent skip.
"""
import atexit
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import unittest

import persistent
import transaction
import transaction.interfaces
import ZODB
from persistent.mapping import PersistentMapping
from ZODB.Connection import TransactionMetaData
from ZODB.POSException import ConflictError
from ZODB.tests.MinPO import MinPO
from ZODB.tests.StorageTestBase import zodb_pickle
from ZODB.tests.StorageTestBase import zodb_unpickle
from ZODB.utils import p64
from ZODB.utils import u64

from relstorage import config
from relstorage.adapters.mysql import drivers
from relstorage.adapters.mysql import sql as mysql_sql
from relstorage.adapters.mysql.adapter import MySQLAdapter
from relstorage.interfaces import CommitFailedError
from relstorage.interfaces import DisconnectedError
from relstorage.interfaces import RelStorageError
from relstorage.interfaces import SchemaMismatchError
from relstorage.interfaces import StateTooLargeError
from relstorage.interfaces import UnableToAcquireCommitLockError
from relstorage.interfaces import UnableToLockRowsError
from relstorage.options import Options
from relstorage.storage import RelStorage

from . import suite
from .core_cases import check_every_idle_session_ended
from .core_cases import record_calls
from .core_cases import refused_commit
from .core_cases import vote_behind
from .privilege_cases import PackPrivilegeCases

DRIVERS = ('MySQLdb', 'PyMySQL')


def server_params():
    params = {
        'host': suite.env('RS_MYSQL_HOST', '127.0.0.1'),
        'port': int(suite.env('RS_MYSQL_PORT', '3306')),
        'user': suite.env('RS_MYSQL_USER', 'root'),
        'passwd': suite.env('RS_MYSQL_PASSWD', ''),
        'connect_timeout': 10,
    }
    return params


def admin_connect(driver, db=None):
    """A plain autocommit driver connection (no RelStorage involved)."""
    params = server_params()
    if db:
        params['db'] = db
    module = drivers.select_driver(driver)
    conn = module.connect(params)
    conn.autocommit(True)
    return conn


class MySQLFactory(suite.NamedDatabases):
    """Database factory for suite.make_suite (see suite.py)."""

    #: blob_cases' multi-gigabyte blob test: once, with the C driver.
    big_blob_test = False

    def __init__(self, driver, db_name):
        self.driver = driver
        self.name = 'mysql-' + driver
        self.db_name = db_name
        self._created = False
        self._sibling = None
        self._named = {}
        self._fresh_in = None
        self._admin = None

    # --- administration --------------------------------------------------

    def admin(self):
        """A cached admin connection (no default database)."""
        if self._admin is not None:
            try:
                self._admin.ping()
            except Exception:  # pylint:disable=broad-except
                self._admin = None
        if self._admin is None:
            self._admin = admin_connect(self.driver)
        return self._admin

    def admin_query(self, stmt, params=None):
        cur = self.admin().cursor()
        try:
            cur.execute(stmt, params)
            return cur.fetchall()
        finally:
            cur.close()

    def ensure_database(self):
        if not self._created:
            self.admin_query('CREATE DATABASE IF NOT EXISTS %s' % self.db_name)
            self._created = True
            atexit.register(self.drop_database)

    def drop_database(self):
        try:
            self.kill_sessions()
            self.admin_query('DROP DATABASE IF EXISTS %s' % self.db_name)
            self._admin.close()
        except Exception:  # pylint:disable=broad-except
            pass
        self._admin = None

    def session_ids(self):
        """Server thread ids of the sessions using our database."""
        rows = self.admin_query(
            "SELECT id FROM information_schema.processlist "
            "WHERE db = %s AND id <> CONNECTION_ID()", (self.db_name,))
        return [row[0] for row in rows]

    def open_transactions(self):
        """InnoDB transactions (read views hold back purge) of the sessions
        on our database but ours."""
        return list(self.admin_query(
            "SELECT t.trx_mysql_thread_id, t.trx_state, t.trx_started, p.info "
            "FROM information_schema.innodb_trx t JOIN information_schema.processlist p "
            "ON p.id = t.trx_mysql_thread_id WHERE p.db = %s AND p.id <> CONNECTION_ID()",
            (self.db_name,)))

    def kill_sessions(self):
        """Kill every session on our database (left over by a test that
        did not close its storage, or on purpose)."""
        killed = 0
        for session_id in self.session_ids():
            try:
                self.admin_query('KILL %d' % session_id)
                killed += 1
            except Exception:  # pylint:disable=broad-except
                pass            # already gone
        return killed

    def connect_kwargs(self):
        kwargs = server_params()
        kwargs['db'] = self.db_name
        return kwargs

    # --- the factory protocol ----------------------------------------------

    def fresh(self, keep_history):
        self.ensure_database()
        self.kill_sessions()
        adapter = MySQLAdapter(options=Options(keep_history=keep_history,
                                               commit_lock_timeout=10),
                               driver=self.driver, **self.connect_kwargs())
        adapter.drop_all()

    def make_adapter(self, options):
        return MySQLAdapter(options=options, driver=self.driver, **self.connect_kwargs())

    def sibling(self):
        if self._sibling is None:
            self._sibling = MySQLFactory(self.driver, self.db_name + '_2')
        return self._sibling

    def make_named(self, key):
        return MySQLFactory(self.driver, '%s_n_%s' % (self.db_name, key))

    def zconfig_adapter(self):
        """The adapter section of a ZConfig file for this database."""
        lines = ['<mysql>', '  driver %s' % self.driver]
        lines += ['  %s %s' % (k, v) for k, v in self.connect_kwargs().items() if v != '']
        return '\n'.join(lines + ['</mysql>', ''])

    def write_subprocess_factory(self, directory, keep_history):
        """A module a child process imports to reach the same database."""
        with open(os.path.join(directory, 'factory_for_subprocess.py'), 'w') as f:
            f.write(SUBPROCESS_FACTORY % (keep_history, self.connect_kwargs(), self.driver))
        return directory

    def server_session_count(self):
        return len(self.session_ids())

    def kill_server_sessions(self):
        self.kill_sessions()

    def cleanup(self):
        pass


SUBPROCESS_FACTORY = """
from relstorage.adapters.mysql.adapter import MySQLAdapter
KEEP_HISTORY = %r
CONNECT_KWARGS = %r
DRIVER = %r
def make_adapter(options):
    return MySQLAdapter(options=options, driver=DRIVER, **CONNECT_KWARGS)
"""


# ----------------------------------------------------------------------
# Our own cases.

class Counter(persistent.Persistent):
    """A plain counter: concurrent increments conflict (no resolution)."""
    value = 0


class MySQLTestCase(unittest.TestCase):
    factory = None
    keep_history = True

    def setUp(self):
        self.factory.fresh(self.keep_history)
        self._storages = []
        self._dbs = []

    def tearDown(self):
        transaction.abort()
        for db in self._dbs:
            try:
                db.close()
            except Exception:  # pylint:disable=broad-except
                pass
        for storage in self._storages:
            try:
                storage.close()
            except Exception:  # pylint:disable=broad-except
                pass
        self.factory.cleanup()

    def make_options(self, **kw):
        kw.setdefault('keep_history', self.keep_history)
        kw.setdefault('commit_lock_timeout', 10)
        return Options(**kw)

    def make_storage(self, **kw):
        options = self.make_options(**kw)
        storage = RelStorage(self.factory.make_adapter(options), options=options)
        self._storages.append(storage)
        return storage

    def make_db(self, storage=None, **kw):
        db = ZODB.DB(storage if storage is not None else self.make_storage(**kw))
        self._dbs.append(db)
        return db

    def create_objects(self, storage, count):
        """Commit ``count`` MinPO objects; return [(oid, serial)]."""
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        oids = [storage.new_oid() for _ in range(count)]
        for i, oid in enumerate(oids):
            storage.store(oid, p64(0), zodb_pickle(MinPO(i)), '', txn)
        storage.tpc_vote(txn)
        tid = storage.tpc_finish(txn)
        return [(oid, tid) for oid in oids]

    def begin_store(self, storage, items, read_current=()):
        """tpc_begin + store ``items`` [(oid, serial, value)]."""
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        for oid, serial, value in items:
            storage.store(oid, serial, zodb_pickle(MinPO(value)), '', txn)
        for oid, serial in read_current:
            storage.checkCurrentSerialInTransaction(oid, serial, txn)
        return txn

    def locked_transactions(self):
        """InnoDB transactions on our database (other than the admin's)
        holding row locks; other databases on the server are not ours."""
        return self.factory.admin_query(
            "SELECT t.trx_mysql_thread_id, t.trx_rows_locked "
            "FROM information_schema.innodb_trx t JOIN information_schema.processlist p "
            "ON p.id = t.trx_mysql_thread_id WHERE p.db = %s "
            "AND t.trx_mysql_thread_id <> CONNECTION_ID() AND t.trx_rows_locked > 0",
            (self.factory.db_name,))

    def assert_no_locks_held(self, but=(), wait=3.0):
        """No transaction (except the sessions in ``but``) holds row locks.

        information_schema.innodb_trx is a cache InnoDB refreshes only when
        it has not been read for 0.1 s, and a killed client's session ends
        asynchronously: look again, slowly, for up to ``wait`` seconds.
        """
        deadline = time.time() + wait
        while True:
            held = [row for row in self.locked_transactions() if row[0] not in but]
            if not held or time.time() > deadline:
                break
            time.sleep(0.25)
        self.assertEqual(held, [])

    def assert_row_unlocked(self, oid):
        """Lock the current row of ``oid`` without waiting, then let go."""
        table = 'current_object' if self.keep_history else 'object_state'
        conn = admin_connect(self.factory.driver, self.factory.db_name)
        try:
            cur = conn.cursor()
            cur.execute('START TRANSACTION')
            cur.execute('SELECT zoid FROM %s WHERE zoid = %%s FOR UPDATE NOWAIT' % table,
                        (u64(oid),))
            self.assertEqual(len(cur.fetchall()), 1)
            cur.execute('ROLLBACK')
        finally:
            conn.close()


class ParallelVoteTests(MySQLTestCase):

    def test_disjoint_votes_do_not_block(self):
        base = self.make_storage(commit_lock_timeout=5)
        (a, a_tid), (b, b_tid), (c, c_tid) = self.create_objects(base, 3)
        s1 = base.new_instance()
        s2 = self.make_storage(commit_lock_timeout=5)   # another adapter
        t1 = self.begin_store(s1, [(a, a_tid, 'a1'), (s1.new_oid(), p64(0), 'new1')],
                              read_current=[(c, c_tid)])
        t2 = self.begin_store(s2, [(b, b_tid, 'b2'), (s2.new_oid(), p64(0), 'new2')],
                              read_current=[(c, c_tid)])
        s1.tpc_vote(t1)
        # s1 holds the commit lock from its vote to its finish; s2 uploads
        # and locks its disjoint rows meanwhile, then waits for that lock
        # only, and goes on as soon as s1 finishes.
        tid1, tid2 = vote_behind(self, s1, t1, s2, t2)
        self.assertGreater(tid2, tid1)
        check = base.new_instance()
        check.poll_invalidations()
        self.assertEqual(zodb_unpickle(check.load(a)[0]).value, 'a1')
        self.assertEqual(zodb_unpickle(check.load(b)[0]).value, 'b2')
        self.assertEqual(check.load(a)[1], tid1)
        self.assertEqual(check.load(b)[1], tid2)
        for storage in (s1, s2, check):
            storage.release()

    def test_disjoint_votes_history_free(self):
        self.keep_history = False
        self.factory.fresh(False)
        self.test_disjoint_votes_do_not_block()


class LockTimeoutTests(MySQLTestCase):

    def _conflicting_vote(self, mysql8_style=False):
        holder = self.make_storage(commit_lock_timeout=2)
        (lo, lo_tid), (hi, hi_tid) = self.create_objects(holder, 2)
        waiter = self.make_storage(commit_lock_timeout=2)
        if mysql8_style:
            # The MySQL path: session innodb_lock_wait_timeout, restored after.
            waiter._adapter.server.supports_set_statement = False
        t1 = self.begin_store(holder, [(hi, hi_tid, 'holder')])
        holder.tpc_vote(t1)
        t2 = self.begin_store(waiter, [(lo, lo_tid, 'w'), (hi, hi_tid, 'w')])
        started = time.time()
        with self.assertRaises(UnableToLockRowsError) as cm:
            waiter.tpc_vote(t2)
        elapsed = time.time() - started
        waiter.tpc_abort(t2)
        self.assertTrue(1.5 <= elapsed < 5, elapsed)
        self.assertIsInstance(cm.exception, ConflictError)
        self.assertIsInstance(cm.exception, transaction.interfaces.TransientError)
        self.assertIn('0x%x' % u64(hi), str(cm.exception))
        # The waiter locked `lo` before waiting for `hi`: released now.
        self.assert_row_unlocked(lo)
        holder_thread = holder._store_conn.query_value('SELECT CONNECTION_ID()')
        self.assert_no_locks_held(but=(holder_thread,))
        if mysql8_style:
            # The waiter's session, back in its pool since the abort.
            pool = waiter._adapter.store_sessions
            conn = pool.take()
            self.assertEqual(
                conn.query_value('SELECT @@session.innodb_lock_wait_timeout'),
                conn.query_value('SELECT @@global.innodb_lock_wait_timeout'))
            conn.rollback()
            pool.give_back(conn)
        holder.tpc_finish(t1)
        # The retry succeeds.
        waiter.poll_invalidations()
        new_hi = waiter.load(hi)[1]
        t3 = self.begin_store(waiter, [(lo, lo_tid, 'w'), (hi, new_hi, 'w')])
        waiter.tpc_vote(t3)
        waiter.tpc_finish(t3)
        self.assert_no_locks_held()

    def test_row_lock_timeout(self):
        self._conflicting_vote()

    def test_row_lock_timeout_session_variable(self):
        self._conflicting_vote(mysql8_style=True)

    def test_commit_lock_timeout(self):
        storage = self.make_storage(commit_lock_timeout=2)
        [(oid, serial)] = self.create_objects(storage, 1)
        other = admin_connect(self.factory.driver, self.factory.db_name)
        try:
            cur = other.cursor()
            cur.execute('START TRANSACTION')
            cur.execute('SELECT tid FROM commit_lock FOR UPDATE')
            txn = self.begin_store(storage, [(oid, serial, 'x')])
            started = time.time()
            # In vote: once vote has returned, finish must not fail.
            with self.assertRaises(UnableToAcquireCommitLockError) as cm:
                storage.tpc_vote(txn)
            elapsed = time.time() - started
            storage.tpc_abort(txn)
            self.assertTrue(1.5 <= elapsed < 5, elapsed)
            self.assertIsInstance(cm.exception, ConflictError)
            self.assert_no_locks_held(but=(other.thread_id(),))
            cur.execute('ROLLBACK')
        finally:
            other.close()
        self.assert_row_unlocked(oid)
        txn = self.begin_store(storage, [(oid, serial, 'y')])
        storage.tpc_vote(txn)
        storage.tpc_finish(txn)


def _increment_worker(driver, connect_kwargs, keep_history, count, results):
    try:
        options = Options(keep_history=keep_history, commit_lock_timeout=20)
        adapter = MySQLAdapter(options=options, driver=driver, **connect_kwargs)
        db = ZODB.DB(RelStorage(adapter, options=options))
        tm = transaction.TransactionManager()
        conn = db.open(tm)
        conflicts = 0
        for _ in range(count):
            while True:
                try:
                    tm.begin()
                    root = conn.root()
                    root['length'].change(1)
                    root['counter'].value += 1
                    tm.commit()
                    break
                except ConflictError:
                    tm.abort()
                    conflicts += 1
        conn.close()
        db.close()
        results.put(('ok', conflicts))
    except BaseException as exc:  # pylint:disable=broad-except
        import traceback
        results.put(('error', traceback.format_exc()))
        raise SystemExit(1) from exc


def _vote_and_wait_worker(driver, connect_kwargs, keep_history, oid, serial, results):
    options = Options(keep_history=keep_history, commit_lock_timeout=5)
    storage = RelStorage(MySQLAdapter(options=options, driver=driver, **connect_kwargs),
                         options=options)
    txn = TransactionMetaData()
    storage.tpc_begin(txn)
    storage.store(oid, serial, zodb_pickle(MinPO('killed')), '', txn)
    storage.store(storage.new_oid(), p64(0), zodb_pickle(MinPO('new')), '', txn)
    storage.tpc_vote(txn)
    results.put('voted')
    time.sleep(120)


class MultiProcessTests(MySQLTestCase):

    processes = 4
    increments = 200

    def _spawn(self, target, *args):
        ctx = multiprocessing.get_context('spawn')
        results = ctx.Queue()
        kwargs = self.factory.connect_kwargs()
        procs = [ctx.Process(target=target,
                             args=(self.factory.driver, kwargs, self.keep_history) + args
                             + (results,))
                 for _ in range(1 if target is _vote_and_wait_worker else self.processes)]
        for proc in procs:
            proc.daemon = True
            proc.start()
        return procs, results

    def test_concurrent_increments(self):
        from BTrees.Length import Length
        db = self.make_db()
        with db.transaction() as conn:
            conn.root()['length'] = Length()
            conn.root()['counter'] = Counter()
        started = time.time()
        procs, results = self._spawn(_increment_worker, self.increments)
        outcomes = [results.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(30)
        errors = [text for status, text in outcomes if status != 'ok']
        self.assertEqual(errors, [])
        with db.transaction() as conn:
            total = self.processes * self.increments
            self.assertEqual(conn.root()['length'](), total)
            self.assertEqual(conn.root()['counter'].value, total)
        self.assertLess(time.time() - started, 90)

    def test_sigkill_between_vote_and_finish(self):
        storage = self.make_storage(commit_lock_timeout=2)
        [(oid, serial)] = self.create_objects(storage, 1)
        before = storage._adapter.get_last_tid(storage._adapter.open_load())
        procs, results = self._spawn(_vote_and_wait_worker, oid, serial)
        self.assertEqual(results.get(timeout=60), 'voted')
        deadline = time.time() + 3
        while not self.locked_transactions() and time.time() < deadline:
            time.sleep(0.25)
        self.assertTrue(self.locked_transactions())     # the child holds its row lock
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        self.assert_no_locks_held(wait=10)
        self.assert_row_unlocked(oid)
        # Nothing of the child's transaction is visible.
        check = storage.new_instance()
        check.poll_invalidations()
        self.assertEqual(u64(check.lastTransaction()), before)
        self.assertEqual(zodb_unpickle(check.load(oid)[0]).value, 0)
        self.assertEqual(len(check), 1)
        check.release()
        # And the object can be committed at once.
        txn = self.begin_store(storage, [(oid, serial, 'after')])
        storage.tpc_vote(txn)
        storage.tpc_finish(txn)


class DisconnectTests(MySQLTestCase):

    def test_killed_sessions_between_transactions(self):
        db = self.make_db()
        tm = transaction.TransactionManager()
        conn = db.open(tm)
        with tm:
            conn.root()['counter'] = Counter()
        self.assertGreater(self.factory.kill_sessions(), 0)
        # The next transaction reconnects the load, store and OID connections.
        with tm:
            conn.root()['counter'].value += 1
            conn.root()['other'] = PersistentMapping()
        self.assertEqual(self.factory.kill_sessions() > 0, True)
        with tm:
            conn.root()['counter'].value += 1
        conn.close()
        with db.transaction() as conn2:
            self.assertEqual(conn2.root()['counter'].value, 2)

    def test_every_idle_session_ended_at_once(self):
        check_every_idle_session_ended(self, self.make_db(), lambda: self.assertGreater(self.factory.kill_sessions(), 0))

    def test_killed_load_connection_in_flight(self):
        (x, _), (oid, _) = self.create_objects(self.make_storage(), 2)
        storage = self.make_storage()       # its cache has neither object
        instance = storage.new_instance()
        instance.poll_invalidations()
        instance.load(x)
        self.factory.kill_sessions()
        with self.assertRaises(DisconnectedError) as cm:
            instance.load(oid)
        self.assertIsInstance(cm.exception, transaction.interfaces.TransientError)
        self.assertNotIn(server_params()['passwd'] or '\0', str(cm.exception))
        # The next transaction works.
        instance.afterCompletion()
        instance.poll_invalidations()
        self.assertEqual(zodb_unpickle(instance.load(oid)[0]).value, 1)
        instance.release()

    def test_killed_store_connection_in_flight(self):
        storage = self.make_storage()
        [(oid, serial)] = self.create_objects(storage, 1)
        before = storage.lastTransaction()
        txn = self.begin_store(storage, [(oid, serial, 'lost')])
        storage.tpc_vote(txn)
        self.factory.kill_sessions()
        with self.assertRaises(CommitFailedError) as cm:
            storage.tpc_finish(txn)
        self.assertNotIsInstance(cm.exception, transaction.interfaces.TransientError)
        storage.tpc_abort(txn)
        check = storage.new_instance()
        check.poll_invalidations()
        self.assertEqual(check.lastTransaction(), before)
        self.assertEqual(zodb_unpickle(check.load(oid)[0]).value, 0)
        check.release()
        txn = self.begin_store(storage, [(oid, serial, 'retried')])
        storage.tpc_vote(txn)
        storage.tpc_finish(txn)


class LargeStateTests(MySQLTestCase):

    def _refused_state(self, storage, size_from_packet):
        """Store a state of max_allowed_packet + ``size_from_packet`` bytes;
        (its size, the packet size, the refusal's message)."""
        [(oid, serial)] = self.create_objects(storage, 1)
        packet = storage._adapter.max_allowed_packet
        self.assertTrue(packet)
        size = packet + size_from_packet
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        storage.store(oid, serial, b'x' * size, '', txn)
        with self.assertRaises(StateTooLargeError) as cm:
            storage.tpc_vote(txn)
        storage.tpc_abort(txn)
        return size, packet, ' '.join(str(cm.exception).split()), oid, serial

    def test_state_larger_than_max_allowed_packet(self):
        storage = self.make_storage()
        size, packet, message, oid, serial = self._refused_state(storage, 1)
        self.assertIn('max_allowed_packet', message)
        self.assertIn(str(size), message)
        self.assertIn(str(packet), message)
        self.assert_no_locks_held()
        # Other clients, and this one, go on.
        other = self.make_storage()
        self.create_objects(other, 1)
        txn = self.begin_store(storage, [(oid, serial, 'small')])
        storage.tpc_vote(txn)
        storage.tpc_finish(txn)

    def test_state_just_under_max_allowed_packet_is_refused_saying_the_limit(self):
        # A helper agent's check: "is 16776960 bytes, more than ... accepts:
        # its max_allowed_packet is 16777216 bytes".
        size, packet, message, _, _ = self._refused_state(self.make_storage(), -300)
        self.assertIn('is %d bytes, more than the %d bytes' % (size, packet - 1024),
                      message)
        self.assertIn('max_allowed_packet, %d bytes, less 1024' % packet, message)

    def test_metadata_larger_than_max_allowed_packet(self):
        # A helper agent's check (history-preserving): a transaction whose
        # extension was larger than max_allowed_packet made the server drop
        # the connection: DisconnectedError, which retry loops resend.
        storage = self.make_storage()
        if not storage._adapter.keep_history:
            self.skipTest('history-free: no metadata is stored')
        [(oid, serial)] = self.create_objects(storage, 1)
        packet = storage._adapter.max_allowed_packet
        # (Under the limit as bytes, over it as the driver writes them:
        # PyMySQL in hexadecimal, mysqlclient escaping the quotes; a
        # review finding, a check that counted escapes only.)
        txn = TransactionMetaData(description=b'd' * 1024)
        txn.extension_bytes = b"'" * (packet * 6 // 10)
        storage.tpc_begin(txn)
        storage.store(oid, serial, zodb_pickle(MinPO('big metadata')), '', txn)
        with self.assertRaises(StateTooLargeError) as cm:
            storage.tpc_vote(txn)
        storage.tpc_abort(txn)
        self.assertIn("transaction's metadata", str(cm.exception))
        self.assertIn(str(packet), str(cm.exception))
        self.assert_no_locks_held()
        txn = self.begin_store(storage, [(oid, serial, 'small')])
        storage.tpc_vote(txn)
        storage.tpc_finish(txn)

    def test_large_states_round_trip(self):
        storage = self.make_storage()
        packet = storage._adapter.max_allowed_packet
        # Escaping doubles these bytes: too big for one statement, so the
        # state goes up in pieces; plus many small rows in the same upload.
        quoted = b"'\\\0" * ((packet * 6 // 10) // 3)
        plain = os.urandom(packet // 3)
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        oids = [storage.new_oid() for _ in range(2002)]
        storage.store(oids[0], p64(0), quoted, '', txn)
        storage.store(oids[1], p64(0), plain, '', txn)
        for oid in oids[2:]:
            storage.store(oid, p64(0), zodb_pickle(MinPO(u64(oid))), '', txn)
        storage.tpc_vote(txn)
        storage.tpc_finish(txn)
        check = storage.new_instance()
        check.poll_invalidations()
        self.assertEqual(check.load(oids[0])[0], quoted)
        self.assertEqual(check.load(oids[1])[0], plain)
        self.assertEqual(zodb_unpickle(check.load(oids[-1])[0]).value, u64(oids[-1]))
        self.assertEqual(len(check), 2002)
        check.release()


    def test_new_objects_straight_into_place_in_several_statements(self):
        # New objects skip temp_store when they fit (new_rows_direct_bytes,
        # bounded by max_allowed_packet so that each state fits in one
        # statement); their multi-row INSERTs stay within the packet.
        for keep_history in (True, False):
            self.factory.fresh(keep_history)
            storage = self.make_storage(keep_history=keep_history)
            self.create_objects(storage, 1)
            adapter = storage._adapter
            # (Read at each connect: the store connection is open now.)
            adapter.max_allowed_packet = 20000
            self.assertLess(adapter.new_rows_direct_bytes, 10000)
            sent = []

            def spy(conn, prefix, values, insert=adapter._insert_text_rows):
                execute = conn.execute

                def counted(sql, params=()):
                    self.assertLessEqual(len(sql), 20000 - 1024)
                    sent.append((prefix, sql.count(b'),(') + 1))
                    return execute(sql, params)
                conn.execute = counted
                try:
                    insert(conn, prefix, values)
                finally:
                    del conn.execute
            adapter._insert_text_rows = spy
            states = [b'%04d' % i + os.urandom(140) for i in range(60)]
            txn = TransactionMetaData()
            storage.tpc_begin(txn)
            oids = [storage.new_oid() for _ in states]
            for oid, state in zip(oids, states):
                storage.store(oid, p64(0), state, '', txn)
            storage.tpc_vote(txn)
            tid = storage.tpc_finish(txn)
            # 60 states of 144 bytes, in hexadecimal with their numbers:
            # more than one packet of 20,000 bytes.
            counts = [n for prefix, n in sent if 'object_state' in prefix]
            self.assertEqual(sum(counts), 60)
            self.assertEqual(len(counts), 2)
            self.assertEqual(sum(n for prefix, n in sent if 'current_object' in prefix),
                             60 if keep_history else 0)
            check = storage.new_instance()
            check.poll_invalidations()
            for oid, state in zip(oids, states):
                self.assertEqual(check.load(oid), (state, tid))
            check.release()
            storage.close()
            self._storages.remove(storage)


class ConnectionSettingsTests(MySQLTestCase):

    def _adapter(self, **changes):
        kwargs = self.factory.connect_kwargs()
        kwargs.update(changes)
        return MySQLAdapter(options=Options(), driver=self.factory.driver, **kwargs)

    def test_databases_with_long_names_alike_have_their_own_pack_locks(self):
        # A helper agent's check: the lock name was cut at 64 characters,
        # and the pack of a database whose name began as another's (the
        # first 48 characters) was refused, "already running".
        names = [(self.factory.db_name + '_' + 'x' * 64)[:60] + suffix
                 for suffix in ('_01', '_02')]
        admin = admin_connect(self.factory.driver)
        try:
            cur = admin.cursor()
            for name in names:
                cur.execute('CREATE DATABASE IF NOT EXISTS `%s`' % name)
            adapters = [self._adapter(db=name) for name in names]
            held = adapters[0].acquire_pack_lock()
            try:
                self.assertIsNotNone(held)
                self.assertIsNone(self._adapter(db=names[0]).acquire_pack_lock())
                other = adapters[1].acquire_pack_lock()
                self.assertIsNotNone(other)
                other.close()
            finally:
                held.close()
        finally:
            for name in names:
                cur.execute('DROP DATABASE IF EXISTS `%s`' % name)
            admin.close()

    def test_silently_dead_networks_are_bounded(self):
        # A helper agent's check: a load and a commit hung for as long as
        # the network stayed silently dead (no reset, nothing
        # acknowledged), the commit lock held meanwhile.  Keepalives and
        # TCP_USER_TIMEOUT now bound it, as on PostgreSQL, on every
        # connection of a storage made from its configuration.
        import socket
        import ZODB.config
        params = self.factory.connect_kwargs()
        if params.get('unix_socket') or params.get('host') in (None, 'localhost'):
            self.skipTest('the server is reached through a Unix socket')
        db = ZODB.config.databaseFromString(
            '%%import relstorage\n<zodb>\n<relstorage>\n keep-history %s\n'
            '<mysql>\n driver %s\n%s</mysql>\n</relstorage>\n</zodb>\n'
            % ('true' if self.keep_history else 'false', self.factory.driver,
               ''.join(' %s %s\n' % (key, value) for key, value in params.items()
                       if value not in (None, ''))))
        self._dbs.append(db)
        with db.transaction() as conn:
            conn.root()['x'] = 1
        adapter = db.storage._adapter
        conns = [adapter.store_sessions.take(), adapter.load_sessions.take()]
        try:
            for conn in conns:
                raw = conn.raw
                fd = raw.fileno() if hasattr(raw, 'fileno') else raw._sock.fileno()
                sock = socket.socket(fileno=os.dup(fd))
                try:
                    self.assertEqual(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE), 1)
                    self.assertEqual(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE), 60)
                    self.assertEqual(
                        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT), 60000)
                finally:
                    sock.close()
        finally:
            adapter.store_sessions.give_back(conns[0])
            adapter.load_sessions.give_back(conns[1])

    def test_connect_timeout_0(self):
        # Accepted by the configuration ("0 or more"), then refused by
        # PyMySQL at open with a ValueError of its own (a helper agent's
        # check).  0 is no limit, as in libmysqlclient.
        adapter = self._adapter(connect_timeout=0)
        conn = adapter.open_store()
        try:
            self.assertEqual(conn.query_value('SELECT 1'), 1)
        finally:
            conn.close()
            adapter.close()

    def test_no_database_or_a_missing_option_file(self):
        # A helper agent's checks: without db, the server's "No database
        # selected" from deep in the driver; a misspelt read_default_file
        # was ignored (and the connection made without the TLS it asks for).
        with self.assertRaises(RelStorageError) as cm:
            self._adapter(db=None)
        self.assertIn('needs db', str(cm.exception))
        missing = os.path.join(tempfile.gettempdir(), 'no-such-option-file.cnf')
        with self.assertRaises(RelStorageError) as cm:
            self._adapter(read_default_file=missing)
        self.assertIn('read_default_file: %s is not a file' % missing, str(cm.exception))
        # (read_default_group: the drivers read the default option files,
        # which may name it; a review finding.)
        self._adapter(db=None, read_default_group='zodb').close()
        # With an option file, the storage's name says what the section
        # sets and where the rest comes from, not a made-up server.
        with tempfile.NamedTemporaryFile('w', suffix='.cnf') as f:
            f.write('[client]\n')
            f.flush()
            adapter = MySQLAdapter(options=Options(), driver=self.factory.driver,
                                   db='zodb', read_default_file=f.name)
            self.assertEqual(adapter.describe(),
                             'MySQL/MariaDB database (db=zodb, the rest from %s)' % f.name)

    def test_a_server_not_reached_yet_is_named_mysql_or_mariadb(self):
        # A helper agent's check: errors before the first connection called
        # a MariaDB server MySQL, and MariaDB once connected.
        adapter = MySQLAdapter(options=Options(), driver=self.factory.driver,
                               host='127.0.0.1', port=9, db='zodb')
        self.assertTrue(adapter.describe().startswith("MySQL/MariaDB database 'zodb'"),
                        adapter.describe())

    def _assert_fails_cleanly(self, adapter, secret=None):
        started = time.time()
        with self.assertRaises(RelStorageError) as cm:
            adapter.prepare_schema()
        self.assertLess(time.time() - started, 11)
        message = str(cm.exception)
        self.assertEqual(len(message.splitlines()), 1, message)
        params = adapter._params
        for part in (params['host'], params['db'], params['user']):
            self.assertIn(str(part), message)
        if secret:
            self.assertNotIn(secret, message)
            self.assertNotIn(secret, repr(cm.exception.args))
        return message

    def test_wrong_password(self):
        secret = 'Not-The-Password-4711'
        message = self._assert_fails_cleanly(self._adapter(passwd=secret), secret)
        self.assertIn('denied', message)

    def test_unknown_database(self):
        message = self._assert_fails_cleanly(self._adapter(db='relstoragetest_no_such_db'))
        self.assertIn('relstoragetest_no_such_db', message)

    def test_incorrect_database_name_is_not_retryable(self):
        # A helper agent's check: a name the server calls incorrect (1102:
        # longer than 64 characters) was a DisconnectedError, which
        # transaction managers retry.
        from transaction.interfaces import TransientError
        name = 'relstoragetest_' + 'y' * 60
        message = self._assert_fails_cleanly(self._adapter(db=name))
        self.assertIn('Incorrect database name', message)
        with self.assertRaises(RelStorageError) as cm:
            self._adapter(db=name).prepare_schema()
        self.assertNotIsInstance(cm.exception, TransientError)

    def test_certificates_that_do_not_verify_are_not_retryable(self):
        # A helper agent's check: TLS errors (2026) were disconnects, which
        # transaction managers and failover retry; certificates that do
        # not verify never will.
        from relstorage.adapters.mysql.drivers import is_config_error
        self.assertTrue(is_config_error(2026, 'SSL connection error: certificate verify failed'))
        self.assertTrue(is_config_error(
            2026, "SSL connection error: error:0A000086:SSL routines::"
                  "certificate verify failed"))
        self.assertTrue(is_config_error(2026, 'SSL connection error: self-signed certificate'))
        self.assertFalse(is_config_error(
            2026, 'SSL connection error: unexpected eof while reading'))
        self.assertTrue(is_config_error(1045, "Access denied for user 'x'"))
        self.assertFalse(is_config_error(2003, "Can't connect to server"))

    def test_a_server_that_never_greets_fails_at_connect_timeout(self):
        # A helper agent's check: with PyMySQL, a server that accepts the
        # connection and never answers held the open for ever.
        import socket
        silent = socket.socket()
        silent.bind(('127.0.0.1', 0))
        silent.listen(5)
        self.addCleanup(silent.close)
        adapter = self._adapter(host='127.0.0.1', port=silent.getsockname()[1],
                                connect_timeout=2)
        started = time.time()
        with self.assertRaises(DisconnectedError):
            adapter.connect('load')
        self.assertLess(time.time() - started, 10)

    def test_localhost_and_ipv6_described_as_reached(self):
        # A helper agent's check: with MySQLdb, host localhost goes to the
        # default Unix socket whatever the port, while the description
        # (and PyMySQL) said localhost:port.
        import logging
        logger = logging.getLogger('relstorage.adapters.mysql.adapter')
        if self.factory.driver == 'MySQLdb':
            with self.assertLogs(logger, logging.WARNING) as logs:
                adapter = self._adapter(host='localhost', port=3307, unix_socket=None)
            self.assertIn('write host 127.0.0.1', '\n'.join(logs.output))
            self.assertIn('default Unix socket', adapter.describe())
        else:
            adapter = self._adapter(host='localhost', port=3307, unix_socket=None)
            self.assertIn('localhost:3307', adapter.describe())
        self.assertIn('[::1]:3307', self._adapter(host='::1', port=3307).describe())

    def test_unreachable_port_is_retryable(self):
        adapter = self._adapter(port=1, connect_timeout=3)
        with self.assertRaises(DisconnectedError):
            adapter.connect('load')

    def test_session_settings(self):
        adapter = self._adapter()
        for purpose in ('load', 'store', 'oid'):
            raw = adapter.connect(purpose)
            cur = raw.cursor()
            cur.execute('SELECT @@session.time_zone, @@session.max_allowed_packet')
            zone, packet = cur.fetchone()
            self.assertEqual(zone, '+00:00')
            self.assertEqual(packet, adapter.max_allowed_packet)
            raw.close()
        self.assertTrue(adapter.describe().startswith(adapter.server.flavor))

    def test_storage_name_says_which_server(self):
        # Regression: a storage without a name was described before its
        # adapter met the server: on MariaDB, "RelStorage on MySQL
        # database ..." (the prefix of zodbpack's messages, which went on
        # "Lost the store connection to MariaDB database ...").  Its sort
        # key (the order of a transaction's votes across databases) is
        # computed then too, once, and its instances share it.
        storage = self.make_storage()
        flavor = storage._adapter.server.flavor
        self.assertTrue(storage.getName().startswith('RelStorage on %s database' % flavor),
                        storage.getName())
        key = storage.sortKey()
        self.assertIn('%s database' % flavor, key)
        instance = storage.new_instance()
        self.assertEqual(instance.sortKey(), key)
        self.assertEqual(instance.getName(), storage.getName())
        instance.release()
        self.assertEqual(storage.sortKey(), key)

    def test_drivers(self):
        self.assertEqual(drivers.canonical_name('PyMySQL'), 'pymysql')
        self.assertEqual(drivers.canonical_name('mysqlclient'), 'MySQLdb')
        with self.assertRaises(RelStorageError):
            drivers.select_driver('psycopg')
        # Every spelling the configuration accepts is one we know.
        for canonical, aliases in config.DRIVER_NAMES['mysql'].items():
            for name in (canonical,) + aliases:
                drivers.canonical_name(name)
        self.assertIsInstance(drivers.select_driver('auto'), drivers.MySQLdbDriver)
        saved = sys.modules.get('pymysql')
        sys.modules['pymysql'] = None          # as if it were not installed
        try:
            with self.assertRaises(RelStorageError) as cm:
                drivers.select_driver('pymysql')
            self.assertIn('not installed', str(cm.exception))
        finally:
            if saved is None:
                del sys.modules['pymysql']
            else:
                sys.modules['pymysql'] = saved

    def test_zconfig(self):
        import ZODB.config
        params = self.factory.connect_kwargs()
        lines = ['host %s' % params['host'], 'port %s' % params['port'],
                 'user %s' % params['user'], 'db %s' % params['db'],
                 'driver %s' % self.factory.driver]
        if params['passwd']:
            lines.append('passwd %s' % params['passwd'])
        db = ZODB.config.databaseFromString(
            "%%import relstorage\n<zodb>\n<relstorage>\nkeep-history false\n"
            "<mysql>\n%s\n</mysql>\n</relstorage>\n</zodb>\n" % '\n'.join(lines))
        self._dbs.append(db)
        with db.transaction() as conn:
            conn.root()['x'] = 1
        with db.transaction() as conn:
            self.assertEqual(conn.root()['x'], 1)
        adapter = db.storage._adapter
        self.assertEqual(adapter.driver.name, drivers.canonical_name(self.factory.driver))
        self.assertFalse(adapter.keep_history)

    def test_refuses_non_innodb_tables(self):
        storage = self.make_storage()
        storage.close()
        conn = admin_connect(self.factory.driver, self.factory.db_name)
        try:
            conn.cursor().execute('ALTER TABLE new_oid ENGINE = MyISAM')
        finally:
            conn.close()
        with self.assertRaises(SchemaMismatchError) as cm:
            self.make_storage()
        self.assertIn('InnoDB', str(cm.exception))

    def test_mode_mismatch_leaves_database_alone(self):
        self.make_storage(keep_history=True).close()
        with self.assertRaises(SchemaMismatchError):
            self.make_storage(keep_history=False)


class DiskFullTests(MySQLTestCase):

    def test_a_server_out_of_disk_space_is_named(self):
        # A helper agent's check (on PostgreSQL and SQLite): a full disk
        # gave the driver's bare error.  Here a trigger answers the move
        # into place with MariaDB's own (1021, ER_DISK_FULL).
        from relstorage.interfaces import DatabaseFullError
        db = self.make_db()
        with db.transaction() as conn:
            conn.root()['kept'] = PersistentMapping(v='kept')
        other = admin_connect(self.factory.driver, self.factory.db_name)
        self.addCleanup(other.close)
        cur = other.cursor()
        cur.execute("CREATE TRIGGER disk_full BEFORE INSERT ON object_state FOR EACH ROW "
                    "SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = 1021, MESSAGE_TEXT = "
                    "'Disk full (/var/tmp/#sql-temptable.MAI); waiting for someone to free "
                    "some space... (errno: 28 \"No space left on device\")'")
        other.commit()
        message = refused_commit(
            self, db, lambda root: root.update(new=PersistentMapping(v='new')),
            DatabaseFullError)
        self.assertIn("%s has no room left (" % db.storage._adapter.describe(), message)
        self.assertIn('Disk full', message)
        with db.transaction() as conn:
            self.assertEqual(conn.root()['kept']['v'], 'kept')
            self.assertNotIn('new', conn.root())
        cur.execute("DROP TRIGGER disk_full")
        other.commit()
        with db.transaction() as conn:
            conn.root()['new'] = PersistentMapping(v='new')


class VoteLockErrorTests(MySQLTestCase):
    """A lock timeout or deadlock in a statement of the vote other than
    the locking ones is a retryable ConflictError, not the driver's error
    (a helper agent's check: the deletion of a written blob's old chunks
    deadlocked with a pack batch; MySQLdb's OperationalError 1213 reached
    the application, and attempts() did not retry it)."""
    keep_history = False

    def test_blob_chunks_held_by_another_session(self):
        from ZODB.blob import Blob
        from relstorage.interfaces import UnableToLockRowsError
        blob_dir = tempfile.mkdtemp(prefix='relstoragetest_blobs_')
        self.addCleanup(shutil.rmtree, blob_dir, True)
        db = self.make_db(blob_dir=blob_dir, shared_blob_dir=False, commit_lock_timeout=1)
        with db.transaction() as conn:
            conn.root()['b'] = Blob(b'first')
        with db.transaction() as conn:
            oid = u64(conn.root()['b']._p_oid)
        other = admin_connect(self.factory.driver, self.factory.db_name)
        self.addCleanup(other.close)
        cur = other.cursor()
        cur.execute('CREATE TABLE scratch (x INTEGER) ENGINE = InnoDB')
        cur.execute('START TRANSACTION')
        # (Heavier than the commit: InnoDB rolls back the lighter one of a
        # deadlock, so the commit is its victim, as it was the pack's.)
        cur.execute('INSERT INTO scratch VALUES ' + ','.join(['(1)'] * 5000))
        cur.execute('SELECT zoid FROM blob_chunk WHERE zoid = %s FOR UPDATE', (oid,))
        tm = transaction.TransactionManager()
        conn = db.open(tm)
        tm.begin()
        with conn.root()['b'].open('w') as f:
            f.write(b'second')

        def wait_for_the_commit_lock():
            # The commit, under the commit lock, waits for the chunks this
            # session holds; this session now waits for the commit lock.
            time.sleep(1.0)
            cur.execute('SELECT tid FROM commit_lock WHERE id = 0 FOR UPDATE')
        waiter = threading.Thread(target=wait_for_the_commit_lock)
        waiter.start()
        started = time.monotonic()
        try:
            with self.assertRaises(UnableToLockRowsError) as cm:
                tm.commit()
        finally:
            waiter.join(60)
        tm.abort()
        self.assertLess(time.monotonic() - started, 30)
        self.assertIn('lock timeout or deadlock', str(cm.exception))
        cur.execute('ROLLBACK')
        # Its retry passes.
        tm.begin()
        with conn.root()['b'].open('w') as f:
            f.write(b'second')
        tm.commit()
        conn.close()
        with db.transaction() as c:
            with c.root()['b'].open() as f:
                self.assertEqual(f.read(), b'second')


class OidBlockTests(MySQLTestCase):
    """OIDs: each round trip is a durable commit of the OID connection,
    so a process allocating many draws more counter values per trip (a
    multi-row INSERT: consecutive values), never overlapping another
    process's, and the counter table stays small."""
    keep_history = False

    def _adapter(self):
        adapter = MySQLAdapter(options=self.make_options(), driver=self.factory.driver,
                               **self.factory.connect_kwargs())
        adapter.prepare_schema()
        self.addCleanup(adapter.close)
        calls = []
        record_calls(adapter, 'allocate_oid_block', calls)
        return adapter, calls

    def test_blocks_grow_and_never_overlap(self):
        one, calls = self._adapter()
        two, _ = self._adapter()
        first = [one.new_oid() for _ in range(5000)]
        self.assertEqual(first, sorted(set(first)))
        # 128 + 256 + 512 + 1024 + 2048 + 2048 >= 5000: six round trips,
        # not forty.
        self.assertEqual(len(calls), 6)
        mixed = []
        for _ in range(5000):
            mixed.append(one.new_oid())
            mixed.append(two.new_oid())
        self.assertEqual(len(set(first + mixed)), len(first) + len(mixed))
        rows = self.factory.admin_query('SELECT COUNT(*) FROM %s.new_oid'
                                        % self.factory.db_name)[0][0]
        self.assertLessEqual(rows, 2 * mysql_sql.OID_PRUNE_EVERY)
        one.close()
        two.close()
        three, _ = self._adapter()          # a later process
        self.assertGreater(three.new_oid(), max(first + mixed))

    def test_values_apart_draw_one_block_per_trip(self):
        # A step other than 1 (Galera gives each node its own) would give
        # a multi-row INSERT values apart: the blocks between them belong
        # to other sessions.
        adapter, _ = self._adapter()
        raw = adapter.connect('oid')
        try:
            self.assertEqual(adapter._consecutive_values(raw), mysql_sql.OID_VALUES_MAX)
            cur = raw.cursor()
            cur.execute('SET SESSION auto_increment_increment = 2')
            cur.close()
            self.assertEqual(adapter._consecutive_values(raw), 1)
        finally:
            raw.close()


class PrivilegeTests(PackPrivilegeCases, unittest.TestCase):
    """PackPrivilegeCases on MySQL: a user of its own, with the rows and
    temporary tables of a database, not CREATE."""
    factory = None
    PASSWORD = 'app-Pw-0'
    refused_per_statement = False  # (the database, at connect)

    def setUp(self):
        import uuid
        self.dbname = 'relstoragetest_priv_%s' % uuid.uuid4().hex[:8]
        self.user = self.app_user = 'rstest_app_%s' % uuid.uuid4().hex[:6]
        self.factory.admin_query('CREATE DATABASE %s' % self.dbname)
        self.factory.admin_query("CREATE USER '%s'@'%%' IDENTIFIED BY '%s'"
                                 % (self.user, self.PASSWORD))

    def tearDown(self):
        transaction.abort()
        self.factory.admin_query('DROP DATABASE IF EXISTS %s' % self.dbname)
        self.factory.admin_query("DROP USER IF EXISTS '%s'@'%%'" % self.user)

    def test_a_table_the_user_may_not_use_is_named_as_such(self):
        # A helper agent's check: a user granted table by table, all but
        # one, was told the schema lacked it (history-preserving: "holds a
        # history-free schema ... set keep-history to match"): MySQL lists
        # to a user only the tables it may use.
        import tempfile
        self.db(True).close()
        tables = [row[0] for row in self.factory.admin_query(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
            (self.dbname,))]
        self.assertIn('blob_chunk', tables)
        for table in tables:
            if table == 'blob_chunk':
                continue
            self.factory.admin_query("GRANT SELECT, INSERT, UPDATE, DELETE ON %s.%s TO '%s'@'%%'"
                                     % (self.dbname, table, self.user))
        self.factory.admin_query("GRANT CREATE TEMPORARY TABLES ON %s.* TO '%s'@'%%'"
                                 % (self.dbname, self.user))
        blobs = tempfile.mkdtemp(prefix='relstoragetest_blobs_')
        self.addCleanup(shutil.rmtree, blobs, True)
        with self.assertRaises(Exception) as raised:
            self.db(False, 'blob-dir %s\n' % blobs).close()
        self.assertIn('has no blob_chunk table', str(raised.exception))
        self.assertIn('If the table blob_chunk is there, this user has no privilege on it',
                      str(raised.exception))

    def db(self, owner, more=''):
        import ZODB.config
        params = server_params()
        user, password = ((params['user'], params['passwd']) if owner
                          else (self.user, self.PASSWORD))
        text = ("%%import relstorage\n<zodb>\n<relstorage>\n keep-history false\n"
                " create-schema %s\n%s <mysql>\n  driver %s\n  host %s\n  port %d\n"
                "  db %s\n  user %s\n" % ('true' if owner else 'false', more,
                                          self.factory.driver, params['host'], params['port'],
                                          self.dbname, user))
        if password:
            text += '  passwd %s\n' % password
        return ZODB.config.databaseFromString(text + " </mysql>\n</relstorage>\n</zodb>\n")

    def grant(self, temporary=True):
        self.factory.admin_query(
            "GRANT SELECT, INSERT, UPDATE, DELETE%s ON %s.* TO '%s'@'%%'"
            % (', CREATE TEMPORARY TABLES' if temporary else '', self.dbname, self.user))


EXTRA_CASES = (ParallelVoteTests, LockTimeoutTests, MultiProcessTests,
               DisconnectTests, LargeStateTests, ConnectionSettingsTests,
               OidBlockTests, PrivilegeTests, VoteLockErrorTests, DiskFullTests)


# ----------------------------------------------------------------------

def _failing(label, reason):
    return suite.cannot_run(__name__, 'ServerUnavailable_%s' % label,
                            'test_mysql_server_available', reason)


def _rehome(tests, factory):
    """Give the shared-suite tests ids under this module (and unique per
    driver), so ``-t test_mysql`` selects them."""
    for test in tests:
        if isinstance(test, unittest.TestSuite):
            _rehome(test, factory)
        elif hasattr(test, '_dt_test'):
            if not test._dt_test.name.startswith(__name__):
                test._dt_test.name = '%s.%s.%s' % (
                    __name__, factory.name.replace('-', '_'), test._dt_test.name)
        else:
            cls = type(test)
            if cls.__module__ != __name__:
                cls.__module__ = __name__


def _wanted():
    selected = os.environ.get('RS_TEST_DATABASES')
    if selected is None:
        return True
    return 'mysql' in selected.lower().replace(',', ' ').split()


def _test_suite():
    tests = unittest.TestSuite()
    if not _wanted():
        return tests
    for driver in DRIVERS:
        label = driver
        try:
            drivers.select_driver(driver)
        except RelStorageError as exc:
            tests.addTest(_failing(label, str(exc)))
            continue
        factory = MySQLFactory(driver, 'relstoragetest_%d_%s' % (os.getpid(), driver.lower()))
        factory.secondary_driver = driver != DRIVERS[0]
        try:
            factory.admin()
        except Exception as exc:  # pylint:disable=broad-except
            params = server_params()
            tests.addTest(_failing(label, (
                "Cannot reach the MySQL/MariaDB server at %s:%s as %r with %s: %s "
                "(set RS_MYSQL_HOST/PORT/USER/PASSWD, or RS_TEST_DATABASES without "
                "mysql to skip)" % (params['host'], params['port'], params['user'],
                                    driver, exc))))
            continue
        driver_suite = suite.make_suite(factory, extra_cases=EXTRA_CASES)
        _rehome(driver_suite, factory)
        tests.addTest(driver_suite)
    return tests


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
