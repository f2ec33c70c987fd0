"""The storages the harness can benchmark, and how to set each one up.

A *target* is one storage configuration: RelStorage on a database with one
driver and one history mode, or a ZODB reference point (FileStorage, ZEO
over FileStorage). For each run a target

- checks that it can run at all (adapter module importable, driver
  importable, server reachable) and says why not otherwise;
- creates a fresh database (server databases are named
  ``relstoragebench_*``; SQLite and FileStorage live in the scratch dir);
- writes the ZConfig storage section from ``bench/templates/``;
- drops the database again.

Server locations come from the same environment variables as the test
suite: ``RS_PG_DSN`` (default ``host=127.0.0.1 user=postgres``) and
``RS_MYSQL_HOST``, ``RS_MYSQL_PORT``, ``RS_MYSQL_USER``, ``RS_MYSQL_PASSWD``
(default ``127.0.0.1``, ``3306``, ``root``, empty). Passwords go only into
generated files (mode 0600) and driver calls, never into output.
"""
import importlib
import os
import re
import shutil
import socket
import string
import subprocess
import sys
import time

from relstorage.options import redact_secrets

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(HERE, 'templates')
DB_PREFIX = 'relstoragebench_'


def render(template_name, **values):
    with open(os.path.join(TEMPLATES, template_name), encoding='utf-8') as f:
        text = f.read()
    # Drop the template's own comment lines; the generated file gets one.
    lines = [line for line in text.splitlines()
             if not line.startswith('# ')]
    return string.Template('\n'.join(lines) + '\n').substitute(values)


