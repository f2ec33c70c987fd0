"""Configuration files written for earlier releases keep working.

``configs/`` holds zope.conf / zodb.conf files shaped like what sites run:
Plone's buildout recipe (``rel-storage`` option) for PostgreSQL, MySQL and
Oracle, cookiecutter-zope-instance's output, every key a RelStorage release
documented, underscore spellings. Each one must load; each one naming a
database this machine has is pointed at a fresh test database (paths under
``/srv/plone`` go to a temporary directory), opened through
``ZODB.config.databaseFromString`` and used for a commit. The Oracle one is
only parsed.

The notices about keys that no longer apply are checked here too, on the
three ways of opening a storage (ZConfig, zodburi, Python).
"""
import io
import logging
import os
import re
import shutil
import tempfile
import unittest

import transaction
import ZConfig
import ZODB
import ZODB.config
from persistent.mapping import PersistentMapping

from relstorage import config
from relstorage.options import Options

from . import servers
from .test_zodbconvert import MySQLDB
from .test_zodbconvert import PostgreSQLDB

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')

# Zope's zope.conf schema is not installed here. This stand-in has the parts
# the files use: zodb_db (ZODB's zodb section with mount points), the
# temporary storage, and any other directive or section (logging, servers,
# environment...) accepted as is.
ZOPE_LIKE_SCHEMA = """
<schema prefix="ZODB.config">
  <import package="ZODB"/>
  <abstracttype name="zope.other"/>
  <sectiontype name="zope.any" implements="zope.other">
    <multikey name="+" attribute="keys"/>
    <multisection type="zope.other" name="*" attribute="sections"/>
  </sectiontype>
  <sectiontype name="environment" extends="zope.any" implements="zope.other"/>
  <sectiontype name="dos_protection" extends="zope.any" implements="zope.other"/>
  <sectiontype name="eventlog" extends="zope.any" implements="zope.other"/>
  <sectiontype name="logger" extends="zope.any" implements="zope.other"/>
  <sectiontype name="logfile" extends="zope.any" implements="zope.other"/>
  <sectiontype name="http-server" extends="zope.any" implements="zope.other"/>
  <sectiontype name="temporarystorage" implements="ZODB.storage"
               datatype=".MappingStorage">
    <key name="name" default="temporary storage"/>
  </sectiontype>
  <sectiontype name="zodb_db" extends="zodb" implements="ZODB.database">
    <multikey name="mount-point" attribute="mount_points" datatype="string"/>
    <key name="container-class" datatype="string"/>
  </sectiontype>
  <multisection type="ZODB.database" name="*" attribute="databases"/>
  <multisection type="zope.other" name="*" attribute="others"/>
  <multikey name="+" attribute="directives"/>
</schema>
"""

_zope_like_schema = None


def load_zope_like(text):
    global _zope_like_schema
    if _zope_like_schema is None:
        _zope_like_schema = ZConfig.loadSchemaFile(io.StringIO(ZOPE_LIKE_SCHEMA))
    conf, _ = ZConfig.loadConfigFile(_zope_like_schema, io.StringIO(text))
    return conf


def read_config(name):
    with open(os.path.join(CONFIGS, name), encoding='utf-8') as f:
        return f.read()


def main_db_as_zodb(text):
    """The ``<zodb_db main>`` section of a zope.conf as a zodb.conf: what
    ZODB.config.databaseFromString reads."""
    block = re.search(r'^<zodb_db main>\n(.*?)^</zodb_db>', text, re.M | re.S).group(1)
    block = re.sub(r'^\s*(mount-point|container-class) .*\n', '', block, flags=re.M)
    return '%import relstorage\n<zodb main>\n' + block + '</zodb>\n'


def _replace_line(text, key, value):
    """Set every ``key value`` line of *text* to *value* (keeping the indent)."""
    return re.sub(r'^(\s*%s) .*$' % re.escape(key),
                  lambda m: '%s %s' % (m.group(1), value), text, flags=re.M)


def _pg_host_port():
    dsn = servers.pg_dsn()
    host = re.search(r'host=(\S+)', dsn)
    port = re.search(r'port=(\d+)', dsn)
    return '%s:%s' % (host.group(1) if host else '127.0.0.1',
                      port.group(1) if port else '5432')


