"""Make sure the database servers the suite is configured for, and Redis,
are reachable.

``make test`` runs this before the suite.  For each configured server
database (see ``configured_databases``) it tries to connect; when the
server is local, installed and stopped, it starts it the way the machine's
packages do; when the server still cannot be reached, it exits non-zero
with a message saying which database and how it was tried.  A database the
suite is configured for is never silently skipped.

Environment:
  RS_TEST_DATABASES   comma list among sqlite, postgresql, mysql, oracle
                      (default: sqlite, postgresql and mysql; oracle only
                      when named, as no Oracle server can run here)
  RS_PG_DSN           libpq DSN of a superuser (default host=127.0.0.1 user=postgres)
  RS_MYSQL_HOST/PORT/USER/PASSWD   (default 127.0.0.1 / 3306 / root / empty)
  RS_ORACLE_DSN/USER/PASSWORD      a staging Oracle server (no default)
  RS_REDIS_URL        the Redis server of the shared-cache tests
                      (default redis://127.0.0.1:6379/0); a local one that is
                      down is started without persistence
"""
import os
import shutil
import subprocess
import sys
import time
from urllib.parse import urlsplit

from relstorage.messages import one_line as _one_line

HERE = os.path.dirname(os.path.abspath(__file__))
ADAPTERS = os.path.join(os.path.dirname(HERE), 'adapters')


def configured_databases():
    names = os.environ.get('RS_TEST_DATABASES')
    if names:
        return [n.strip() for n in names.split(',') if n.strip()]
    return [name for name in ('sqlite', 'postgresql', 'mysql')
            if os.path.exists(os.path.join(ADAPTERS, name, 'adapter.py'))]


def pg_dsn():
    return os.environ.get('RS_PG_DSN', 'host=127.0.0.1 user=postgres')


def mysql_params():
    return {
        'host': os.environ.get('RS_MYSQL_HOST', '127.0.0.1'),
        'port': int(os.environ.get('RS_MYSQL_PORT', '3306')),
        'user': os.environ.get('RS_MYSQL_USER', 'root'),
        'passwd': os.environ.get('RS_MYSQL_PASSWD', ''),
    }


def _is_local(host):
    return host in ('', 'localhost', '127.0.0.1', '::1') or host.startswith('/')


def try_postgresql():
    try:
        import psycopg
        conn = psycopg.connect(pg_dsn() + ' connect_timeout=5 dbname=postgres')
    except ImportError:
        import psycopg2
        conn = psycopg2.connect(pg_dsn() + ' connect_timeout=5 dbname=postgres')
    conn.close()


def start_postgresql():
    if not shutil.which('pg_ctlcluster'):
        return 'pg_ctlcluster not found (PostgreSQL server not installed here)'
    versions = sorted(os.listdir('/etc/postgresql')) if os.path.isdir('/etc/postgresql') else []
    if not versions:
        return 'no cluster under /etc/postgresql'
    cmd = ['pg_ctlcluster', '--skip-systemctl-redirect', versions[-1], 'main', 'start']
    result = subprocess.run(cmd, capture_output=True, text=True)
    return None if result.returncode == 0 else (result.stderr.strip() or result.stdout.strip())


def try_mysql():
    params = mysql_params()
    try:
        import MySQLdb
        conn = MySQLdb.connect(connect_timeout=5, **params)
    except ImportError:
        import pymysql
        params['password'] = params.pop('passwd')
        conn = pymysql.connect(connect_timeout=5, **params)
    conn.close()


def start_mysql():
    daemon = '/usr/sbin/mariadbd' if os.path.exists('/usr/sbin/mariadbd') else shutil.which('mysqld')
    if not daemon:
        return 'no mariadbd/mysqld binary found (server not installed here)'
    if shutil.which('start-stop-daemon'):
        cmd = ['start-stop-daemon', '--start', '--oknodo', '--background', '--exec', daemon]
    else:
        cmd = [daemon, '--daemonize']
    result = subprocess.run(cmd, capture_output=True, text=True)
    return None if result.returncode == 0 else (result.stderr.strip() or result.stdout.strip())


ORACLE_VARIABLES = ('RS_ORACLE_DSN', 'RS_ORACLE_USER', 'RS_ORACLE_PASSWORD')


