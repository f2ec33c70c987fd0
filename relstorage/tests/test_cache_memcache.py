"""memcached as a shared state cache, against a real memcached started here.

The server listens on 127.0.0.1 on a free port and is stopped by the test
(also mid-run, to check that reads go on from the database).
"""
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import unittest

import transaction
from ZODB.Connection import TransactionMetaData
from ZODB.tests.MinPO import MinPO
from ZODB.tests.StorageTestBase import zodb_pickle
from ZODB.tests.StorageTestBase import zodb_unpickle
from ZODB.utils import u64
from ZODB.utils import z64

from relstorage.adapters.sqlite.adapter import Sqlite3Adapter
from relstorage.cache.memcache import MemcacheStateCache
from relstorage.cache.memcache import parse_servers
from relstorage.options import Options
from relstorage.storage import RelStorage

MEMCACHED = shutil.which('memcached') or '/usr/bin/memcached'


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class MemcachedServer:

    def __init__(self):
        self.port = free_port()
        args = [MEMCACHED, '-l', '127.0.0.1', '-p', str(self.port), '-U', '0', '-m', '16']
        if os.geteuid() == 0:
            args += ['-u', 'root']
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 10
        while True:
            try:
                socket.create_connection(('127.0.0.1', self.port), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    err = self.proc.stderr.read().decode(errors='replace')
                    raise RuntimeError('memcached did not start: %s' % err)
                time.sleep(0.05)

    @property
    def address(self):
        return '127.0.0.1:%d' % self.port

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc.stderr.close()


@unittest.skipUnless(os.path.exists(MEMCACHED), 'memcached is not installed')
class MemcacheTests(unittest.TestCase):

    def setUp(self):
        self.server = MemcachedServer()
        self.tmp = tempfile.mkdtemp(prefix='relstoragetest_mc_')
        self._closables = []

    def tearDown(self):
        transaction.abort()
        for thing in reversed(self._closables):
            thing.close()
        self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def storage(self, **kw):
        kw.setdefault('cache_servers', self.server.address)
        kw.setdefault('cache_prefix', 'test')
        options = Options(**kw)
        storage = RelStorage(Sqlite3Adapter(os.path.join(self.tmp, 'data'), options=options),
                             options=options)
        self._closables.append(storage)
        return storage

    def commit(self, storage, values, serials=None):
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        for oid, value in values.items():
            storage.store(oid, (serials or {}).get(oid, z64),
                          zodb_pickle(MinPO(value)), '', txn)
        storage.tpc_vote(txn)
        return storage.tpc_finish(txn)

    def test_client_round_trip_and_keys(self):
        client = MemcacheStateCache(self.server.address, None, 'pfx')
        self._closables.append(client)
        self.assertEqual(client.key(0x1f, 0xabc), 'pfx:s:1f:abc')
        client.set_many({(1, 10): b'one', (2, 10): b'two'})
        self.assertEqual(client.get(1, 10), b'one')
        self.assertIsNone(client.get(1, 11))               # another revision
        self.assertEqual(client.get_many([(1, 10), (2, 10), (3, 10)]),
                         {(1, 10): b'one', (2, 10): b'two'})
        other = MemcacheStateCache(self.server.address, None, 'other')
        self._closables.append(other)
        self.assertIsNone(other.get(1, 10))                # another prefix
        self.assertEqual(parse_servers('a:1 b:2'), [('a', 1), ('b', 2)])

    def test_other_process_reads_what_one_committed(self):
        writer, reader = self.storage(), self.storage()
        oids = [writer.new_oid() for _ in range(20)]
        inst = reader.new_instance()
        inst.poll_invalidations()
        tid = self.commit(writer, {oid: i for i, oid in enumerate(oids)})
        # The reader learns the new tids from its poll; the states come from
        # memcached (the writer put them there when it committed).
        self.assertEqual(sorted(inst.poll_invalidations()), sorted(oids))
        for i, oid in enumerate(oids):
            state, serial = inst.load(oid)
            self.assertEqual((zodb_unpickle(state).value, serial), (i, tid))
        stats = reader.cache_stats()
        self.assertEqual(stats['db_loads'], 0)
        self.assertEqual(stats['memcache']['hits'], 20)
        inst.release()

    def test_committed_states_are_in_memcached_when_commit_returns(self):
        # Regression: committed states used to be sent without waiting for
        # memcached's reply, so a process that polled right after the commit
        # could ask memcached before the set had been processed, and read
        # from the database (seen once in CI).
        writer, reader = self.storage(), self.storage()
        oids = [writer.new_oid() for _ in range(10)]
        inst = reader.new_instance()
        inst.poll_invalidations()
        for rnd in range(40):
            tid = self.commit(writer, {oid: rnd for oid in oids},
                              serials=None if rnd == 0 else {oid: last for oid in oids})
            last = tid
            self.assertEqual(sorted(inst.poll_invalidations()), sorted(oids))
            for oid in oids:
                self.assertEqual(inst.load(oid)[1], tid)
        self.assertEqual(reader.cache_stats()['db_loads'], 0)
        inst.release()

    def test_states_read_from_the_database_are_shared(self):
        plain = self.storage(cache_servers=None)         # commits without memcached
        first, second = self.storage(), self.storage()
        oids = [plain.new_oid() for _ in range(5)]
        inst2 = second.new_instance()
        inst2.poll_invalidations()
        tid = self.commit(plain, {oid: 'v' for oid in oids})
        inst1 = first.new_instance()
        inst1.poll_invalidations()
        for oid in oids:
            self.assertEqual(inst1.load(oid)[1], tid)
        self.assertEqual(first.cache_stats()['db_loads'], 5)
        inst1.poll_invalidations()                         # sends the batch
        # Sets do not wait for replies: let the server catch up.
        client = first._cache.memcache
        deadline = time.time() + 5
        while client.get(u64(oids[-1]), u64(tid)) is None and time.time() < deadline:
            time.sleep(0.01)
        inst2.poll_invalidations()                         # learns the tids
        for oid in oids:
            self.assertEqual(inst2.load(oid)[1], tid)
        self.assertEqual(second.cache_stats()['db_loads'], 0)
        self.assertEqual(second.cache_stats()['memcache']['hits'], 5)
        inst1.release()
        inst2.release()

    def test_memcached_stopped_mid_run(self):
        writer, reader = self.storage(), self.storage()
        oids = [writer.new_oid() for _ in range(10)]
        inst = reader.new_instance()
        inst.poll_invalidations()
        tid = self.commit(writer, {oid: 'a' for oid in oids})
        inst.poll_invalidations()
        self.assertEqual(inst.load(oids[0])[1], tid)
        self.server.stop()
        tid2 = self.commit(writer, {oid: 'b' for oid in oids}, {oid: tid for oid in oids})
        logger = logging.getLogger('relstorage.cache.memcache')
        with self.assertLogs(logger, logging.WARNING) as logs:
            inst.poll_invalidations()
            for oid in oids:
                state, serial = inst.load(oid)
                self.assertEqual((zodb_unpickle(state).value, serial), ('b', tid2))
            reader._cache.local.clear()
            for oid in oids:
                self.assertEqual(zodb_unpickle(inst.load(oid)[0]).value, 'b')
        warnings = [r for r in logs.records if r.levelno >= logging.WARNING]
        self.assertEqual(len(warnings), 1, logs.output)
        self.assertIn('unavailable', warnings[0].getMessage())
        self.assertTrue(reader.cache_stats()['memcache']['errors'] >= 1)
        inst.release()

    def test_memcached_never_running(self):
        port = free_port()
        storage = self.storage(cache_servers='127.0.0.1:%d' % port)
        oid = storage.new_oid()
        tid = self.commit(storage, {oid: 1})
        storage._cache.local.clear()
        self.assertEqual(storage.load(oid)[1], tid)


def test_suite():
    return unittest.TestLoader().loadTestsFromTestCase(MemcacheTests)
