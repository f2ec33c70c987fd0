"""The shared cache on Redis, against the machine's Redis server.

The server is ``RS_REDIS_URL`` (default ``redis://127.0.0.1:6379/0``),
shared with other users: every test writes under a key prefix of its own
(with the process id in it) and deletes only the keys under it, never
FLUSHDB.  Tests that stop a server, need a password or TLS start their own
``redis-server`` on a free port.  Without the ``redis`` package or a
reachable server the tests are skipped, saying why (``make test`` starts
the server; see relstorage/tests/servers.py).
"""
import itertools
import logging
import os
import shutil
import subprocess
import textwrap
import threading
import unittest

import ZODB.config
from persistent.mapping import PersistentMapping

from relstorage.cache.redis_cache import EXPIRE
from relstorage.cache.redis_cache import parse_url
from relstorage.cache.shared import open_shared_cache
from relstorage.tests.shared_cache import SharedCacheTests
from relstorage.tests.shared_cache import free_port
from relstorage.tests.shared_cache import wait_for_port
from relstorage.tests.servers import redis_url

REDIS_SERVER = shutil.which('redis-server') or '/usr/bin/redis-server'
PASSWORD = 's3cret-Pw'


try:
    import redis
    HAVE_REDIS = True
except ImportError:
    HAVE_REDIS = False


def _unavailable():
    """Why the Redis tests cannot run here, or None."""
    if not HAVE_REDIS:
        return 'the redis package is not installed (pip install relstorage[redis])'
    url = redis_url()
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # pylint:disable=broad-except
        return 'Redis at %s is not reachable (%s); start it or set RS_REDIS_URL' % (
            parse_url(url), exc)
    return None


UNAVAILABLE = _unavailable()


def delete_keys(url, pattern):
    """Delete the keys matching ``pattern`` (and only those)."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=pattern, count=1000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start:start + 1000])
    finally:
        client.close()


class RedisServer:
    """A redis-server of the test's own on a free port."""

    def __init__(self, tmp, *args, tls=False):
        self.port = free_port()
        port_args = (['--port', '0', '--tls-port', str(self.port)] if tls
                     else ['--port', str(self.port)])
        self.cmd = [REDIS_SERVER, '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no',
                    '--dir', tmp] + port_args + list(args)
        self.start()
        self.scheme = 'rediss' if tls else 'redis'

    def start(self):
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        wait_for_port(self.port, self.proc, 'redis-server')

    @property
    def address(self):
        return '%s://127.0.0.1:%d/0' % (self.scheme, self.port)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc.stderr.close()