def try_oracle():
    missing = [name for name in ORACLE_VARIABLES if not os.environ.get(name)]
    if missing:
        raise RuntimeError('%s not set' % ', '.join(missing))
    import oracledb
    conn = oracledb.connect(user=os.environ['RS_ORACLE_USER'],
                            password=os.environ['RS_ORACLE_PASSWORD'],
                            dsn=os.environ['RS_ORACLE_DSN'], tcp_connect_timeout=5)
    conn.close()


def start_oracle():
    return 'no local Oracle server can be started here; set RS_ORACLE_DSN to a staging one'
def redis_url():
    return os.environ.get('RS_REDIS_URL', 'redis://127.0.0.1:6379/0')


def try_redis():
    import redis
    client = redis.Redis.from_url(redis_url(), socket_connect_timeout=5, socket_timeout=5)
    try:
        client.ping()
    finally:
        client.close()


def start_redis():
    server = shutil.which('redis-server')
    if not server:
        return 'redis-server not found (Debian package redis-server not installed here)'
    port = urlsplit(redis_url()).port or 6379
    cmd = [server, '--daemonize', 'yes', '--bind', '127.0.0.1', '--port', str(port),
           '--save', '', '--appendonly', 'no']
    result = subprocess.run(cmd, capture_output=True, text=True)
    return None if result.returncode == 0 else (result.stderr.strip() or result.stdout.strip())


def _redis_name():
    from relstorage.cache.redis_cache import parse_url
    return 'Redis at %s' % parse_url(redis_url())


CHECKS = {
    'postgresql': (try_postgresql, start_postgresql,
                   lambda: 'PostgreSQL via RS_PG_DSN=%r' % _redact(pg_dsn()),
                   lambda: _dsn_host(pg_dsn())),
    'mysql': (try_mysql, start_mysql,
              lambda: 'MySQL/MariaDB at %(host)s:%(port)s as %(user)s' % mysql_params(),
              lambda: mysql_params()['host']),
    'oracle': (try_oracle, start_oracle,
               lambda: 'Oracle via RS_ORACLE_DSN=%r as %r' % (
                   os.environ.get('RS_ORACLE_DSN'), os.environ.get('RS_ORACLE_USER')),
               # Never "local": nothing to start.
               lambda: 'remote'),
    'redis': (try_redis, start_redis, _redis_name,
              lambda: urlsplit(redis_url()).hostname or ''),
}
#: Servers needed whatever the databases: the shared-cache tests use Redis.
SERVICES = ('redis',)


def _redact(dsn):
    return ' '.join('password=***' if part.startswith('password=') else part
                    for part in dsn.split())


def _dsn_host(dsn):
    for part in dsn.split():
        if part.startswith('host='):
            return part[5:]
    return ''


def ensure(name, wait=30):
    check, start, describe, host = CHECKS[name]
    try:
        check()
        return None
    except Exception as exc:  # pylint:disable=broad-except
        first_error = exc
    if not _is_local(host()):
        return '%s is not reachable: %s' % (describe(), _one_line(first_error))
    print('%s is not reachable (%s); starting the local server...'
          % (describe(), _one_line(first_error)), flush=True)
    problem = start()
    if problem:
        return 'could not start the local server for %s: %s' % (describe(), problem)
    deadline = time.time() + wait
    while True:
        try:
            check()
            print('%s is up.' % describe(), flush=True)
            return None
        except Exception as exc:  # pylint:disable=broad-except
            if time.time() > deadline:
                return '%s still not reachable after starting it: %s' % (
                    describe(), _one_line(exc))
            time.sleep(0.5)


def main():
    databases = configured_databases()
    unknown = [n for n in databases if n not in CHECKS and n != 'sqlite' or n in SERVICES]
    if unknown:
        print('RS_TEST_DATABASES names unknown databases: %s' % ', '.join(unknown),
              file=sys.stderr)
        return 2
    needed = [n for n in databases if n in CHECKS] + list(SERVICES)
    failures = [msg for msg in (ensure(n) for n in needed) if msg]
    print('Test databases: %s' % ', '.join(databases))
    if failures:
        for msg in failures:
            print('ERROR: ' + msg, file=sys.stderr)
        print('The suite is configured for these databases and will not skip them. '
              'Start the server(s), or set RS_TEST_DATABASES to the ones you have.',
              file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