class CorpusTestCase(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix='relstoragetest_corpus_')
        self.addCleanup(shutil.rmtree, self.tmp, True)
        for sub in ('parts/instance', 'var/instance', 'var/cache', 'var/log',
                    'var/blobstorage', 'var/blobcache', 'var/sqlite', 'instance',
                    'etc'):
            os.makedirs(os.path.join(self.tmp, sub), exist_ok=True)

    def localized(self, name):
        """The file's text with its paths under our temporary directory."""
        return read_config(name).replace('/srv/plone', self.tmp)

    def on_postgresql(self, text):
        if 'postgresql' not in servers.configured_databases():
            self.skipTest('PostgreSQL is not among RS_TEST_DATABASES')
        db = PostgreSQLDB(self.tmp)
        self.addCleanup(db.cleanup)
        return _replace_line(text, 'dsn', '%s dbname=%s' % (servers.pg_dsn(), db.dbname))

    def on_mysql(self, text):
        if 'mysql' not in servers.configured_databases():
            self.skipTest('MySQL is not among RS_TEST_DATABASES')
        db = MySQLDB(self.tmp)
        self.addCleanup(db.cleanup)
        params = servers.mysql_params()
        for key in ('host', 'port', 'user'):
            text = _replace_line(text, key, params[key])
        text = _replace_line(text, 'db', db.dbname)
        if params['passwd']:
            return _replace_line(text, 'passwd', params['passwd'])
        return re.sub(r'^\s*passwd .*\n', '', text, flags=re.M)

    def with_memcached(self, text):
        """Point ``cache-servers`` at a private memcached (the site's would
        be on 11211), or leave it out where memcached is not installed."""
        from .test_cache_memcache import MEMCACHED
        from .test_cache_memcache import MemcachedServer
        if not os.path.exists(MEMCACHED):
            return re.sub(r'^\s*cache-servers .*\n', '', text, flags=re.M), False
        memcached = MemcachedServer()
        self.addCleanup(memcached.stop)
        return _replace_line(text, 'cache-servers', memcached.address), True

    def open_and_commit(self, zodb_conf):
        """Open the database the way ZODB.config does, commit, read back."""
        db = ZODB.config.databaseFromString(zodb_conf)
        try:
            conn = db.open()
            conn.root()['corpus'] = PersistentMapping(written=True)
            transaction.commit()
            conn.close()
            conn = db.open()
            self.assertTrue(conn.root()['corpus']['written'])
            conn.close()
            return db.storage
        finally:
            transaction.abort()
            db.close()

    def assertWarned(self, logs, keys):
        """One WARNING per key, each naming the key and what replaced it."""
        warnings = [r.getMessage() for r in logs.records if r.levelno == logging.WARNING]
        for key in keys:
            naming = [w for w in warnings if ' %s ' % key in w]
            self.assertEqual(len(naming), 1, (key, warnings))
            self.assertIn('no longer used', naming[0])


class TestPloneRecipe(CorpusTestCase):

    def test_postgresql(self):
        text = self.localized('plone-recipe-postgresql.conf')
        conf = load_zope_like(text)
        main, temporary = conf.databases
        self.assertEqual(main.config.mount_points, ['/'])
        self.assertEqual(temporary.config.mount_points, ['/temp_folder'])
        factory = main.config.storage
        self.assertIsInstance(factory.config.adapter, config.PostgreSQLAdapterFactory)
        self.assertFalse(factory.options.keep_history)
        self.assertEqual(factory.options.cache_local_mb, 100)
        self.assertNotIn('plone-secret', repr(factory.config.adapter))
        zodb_conf = self.on_postgresql(main_db_as_zodb(text))
        with self.assertLogs('relstorage', logging.INFO) as logs:
            self.open_and_commit(zodb_conf)
        self.assertWarned(logs, ['poll-interval'])

    def test_mysql(self):
        text = self.localized('plone-recipe-mysql.conf')
        conf = load_zope_like(text)
        factory = conf.databases[0].config.storage
        options = factory.options
        self.assertIsInstance(factory.config.adapter, config.MySQLAdapterFactory)
        self.assertEqual(options.cache_module_name, 'pymemcache')
        self.assertEqual(options.cache_local_dir_count, 20)
        self.assertEqual(options.blob_cache_size, 512 * 1024 ** 2)
        self.assertNotIn('charset', factory.config.adapter.connect_kwargs)
        # The combination that failed at open before: an old module name
        # with servers.
        zodb_conf, memcached = self.with_memcached(self.on_mysql(main_db_as_zodb(text)))
        with self.assertLogs('relstorage', logging.INFO) as logs:
            storage = self.open_and_commit(zodb_conf)
        self.assertWarned(logs, ['poll-interval', 'pack-dry-run', 'cache-local-dir-count',
                                 'cache-local-dir-compress', 'charset'])
        if memcached:
            self.assertEqual(storage._cache.stats()['shared']['kind'], 'memcached')

    def test_oracle_parses(self):
        text = self.localized('plone-recipe-oracle.conf')
        factory = load_zope_like(text).databases[0].config.storage
        adapter = factory.config.adapter
        self.assertIsInstance(adapter, config.OracleAdapterFactory)
        self.assertEqual(adapter.config.user, 'plone')
        self.assertIn('SERVICE_NAME=PLONE', adapter.config.dsn)
        self.assertNotIn('plone-secret', repr(adapter))
        self.assertTrue(factory.options.keep_history)
        # The same section read by ZODB's own schema.
        conf, _ = ZConfig.loadConfigFile(ZODB.config.getDbSchema(),
                                         io.StringIO(main_db_as_zodb(text)))
        self.assertIsInstance(conf.database[0].config.storage.config.adapter,
                              config.OracleAdapterFactory)