@unittest.skipIf(UNAVAILABLE, UNAVAILABLE)
class RedisTests(SharedCacheTests):

    _numbers = itertools.count()

    def setUp(self):
        super().setUp()
        self.servers = redis_url()
        # Ends with a letter: cache-prefix values are used as they are
        # only when they need no cleaning (storage_cache.safe_prefix).
        self.prefix = 'relstoragetest_%d_%d_t' % (os.getpid(), next(self._numbers))
        self._urls = {self.servers}
        self.addCleanup(self._delete_own_keys)

    def _delete_own_keys(self):
        for url in self._urls:
            delete_keys(url, self.prefix + '*')

    def private_server(self, *args, tls=False):
        if not os.path.exists(REDIS_SERVER):
            self.skipTest('redis-server is not installed')
        server = RedisServer(self.tmp, *args, tls=tls)
        self.addCleanup(server.stop)
        return server

    def dead_servers(self):
        return 'redis://127.0.0.1:%d/0' % free_port()

    def other_database(self, number):
        base = self.servers.rsplit('/', 1)[0] if self.servers.count('/') > 2 else self.servers
        url = '%s/%d' % (base, number)
        self._urls.add(url)
        return url

    # ------------------------------------------------------------------

    def test_several_servers_share_the_keys(self):
        # Keys are spread over the servers (here two databases of one
        # server), and each client finds them where it put them.
        servers = '%s %s' % (self.other_database(14), self.other_database(15))
        client = self.client(servers=servers)
        states = {(oid, 1): b'state %d' % oid for oid in range(50)}
        client.set_many(states, wait=True)
        self.assertEqual(client.get_many(list(states)), states)
        self.assertEqual(client.stats()['servers'],
                         [parse_url(url) for url in servers.split()])
        alone = self.client(servers=self.other_database(14))
        found = alone.get_many(list(states))
        self.assertTrue(0 < len(found) < 50, len(found))

    def test_server_restart_costs_no_miss(self):
        # Connections the server closed are replaced on the next request,
        # which is answered: no error, no warning, no fallback.
        server = self.private_server()
        client = self.client(servers=server.address)
        client.set_many({(1, 1): b'before'}, wait=True)
        self.assertEqual(client.get(1, 1), b'before')
        server.stop()
        server.start()
        with self.assertNoLogs('relstorage.cache', logging.WARNING):
            client.set_many({(1, 2): b'after'}, wait=True)
        self.assertEqual(client.get(1, 2), b'after')
        self.assertEqual(client.stats()['errors'], 0)

    def test_a_database_number_the_server_lacks_is_warned_about(self):
        # A helper agent's check: redis://host/99999 (the server has 16
        # databases) failed every request with "DB index is out of range",
        # logged at DEBUG only: the shared cache silently never worked.
        base = self.servers.rsplit('/', 1)[0] if self.servers.count('/') > 2 else self.servers
        client = self.client(servers=base + '/99999')
        with self.assertLogs('relstorage.cache', logging.WARNING) as logged:
            client.set_many({(1, 1): b'x'}, wait=True)
            self.assertEqual(client.get_many([(1, 1)]), {})
        self.assertIn('DB index is out of range', '\n'.join(logged.output))
        self.assertEqual(len(logged.output), 1, logged.output)

    def test_threads_share_a_client(self):
        client = self.client()
        failures = []

        def work(number):
            for rnd in range(100):
                states = {(number, rnd): b'%d-%d' % (number, rnd),
                          (number, rnd + 1000): b'x' * rnd}
                client.set_many(states, wait=True)
                if client.get_many(list(states)) != states:
                    failures.append((number, rnd))

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(failures, [])
        self.assertEqual(client.stats()['errors'], 0)

    def test_keys_expire(self):
        client = self.client()
        client.set_many({(1, 2): b'state'}, {1: (2, 2)}, wait=True)
        raw = redis.Redis.from_url(self.servers)
        try:
            for key in (client.key(1, 2), client.hint_key(1)):
                self.assertTrue(0 < raw.ttl(key) <= EXPIRE, key)
        finally:
            raw.close()

    def open_db(self, servers):
        text = textwrap.dedent("""\
            %%import relstorage
            <zodb>
              <relstorage>
                cache-servers %s
                cache-prefix %s
                <sqlite3>
                  data-dir %s
                </sqlite3>
              </relstorage>
            </zodb>
            """) % (servers, self.prefix, os.path.join(self.tmp, 'data'))
        db = ZODB.config.databaseFromString(text)
        self._closables.append(db)
        return db

    def test_password_from_the_url_is_used_and_never_logged(self):
        server = self.private_server('--requirepass', PASSWORD)
        url = 'redis://:%s@127.0.0.1:%d/0' % (PASSWORD, server.port)
        handler = _Capture()
        root = logging.getLogger()
        old_level = root.level
        root.addHandler(handler)
        root.setLevel(logging.DEBUG)
        try:
            writer = self.open_db(url)
            with writer.transaction() as conn:
                conn.root()['doc'] = PersistentMapping(title='shared')
            reader = self.open_db(url)
            with reader.transaction() as conn:
                self.assertEqual(conn.root()['doc']['title'], 'shared')
            stats = reader.storage.cache_stats()
            # From Redis, with the password: nothing from the database.
            self.assertEqual(stats['db_loads'], 0)
            self.assertGreaterEqual(stats['shared']['hits'], 2)
            wrong = self.open_db(url.replace(PASSWORD, 'Wr0ng-pw'))
            with wrong.transaction() as conn:
                self.assertEqual(conn.root()['doc']['title'], 'shared')
            wrong_stats = wrong.storage.cache_stats()
            self.assertGreaterEqual(wrong_stats['shared']['errors'], 1)
            shown = [repr(writer.storage._options), repr(stats), repr(wrong_stats)]
            for db in (writer, reader, wrong):
                db.close()
        finally:
            root.removeHandler(handler)
            root.setLevel(old_level)
        self.assertTrue(any('is unavailable' in m and 'redis://127.0.0.1:%d/0' % server.port
                            in m for m in handler.messages), handler.messages)
        for text in handler.messages + shown:
            self.assertNotIn(PASSWORD, text)
            self.assertNotIn('Wr0ng-pw', text)

    def test_tls(self):
        if not shutil.which('openssl'):
            self.skipTest('openssl is not installed (needed to make a certificate)')
        cert, key = os.path.join(self.tmp, 'cert.pem'), os.path.join(self.tmp, 'key.pem')
        subprocess.run(['openssl', 'req', '-x509', '-newkey', 'rsa:2048', '-nodes',
                        '-keyout', key, '-out', cert, '-days', '1', '-subj', '/CN=127.0.0.1',
                        '-addext', 'subjectAltName=IP:127.0.0.1'],
                       check=True, capture_output=True)
        try:
            server = self.private_server('--tls-cert-file', cert, '--tls-key-file', key,
                                         '--tls-ca-cert-file', cert, '--tls-auth-clients', 'no',
                                         tls=True)
        except RuntimeError as exc:
            self.skipTest('redis-server cannot serve TLS here: %s' % exc)
        url = server.address + '?ssl_ca_certs=' + cert
        writer, reader = self.storage(cache_servers=url), self.storage(cache_servers=url)
        oids = [writer.new_oid() for _ in range(5)]
        inst = reader.new_instance()
        inst.poll_invalidations()
        tid = self.commit(writer, {oid: i for i, oid in enumerate(oids)})
        inst.poll_invalidations()
        for oid in oids:
            self.assertEqual(inst.load(oid)[1], tid)
        stats = reader.cache_stats()
        self.assertEqual((stats['db_loads'], stats['shared']['hits']), (0, 5))
        self.assertEqual(stats['shared']['servers'], ['rediss://127.0.0.1:%d/0' % server.port])
        inst.release()


