"""zodburi resolvers: URIs to RelStorage factories."""
import os
import shutil
import tempfile
import unittest

import transaction
import ZODB
from zodburi import resolve_uri

from relstorage import zodburi


class TestResolvers(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix='zodburi_test_')

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_sqlite_opens_and_stores(self):
        for uri in ('sqlite://%s?keep-history=false&cache_local_mb=5' % self.tmp,
                    'sqlite3://?data_dir=%s&keep_history=false&cache-local-mb=5' % self.tmp):
            with self.subTest(uri=uri):
                factory, dbkw = resolve_uri(uri)
                self.assertFalse(factory.options.keep_history)
                self.assertEqual(factory.options.cache_local_mb, 5)
                self.assertEqual(dbkw['database_name'], 'unnamed')
                db = ZODB.DB(factory(), **dbkw)
                try:
                    conn = db.open()
                    conn.root()['x'] = 1
                    transaction.commit()
                    conn.close()
                    self.assertFalse(db.storage.supportsUndo())
                finally:
                    db.close()

    def test_db_arguments_returned(self):
        factory, dbkw = resolve_uri(
            'sqlite://%s?database_name=main&connection_cache_size=123'
            '&connection_pool_size=3' % self.tmp)
        self.assertEqual(dbkw, {'database_name': 'main', 'cache_size': 123,
                                'pool_size': 3})

    def test_every_option_accepted(self):
        from relstorage.options import Options
        samples = {'boolean': 'true', 'integer': '3', 'float': '0.5',
                   'byte-size': '10MB', 'string': 'abc', 'dirpath': self.tmp}
        for option in Options.OPTIONS:
            if option.attribute == 'driver':
                continue
            value = option.choices[0] if option.choices else samples[option.datatype]
            for spelling in (option.name, option.attribute):
                with self.subTest(option=spelling):
                    factory, _ = zodburi.sqlite_resolver(
                        'sqlite://%s?%s=%s' % (self.tmp, spelling, value))
                    self.assertIsNotNone(getattr(factory.options, option.attribute))

    def test_bad_arguments(self):
        cases = {
            'sqlite://%s?no_such_option=1' % self.tmp: "unknown argument 'no_such_option'",
            'sqlite://%s?keep-history=perhaps' % self.tmp: 'keep-history',
            'sqlite://%s?cache-local-compression=lzma' % self.tmp: 'cache-local-compression',
            'sqlite://%s?driver=nope' % self.tmp: 'driver',
            'sqlite://': 'data directory is missing',
            'sqlite://host/dir': 'no host',
            'mysql://u:p@h:port/db': 'port',
            # (A helper agent's check: port 0 opened the default port.)
            'mysql://u@h:0/db': 'the port is not a number from 1 to 65535',
            'mysql://u:p@h/db?connect_timeout=soon': 'connect_timeout',
            # (A helper agent's check: only "unknown argument".)
            'mysql://u@h/db?ssl=1': 'TLS: name a MySQL option file with its ssl settings',
            'sqlite://%s?pragma_synchronus=normal' % self.tmp: 'synchronus',
            'sqlite://%s?pragma_synchronous=maybe' % self.tmp: 'synchronous',
            'sqlite://%s?cache_module_name=memcached' % self.tmp: 'cache-module-name',
            'sqlite://%s?cache-local-dir-count=many' % self.tmp: 'cache-local-dir-count',
            # Both spellings of one key (the last one won, silently).
            'sqlite://%s?keep_history=true&keep-history=false' % self.tmp:
                "'keep_history' is given more than once (as keep_history and keep-history)",
            'sqlite://%s?cache-local-mb=5&cache-local-mb=7' % self.tmp:
                "'cache_local_mb' is given more than once",
            'sqlite://%s?pragma_synchronous=off&pragma-synchronous=full' % self.tmp:
                "'pragma_synchronous' is given more than once",
            'sqlite://%s?pragma_journal_mode=delete' % self.tmp: 'must be wal',
            # As in a configuration file, the data directory's parent must
            # exist (a helper agent's check: the URI created every level).
            'sqlite://%s/typo/a/b' % self.tmp: 'data-dir: The directory named as part of',
            'sqlite://?data_dir=%s/typo/a/b' % self.tmp: 'does not exist',
            'sqlite://%s?demostorage=1&demostorage=0' % self.tmp:
                "'demostorage' is given more than once",
        }
        for uri, message in cases.items():
            with self.subTest(uri=uri):
                with self.assertRaises(ValueError) as ctx:
                    resolve_uri(uri)
                self.assertIn(message, str(ctx.exception))
        self.assertFalse(os.path.exists(os.path.join(self.tmp, 'typo')))

    def test_postgresql_dsn_without_leaking_password(self):
        for scheme in ('postgres', 'postgresql'):
            factory, _ = resolve_uri(
                "%s://bob:s3cr%%40t@db.example:5433/zodb?driver=psycopg2"
                "&keep-history=false&dsn=sslmode%%3Drequire" % scheme)
            section = factory.adapter_factory.config
            self.assertEqual(section.dsn, "host='db.example' port='5433' user='bob' "
                                          "password='s3cr@t' dbname='zodb' sslmode=require")
            self.assertEqual(section.driver, 'psycopg2')
            self.assertNotIn('s3cr', repr(factory.adapter_factory))
        with self.assertRaises(ValueError) as ctx:
            resolve_uri('postgres://bob:hunter2@h/db?bogus=1')
        self.assertNotIn('hunter2', str(ctx.exception))

    def test_postgresql_list_of_servers(self):
        # libpq's URI with several servers (a helper agent's check: refused
        # as "the port is not a number").  Through a real server too.
        factory, _ = resolve_uri(
            'postgresql://bob@h1:5432,[::1]:5433,h3/zodb?target_session_attrs=read-write')
        self.assertEqual(factory.adapter_factory.config.dsn,
                         "host='h1,::1,h3' port='5432,5433,' user='bob' dbname='zodb' "
                         "target_session_attrs='read-write'")
        for bad in ('h1:x,h2', 'h1:0,h2', 'h1,,h2'):
            with self.assertRaises(ValueError) as ctx:
                resolve_uri('postgresql://bob@%s/zodb' % bad)
            self.assertIn('postgresql URI', str(ctx.exception))

    def test_mysql_connect_arguments(self):
        factory, _ = resolve_uri('mysql://root:pw@127.0.0.1:3307/zodb'
                                 '?connect_timeout=7&unix_socket=/tmp/s&driver=PyMySQL')
        kwargs = factory.adapter_factory.connect_kwargs
        self.assertEqual(kwargs, {'host': '127.0.0.1', 'port': 3307, 'user': 'root',
                                  'passwd': 'pw', 'db': 'zodb', 'unix_socket': '/tmp/s',
                                  'connect_timeout': 7})
        self.assertEqual(factory.options.driver, 'pymysql')
        self.assertNotIn("'pw'", repr(factory.adapter_factory))

    def test_oracle(self):
        factory, _ = resolve_uri('oracle://scott:tiger@dbhost:1521/XEPDB1?keep_history=true')
        section = factory.adapter_factory.config
        self.assertEqual((section.user, section.password, section.dsn),
                         ('scott', 'tiger', 'dbhost:1521/XEPDB1'))

    def test_legacy_keys_and_values(self):
        factory, _ = resolve_uri(
            'sqlite://%s?cache_local_dir_count=20&pack-dry-run=true'
            '&cache_module_name=relstorage.pylibmc_wrapper&gevent_yield_interval=5' % self.tmp)
        options = factory.options
        self.assertEqual(options.cache_local_dir_count, 20)
        self.assertTrue(options.pack_prepack_only)
        self.assertEqual(options.cache_module_name, 'pymemcache')
        factory, _ = resolve_uri('postgresql://u@h/db?driver=pg8000')
        self.assertEqual(factory.options.driver, 'auto')
        self.assertEqual(factory.adapter_factory.driver, 'auto')
        factory, _ = resolve_uri('mysql://u@h/db?charset=utf8&init-command=SET+x%3D1')
        self.assertEqual(factory.adapter_factory.connect_kwargs,
                         {'host': 'h', 'user': 'u', 'db': 'db'})

    def test_uris_of_earlier_releases(self):
        # A helper agent's check: URIs that RelStorage 4.3's resolver and
        # zodburi's own take were refused: booleans as 0/1, a PostgreSQL
        # connect_timeout, demostorage=1.
        for value, expected in (('0', False), ('1', True), ('t', True), ('f', False),
                                ('yes', True), ('off', False), ('TRUE', True), ('', False)):
            with self.subTest(value=value):
                factory, _ = resolve_uri('sqlite://%s?keep_history=%s&read_only=%s'
                                         % (self.tmp, value, value))
                self.assertEqual(factory.options.keep_history, expected)
                self.assertEqual(factory.options.read_only, expected)
        with self.assertRaises(ValueError) as ctx:
            resolve_uri('sqlite://%s?keep_history=2' % self.tmp)
        self.assertIn('keep-history', str(ctx.exception))
        factory, _ = resolve_uri('mysql://u@h/db?compress=1')
        self.assertEqual(factory.adapter_factory.connect_kwargs,
                         {'host': 'h', 'user': 'u', 'db': 'db', 'compress': True})
        factory, _ = resolve_uri('postgres://bob@db.example/zodb?connect_timeout=10'
                                 '&sslmode=require&keep_history=0')
        self.assertEqual(factory.adapter_factory.config.dsn,
                         "host='db.example' user='bob' dbname='zodb' "
                         "connect_timeout='10' sslmode='require'")
        self.assertFalse(factory.options.keep_history)
        # libpq's socket directory as the host, as libpq's URIs write it.
        factory, _ = resolve_uri('postgresql:///zodb?host=/var/run/postgresql')
        self.assertEqual(factory.adapter_factory.config.dsn,
                         "dbname='zodb' host='/var/run/postgresql'")
        with self.assertRaises(ValueError) as ctx:
            resolve_uri('postgresql://bob:hunter2@h/zodb?host=other')
        self.assertIn('host is given both', str(ctx.exception))
        self.assertNotIn('hunter2', str(ctx.exception))
        # demostorage wraps the storage, as zodburi's resolvers do: its
        # changes never reach the database.
        from ZODB.DemoStorage import DemoStorage
        with self.assertWarns(DeprecationWarning):
            factory, dbkw = resolve_uri('sqlite://%s?demostorage=1' % self.tmp)
        db = ZODB.DB(factory(), **dbkw)
        try:
            self.assertIsInstance(db.storage, DemoStorage)
            with db.transaction() as conn:
                conn.root()['demo'] = 1
        finally:
            db.close()
        factory, dbkw = resolve_uri('sqlite://%s?demostorage=0' % self.tmp)
        db = ZODB.DB(factory(), **dbkw)
        try:
            self.assertNotIsInstance(db.storage, DemoStorage)
            with db.transaction() as conn:
                self.assertNotIn('demo', conn.root())
        finally:
            db.close()

    def test_sqlite_pragmas(self):
        factory, _ = resolve_uri('sqlite://%s?pragma_synchronous=off' % self.tmp)
        self.assertEqual(factory.adapter_factory.pragmas, {'synchronous': 'off'})


def _test_suite():
    return unittest.defaultTestLoader.loadTestsFromName(__name__)


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