def write_private(path, text):
    """Write *text* to *path*, readable by the owner only (it may hold a
    password)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
        f.write(text)
    return path


def safe_message(exc):
    """One line describing *exc*, with anything password-like removed."""
    text = '%s: %s' % (type(exc).__name__, exc)
    text = ' '.join(text.split())
    return redact_secrets(text)[:300]


class Unavailable(Exception):
    """The target cannot run here; the message says why."""


# --- server settings -----------------------------------------------------

def pg_base_dsn():
    return os.environ.get('RS_PG_DSN', 'host=127.0.0.1 user=postgres')


def pg_dsn_for(dbname):
    # A later dbname= in a libpq string wins over an earlier one.
    return '%s dbname=%s' % (pg_base_dsn(), dbname)


def mysql_settings():
    return {
        'host': os.environ.get('RS_MYSQL_HOST', '127.0.0.1'),
        'port': int(os.environ.get('RS_MYSQL_PORT', '3306')),
        'user': os.environ.get('RS_MYSQL_USER', 'root'),
        'passwd': os.environ.get('RS_MYSQL_PASSWD', ''),
    }


def pg_admin_connect(dbname='postgres'):
    """An autocommit psycopg (3, else 2) connection for CREATE/DROP."""
    dsn = '%s dbname=%s' % (pg_base_dsn(), dbname)
    try:
        import psycopg
    except ImportError:
        import psycopg2
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        return conn
    return psycopg.connect(dsn, autocommit=True)


def mysql_admin_connect():
    settings = mysql_settings()
    try:
        import MySQLdb
        return MySQLdb.connect(**settings)
    except ImportError:
        import pymysql
        return pymysql.connect(**settings)


def check_db_name(name):
    if not re.match(r'^%s[a-z0-9_]+$' % DB_PREFIX, name):
        raise ValueError('refusing to touch database %r' % (name,))
    return name


def pg_create(name):
    conn = pg_admin_connect()
    try:
        cur = conn.cursor()
        cur.execute('DROP DATABASE IF EXISTS %s' % check_db_name(name))
        cur.execute('CREATE DATABASE %s' % name)
    finally:
        conn.close()


def pg_drop(name):
    conn = pg_admin_connect()
    try:
        cur = conn.cursor()
        # Leftover sessions (a killed worker) would block the drop.
        cur.execute('SELECT pg_terminate_backend(pid) FROM pg_stat_activity '
                    'WHERE datname = %s AND pid <> pg_backend_pid()',
                    (check_db_name(name),))
        cur.execute('DROP DATABASE IF EXISTS %s' % name)
    finally:
        conn.close()


def mysql_create(name):
    conn = mysql_admin_connect()
    try:
        cur = conn.cursor()
        cur.execute('DROP DATABASE IF EXISTS %s' % check_db_name(name))
        cur.execute('CREATE DATABASE %s' % name)
    finally:
        conn.close()


def mysql_drop(name):
    conn = mysql_admin_connect()
    try:
        conn.cursor().execute('DROP DATABASE IF EXISTS %s'
                              % check_db_name(name))
    finally:
        conn.close()


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


# --- targets -------------------------------------------------------------

class Target:
    """One storage configuration to benchmark."""

    #: 'sqlite', 'postgresql', 'mysql' (RelStorage) or 'filestorage', 'zeo'
    database = None
    relstorage = True

    def __init__(self, name, label, driver=None, keep_history=False):
        self.name = name
        self.label = label
        self.driver = driver
        self.keep_history = keep_history
        self.cache_local_mb = 10

    @property
    def mode(self):
        if not self.relstorage:
            return 'history-preserving'
        return 'history-preserving' if self.keep_history else 'history-free'

    def __repr__(self):
        return '<Target %s>' % self.name

    # Availability ------------------------------------------------------

    ADAPTER_MODULE = None
    DRIVER_MODULES = {}

    def check(self):
        """Raise :class:`Unavailable` if this target cannot run here."""
        if self.ADAPTER_MODULE:
            try:
                importlib.import_module(self.ADAPTER_MODULE)
            except ImportError as e:
                raise Unavailable('RelStorage adapter %s not importable (%s)'
                                  % (self.ADAPTER_MODULE, safe_message(e)))
        module = self.DRIVER_MODULES.get(self.driver)
        if module:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise Unavailable('driver %s not installed (%s)'
                                  % (self.driver, safe_message(e)))
        self.check_server()

    def check_server(self):
        pass

    # Life cycle --------------------------------------------------------

    def db_name(self, tag):
        return check_db_name(
            DB_PREFIX + re.sub(r'[^a-z0-9]+', '_', '%s_%s' % (self.name, tag)))

    def create(self, scratch, tag):
        """Make a fresh, empty database; return an opaque handle."""
        raise NotImplementedError

    def storage_section(self, handle, section_name, blob_dir=None):
        """The ZConfig storage section (text) for *handle*."""
        raise NotImplementedError

    def drop(self, handle):
        raise NotImplementedError

    def shootout_config(self, handle, path, **extra):
        text = render('shootout.conf.in', db_name=self.name,
                      storage=self.storage_section(handle, '', **extra))
        return write_private(path, text)

    def zodbconvert_config(self, handle, path, source_path, source_blob_dir,
                           blob_dir=None):
        blob_line = 'blob-dir %s' % source_blob_dir if source_blob_dir else ''
        text = render('zodbconvert.conf.in', source_path=source_path,
                      source_blob_line=blob_line,
                      destination=self.storage_section(
                          handle, 'destination', blob_dir=blob_dir))
        return write_private(path, text)

    def _relstorage_values(self, section_name, blob_dir=None):
        return {
            'section_name': section_name,
            'keep_history': 'true' if self.keep_history else 'false',
            'cache_local_mb': self.cache_local_mb,
            # Blobs in the database, the directory their cache (on both
            # sides: the two implementations' defaults need not agree).
            'extra_options': ('blob-dir %s\n shared-blob-dir false' % blob_dir)
                             if blob_dir else '',
        }


class SqliteTarget(Target):
    database = 'sqlite'
    ADAPTER_MODULE = 'relstorage.adapters.sqlite.adapter'
    DRIVER_MODULES = {'sqlite3': 'sqlite3'}

    def create(self, scratch, tag):
        path = os.path.join(scratch, self.db_name(tag))
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def storage_section(self, handle, section_name, blob_dir=None):
        return render('sqlite.conf.in', data_dir=handle,
                      **self._relstorage_values(section_name, blob_dir))

    def drop(self, handle):
        shutil.rmtree(handle, ignore_errors=True)


class PostgreSQLTarget(Target):
    database = 'postgresql'
    ADAPTER_MODULE = 'relstorage.adapters.postgresql.adapter'
    DRIVER_MODULES = {'psycopg': 'psycopg', 'psycopg2': 'psycopg2'}

    def check_server(self):
        try:
            pg_admin_connect().close()
        except Exception as e:
            raise Unavailable('PostgreSQL not reachable with RS_PG_DSN=%r '
                              '(%s)' % (redact_secrets(pg_base_dsn()),
                                        safe_message(e)))

    def create(self, scratch, tag):
        name = self.db_name(tag)
        pg_create(name)
        return name

    def storage_section(self, handle, section_name, blob_dir=None):
        return render('postgresql.conf.in', driver=self.driver,
                      dsn=pg_dsn_for(handle),
                      **self._relstorage_values(section_name, blob_dir))

    def drop(self, handle):
        pg_drop(handle)


class MySQLTarget(Target):
    database = 'mysql'
    ADAPTER_MODULE = 'relstorage.adapters.mysql.adapter'
    DRIVER_MODULES = {'MySQLdb': 'MySQLdb', 'PyMySQL': 'pymysql'}

    def check_server(self):
        try:
            mysql_admin_connect().close()
        except Exception as e:
            settings = mysql_settings()
            raise Unavailable('MySQL/MariaDB not reachable at %s:%s as %s '
                              '(%s)' % (settings['host'], settings['port'],
                                        settings['user'], safe_message(e)))

    def create(self, scratch, tag):
        name = self.db_name(tag)
        mysql_create(name)
        return name

    def storage_section(self, handle, section_name, blob_dir=None):
        settings = mysql_settings()
        passwd = settings['passwd']
        return render('mysql.conf.in', driver=self.driver,
                      host=settings['host'], port=settings['port'],
                      user=settings['user'], db=handle,
                      passwd_line=('passwd %s' % passwd) if passwd else '',
                      **self._relstorage_values(section_name, blob_dir))

    def drop(self, handle):
        mysql_drop(handle)


class FileStorageTarget(Target):
    database = 'filestorage'
    relstorage = False

    def create(self, scratch, tag):
        path = os.path.join(scratch, self.db_name(tag))
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def storage_section(self, handle, section_name, blob_dir=None):
        return render('filestorage.conf.in', section_name=section_name,
                      path=os.path.join(handle, 'Data.fs'))

    def drop(self, handle):
        shutil.rmtree(handle, ignore_errors=True)


class ZEOHandle:
    def __init__(self, directory, address, process, log):
        self.directory = directory
        self.address = address
        self.process = process
        self.log = log


class ZEOTarget(Target):
    """A ZEO server over FileStorage, started by the harness on 127.0.0.1
    and stopped (by its pid) when the run is over."""
    database = 'zeo'
    relstorage = False

    def check(self):
        try:
            importlib.import_module('ZEO')
        except ImportError as e:
            raise Unavailable('ZEO not installed (%s); run make bench-deps'
                              % safe_message(e))

    def create(self, scratch, tag):
        directory = os.path.join(scratch, self.db_name(tag))
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        port = free_port()
        log = open(os.path.join(directory, 'zeo.log'), 'w')
        process = subprocess.Popen(
            [sys.executable, '-m', 'ZEO.runzeo', '-a', '127.0.0.1:%d' % port,
             '-f', os.path.join(directory, 'Data.fs')],
            stdout=log, stderr=subprocess.STDOUT)
        handle = ZEOHandle(directory, '127.0.0.1:%d' % port, process, log)
        deadline = time.time() + 30
        while True:
            if process.poll() is not None:
                self.drop(handle)
                raise Unavailable('ZEO server exited with %s; see %s'
                                  % (process.returncode, log.name))
            try:
                socket.create_connection(('127.0.0.1', port), 1).close()
                break
            except OSError:
                if time.time() > deadline:
                    self.drop(handle)
                    raise Unavailable('ZEO server did not listen in 30 s')
                time.sleep(0.1)
        return handle

    def storage_section(self, handle, section_name, blob_dir=None):
        return render('zeo.conf.in', section_name=section_name,
                      address=handle.address)

    def drop(self, handle):
        process = handle.process
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        handle.log.close()
        shutil.rmtree(handle.directory, ignore_errors=True)


ALL_TARGETS = (
    SqliteTarget('sqlite', 'SQLite', 'sqlite3'),
    SqliteTarget('sqlite-hp', 'SQLite (HP)', 'sqlite3', keep_history=True),
    PostgreSQLTarget('pg-psycopg', 'PostgreSQL psycopg 3', 'psycopg'),
    PostgreSQLTarget('pg-psycopg2', 'PostgreSQL psycopg2', 'psycopg2'),
    PostgreSQLTarget('pg-psycopg2-hp', 'PostgreSQL psycopg2 (HP)', 'psycopg2',
                     keep_history=True),
    MySQLTarget('mysql-mysqldb', 'MariaDB mysqlclient', 'MySQLdb'),
    MySQLTarget('mysql-pymysql', 'MariaDB PyMySQL', 'PyMySQL'),
    FileStorageTarget('filestorage', 'FileStorage'),
    ZEOTarget('zeo', 'ZEO (FileStorage)'),
)

TARGETS = {t.name: t for t in ALL_TARGETS}

#: What "make bench" runs when no --targets is given.
DEFAULT_TARGETS = ('sqlite', 'pg-psycopg', 'pg-psycopg2', 'pg-psycopg2-hp',
                   'mysql-mysqldb', 'mysql-pymysql', 'filestorage', 'zeo')