@unittest.skipUnless(HAVE_REDIS, 'the redis package is not installed')
class RedisUrlTests(unittest.TestCase):
    """Parsing cache-servers; needs no server."""

    def test_urls(self):
        self.assertEqual(parse_url('redis://h'), 'redis://h:6379/0')
        self.assertEqual(parse_url('REDISS://u:%s@h:6380/2?ssl_cert_reqs=none' % PASSWORD),
                         'rediss://h:6380/2')
        self.assertEqual(parse_url('redis://[::1]:7000/'), 'redis://[::1]:7000/0')
        for bad, message in (('redis://:%s@h:port/0' % PASSWORD, 'not a valid Redis URL'),
                             ('redis://:%s@/0' % PASSWORD, 'names no host'),
                             ('redis://:%s@h/zero' % PASSWORD, 'database number'),
                             ('redis://:%s@h/0?socket_timeout=x' % PASSWORD, 'socket_timeout'),
                             ('redis://:%s@h/0?no_such_argument=1' % PASSWORD,
                              'no_such_argument')):
            with self.subTest(url=bad):
                with self.assertRaisesRegex(ValueError, message) as raised:
                    open_shared_cache(bad)
                self.assertNotIn(PASSWORD, str(raised.exception))
        with self.assertRaisesRegex(ValueError, 'cannot be mixed'):
            open_shared_cache('redis://h 127.0.0.1:11211')
        with self.assertRaisesRegex(ValueError, 'cache-module-name'):
            open_shared_cache('redis://h', 'pymemcache')


class _Capture(logging.Handler):

    def __init__(self):
        logging.Handler.__init__(self, logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())
        if record.exc_info:
            self.messages.append(logging.Formatter().formatException(record.exc_info))


def _test_suite():
    loader = unittest.TestLoader()
    return unittest.TestSuite([loader.loadTestsFromTestCase(RedisUrlTests),
                               loader.loadTestsFromTestCase(RedisTests)])


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
