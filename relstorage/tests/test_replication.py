"""Server restarts, replicas and failover, on servers the suite starts itself.

Nothing here touches the machine's own database servers (or a staging
server named by RS_PG_DSN / RS_MYSQL_*): the private PostgreSQL primary
and hot standby, and the private MariaDB primary and replica, come from
``private_servers`` and live on spare ports under a temporary directory.
When they cannot start, every test here is skipped, saying why.
"""
import os
import unittest

import transaction
import transaction.interfaces
import ZODB
from persistent.mapping import PersistentMapping
from ZODB.Connection import TransactionMetaData
from ZODB.tests.MinPO import MinPO
from ZODB.tests.StorageTestBase import zodb_pickle
from ZODB.utils import p64
from ZODB.utils import u64
from ZODB.utils import z64

from relstorage.options import Options
from relstorage.storage import RelStorage

from .private_servers import MariaDBReplicationLayer
from .private_servers import PostgreSQLReplicationLayer


class _PrivateCase(unittest.TestCase):
    """Storages on the private servers; each test starts from an empty schema."""

    keep_history = True

    def setUp(self):
        self.pair = self.layer.require(self)
        self._closing = []
        self.make_adapter(self.primary_server(), Options(keep_history=self.keep_history)
                          ).drop_all()

    def tearDown(self):
        transaction.abort()
        for thing in reversed(self._closing):
            try:
                thing.close()
            except Exception:  # pylint:disable=broad-except
                pass

    def storage(self, server=None, **kw):
        kw.setdefault('keep_history', self.keep_history)
        kw.setdefault('commit_lock_timeout', 10)
        options = Options(**kw)
        storage = RelStorage(self.make_adapter(server or self.primary_server(), options),
                             options=options)
        self._closing.append(storage)
        return storage

    def db(self, storage=None, **kw):
        db = ZODB.DB(storage if storage is not None else self.storage(**kw))
        self._closing.append(db)
        return db

    def make_objects(self, storage, count):
        oids = [storage.new_oid() for _ in range(count)]
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        for i, oid in enumerate(oids):
            storage.store(oid, z64, zodb_pickle(MinPO(i)), '', txn)
        storage.tpc_vote(txn)
        return oids, storage.tpc_finish(txn)

    def begin_store(self, storage, oid, serial, value):
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        storage.store(oid, serial, zodb_pickle(MinPO(value)), '', txn)
        return txn

    def restart_primary(self):
        self.pair.restart_server('primary')

    def check_restart_mid_session(self):
        db = self.db()
        tm = transaction.TransactionManager()
        conn = db.open(tm)
        with tm:
            conn.root()['a'] = PersistentMapping(n=1)
        storage = self.storage()
        (x,), tid0 = self.make_objects(storage, 1)
        in_flight = self.begin_store(storage, x, tid0, 'in flight')
        storage.tpc_vote(in_flight)

        self.restart_primary()

        # The voted transaction was lost with the server: a retryable error,
        # and nothing of it committed.
        with self.assertRaises(transaction.interfaces.TransientError):
            storage.tpc_finish(in_flight)
        storage.tpc_abort(in_flight)
        self.assertEqual(storage.loadBefore(x, p64(u64(storage.lastTransaction()) + 1))[1],
                         tid0)
        # The same process carries on: loads, new OIDs and commits work.
        with tm:
            root = conn.root()
            self.assertEqual(root['a']['n'], 1)
            root['a']['n'] = 2
            root['b'] = PersistentMapping(n=3)
        conn.close()
        with db.transaction() as conn2:
            self.assertEqual((conn2.root()['a']['n'], conn2.root()['b']['n']), (2, 3))


class _PostgreSQL:
    layer = PostgreSQLReplicationLayer

    def primary_server(self):
        return 'primary'

    def make_adapter(self, server, options):
        from relstorage.adapters.postgresql.adapter import PostgreSQLAdapter
        return PostgreSQLAdapter(dsn=self.pair.dsn(server), options=options)


class _MariaDB:
    layer = MariaDBReplicationLayer

    def primary_server(self):
        return 'primary'

    def make_adapter(self, server, options):
        from relstorage.adapters.mysql.adapter import MySQLAdapter
        return MySQLAdapter(options=options, **self.pair.params(server))


class PostgreSQLServerRestartTests(_PostgreSQL, _PrivateCase):
    """The private primary restarts (pg_ctl restart) mid-session."""

    def test_server_restart_mid_session(self):
        self.check_restart_mid_session()


class MariaDBServerRestartTests(_MariaDB, _PrivateCase):
    """The private primary shuts down and starts again mid-session."""

    def test_server_restart_mid_session(self):
        self.check_restart_mid_session()


def _wanted(name):
    names = os.environ.get('RS_TEST_DATABASES')
    return not names or name in [n.strip() for n in names.split(',')]


def test_suite():
    suite = unittest.TestSuite()
    loader = unittest.defaultTestLoader
    if _wanted('postgresql'):
        for cls in (PostgreSQLServerRestartTests,):
            suite.addTest(loader.loadTestsFromTestCase(cls))
    if _wanted('mysql'):
        for cls in (MariaDBServerRestartTests,):
            suite.addTest(loader.loadTestsFromTestCase(cls))
    return suite
