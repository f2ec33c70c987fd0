"""The shared cache on memcached, against a real memcached started here.

Each test starts its own server on a free 127.0.0.1 port and stops it.
"""
import os
import shutil
import subprocess
import unittest

from ZODB.utils import u64

from relstorage.cache.memcache import parse_servers
from relstorage.cache.shared import open_shared_cache
from relstorage.tests.shared_cache import SharedCacheTests
from relstorage.tests.shared_cache import free_port
from relstorage.tests.shared_cache import wait_for_port

MEMCACHED = shutil.which('memcached') or '/usr/bin/memcached'


class MemcachedServer:

    def __init__(self):
        self.port = free_port()
        self.start()

    def start(self):
        args = [MEMCACHED, '-l', '127.0.0.1', '-p', str(self.port), '-U', '0', '-m', '16']
        if os.geteuid() == 0:
            args += ['-u', 'root']
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for_port(self.port, self.proc, 'memcached')

    @property
    def address(self):
        return '127.0.0.1:%d' % self.port

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc.stderr.close()


@unittest.skipUnless(os.path.exists(MEMCACHED), 'memcached is not installed')
class MemcacheTests(SharedCacheTests):

    def setUp(self):
        super().setUp()
        self.server = self.private_server()
        self.servers = self.server.address

    def private_server(self):
        server = MemcachedServer()
        self.addCleanup(server.stop)
        return server

    def dead_servers(self):
        return '127.0.0.1:%d' % free_port()

    def test_a_restart_fails_one_request_not_one_per_pooled_connection(self):
        # A helper agent's check: after memcached restarted, each
        # connection of the client's pool failed in turn, each time
        # leaving the server unused for RETRY_AFTER (and, between requests
        # of other threads that worked, warning again).
        from relstorage.cache import shared
        self.addCleanup(setattr, shared, 'RETRY_AFTER', shared.RETRY_AFTER)
        shared.RETRY_AFTER = 0
        server = self.private_server()
        storage = self.storage(cache_servers=server.address)
        oid = storage.new_oid()
        tid = self.commit(storage, {oid: 'shared'})
        cache = storage._cache.shared
        # Three connections in the pool, as three threads would leave.
        pool = cache._servers[0].client.client_pool
        held = [pool.get() for _ in range(3)]
        for client in held:
            client.version()
        for client in held:
            pool.release(client)
        server.stop()
        server.start()                  # the same port, empty
        errors = cache.errors
        for _ in range(4):
            self.assertIsNone(cache.get(u64(oid), u64(tid)))
        self.assertEqual(cache.errors - errors, 1)

    def test_parse_servers(self):
        self.assertEqual(parse_servers('a:1 b:2 [::1]:3 c'),
                         [('a', 1), ('b', 2), ('::1', 3), ('c', 11211)])
        with self.assertRaisesRegex(ValueError, "'a:b' is not host:port"):
            parse_servers('a:b')
        with self.assertRaisesRegex(ValueError, 'cache-module-name'):
            open_shared_cache('a:1', 'memcache_client_of_the_future')
        # A helper agent's check: entries separated by a comma were taken
        # for one host named 'a:1,b', and the cache silently not used.
        self.assertEqual(parse_servers('a:1,b:2, c:3'), [('a', 1), ('b', 2), ('c', 3)])
        with self.assertRaisesRegex(ValueError, "'a:1:2' is not host:port"):
            parse_servers('a:1:2')

    def test_servers_separated_by_commas(self):
        storage = self.storage(cache_servers='%s,%s' % (self.servers, self.servers))
        oid = storage.new_oid()
        tid = self.commit(storage, {oid: 'shared'})
        other = self.storage()
        self.assertEqual(self.read_all(other, [oid]), [('shared', tid)])
        self.assertEqual(other.cache_stats()['db_loads'], 0)

    def test_pylibmc_not_installed(self):
        # Regression: a bare ModuleNotFoundError when the storage opened.
        try:
            import pylibmc  # noqa: F401 pylint:disable=unused-import
        except ImportError:
            pass
        else:
            self.skipTest('pylibmc is installed')
        with self.assertRaisesRegex(ValueError, 'cache-module-name pylibmc, but the '
                                    'pylibmc package is not installed'):
            open_shared_cache(self.servers, 'pylibmc')


def _test_suite():
    return unittest.TestLoader().loadTestsFromTestCase(MemcacheTests)


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