class TestCookiecutterZopeInstance(CorpusTestCase):

    def test_postgresql(self):
        text = self.localized('cookiecutter-zope-instance.conf')
        conf = load_zope_like(text)
        main = conf.databases[0]
        self.assertEqual(main.config.pool_size, 7)
        options = main.config.storage.options
        self.assertEqual(options.name, 'main')
        self.assertEqual(options.blob_cache_size, 1024 ** 3)
        self.assertEqual(options.blob_chunk_size, 1024 ** 2)
        zodb_conf = self.on_postgresql(main_db_as_zodb(text))
        with self.assertNoLogs('relstorage', logging.WARNING):
            storage = self.open_and_commit(zodb_conf)
        self.assertEqual(storage.getName(), 'main')


class TestZodbConf(CorpusTestCase):

    LEGACY = ['poll-interval', 'pack-dry-run', 'cache-local-dir-count',
              'cache-local-dir-read-count', 'cache-local-dir-write-max-size',
              'cache-local-dir-compress', 'cache-local-storage']

    def test_every_historical_key(self):
        text = self.localized('zodb-every-historical-key.conf')
        written = set(re.findall(r'^    ([a-z-]+) ', text, re.M))
        self.assertEqual(
            written, {o.name for o in Options.OPTIONS if o.name != 'driver'},
            'the file should name every <relstorage> key of options.py')
        for name in ('replicas.conf', 'ro-replicas.conf'):
            with open(os.path.join(self.tmp, 'etc', name), 'w') as f:
                f.write(_pg_host_port() + '\n')
        options = load_zope_like(text.replace('<zodb main>', '<zodb_db main>')
                                 .replace('</zodb>', '</zodb_db>')
                                 ).databases[0].config.storage.options
        self.assertEqual(options.cache_module_name, 'pymemcache')
        self.assertEqual(options.cache_local_dir_write_max_size, 10 * 1024 ** 2)
        self.assertEqual(options.driver, 'psycopg2')
        zodb_conf, _ = self.with_memcached(self.on_postgresql(text))
        with self.assertLogs('relstorage', logging.INFO) as logs:
            self.open_and_commit(zodb_conf)
        self.assertWarned(logs, self.LEGACY)

    def test_underscores(self):
        text = self.localized('zodb-underscores.conf')
        with self.assertLogs('relstorage', logging.INFO) as logs:
            storage = self.open_and_commit(text)
        self.assertFalse(storage._options.keep_history)
        self.assertTrue(storage._options.shared_blob_dir)
        self.assertEqual(storage._options.cache_local_object_max, 64 * 1024)
        self.assertEqual(storage._adapter.pragmas['synchronous'], 'normal')
        self.assertEqual(storage._adapter.pragmas['journal_mode'], 'wal')
        self.assertWarned(logs, ['cache-local-dir-count', 'gevent_yield_interval'])


class TestNoticePath(CorpusTestCase):
    """One warning per legacy key, whichever way the storage is opened (and
    none for an option that is set, such as pack-batch-timeout)."""

    def _check(self, logs):
        messages = [(r.levelno, r.getMessage()) for r in logs.records
                    if r.name == 'relstorage.options']
        self.assertEqual(messages, [
            (logging.WARNING, 'option cache-local-dir-count is from an earlier release '
                              'and no longer used; replaced by: cache-local-dir, which '
                              'keeps one file per storage'),
        ])

    def test_zconfig(self):
        text = ('%%import relstorage\n<zodb>\n<relstorage>\n pack_batch_timeout 5\n'
                ' cache_local_dir_count 3\n<sqlite3>\n data-dir %s\n</sqlite3>\n'
                '</relstorage>\n</zodb>\n' % os.path.join(self.tmp, 'db'))
        with self.assertLogs('relstorage', logging.INFO) as logs:
            self.open_and_commit(text)
        self._check(logs)

    def test_zodburi(self):
        from zodburi import resolve_uri
        factory, dbkw = resolve_uri('sqlite://%s?pack-batch-timeout=5&cache_local_dir_count=3'
                                    % os.path.join(self.tmp, 'db'))
        with self.assertLogs('relstorage', logging.INFO) as logs:
            db = ZODB.DB(factory(), **dbkw)
            db.close()
        self._check(logs)

    def test_python(self):
        from relstorage.adapters.sqlite.adapter import Sqlite3Adapter
        from relstorage.storage import RelStorage
        options = Options(pack_batch_timeout=5.0, cache_local_dir_count=3)
        with self.assertLogs('relstorage', logging.INFO) as logs:
            storage = RelStorage(Sqlite3Adapter(os.path.join(self.tmp, 'db'), options=options),
                                 options=options)
            instance = storage.new_instance()     # no second notice
            instance.release()
            storage.close()
        self._check(logs)


def _test_suite():
    return unittest.defaultTestLoader.loadTestsFromName(__name__)


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
