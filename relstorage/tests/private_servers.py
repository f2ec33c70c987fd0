"""Database servers the suite starts for itself, on spare ports.

Tests that restart, stop, promote or pause a server must never do it to a
server they did not start: the machine's own PostgreSQL and MariaDB (or a
staging server the suite is pointed at) belong to somebody else.  This
module starts private ones under a temporary directory:

- ``PostgreSQLPair``: a PostgreSQL primary made by ``initdb`` and a hot
  standby made from it by ``pg_basebackup -R`` (streaming replication);
- ``MariaDBPair``: two ``mariadbd`` instances, the second a read-only
  replica of the first (binary log, GTID).

Each is wrapped in a zope.testrunner layer (``PostgreSQLReplicationLayer``,
``MariaDBReplicationLayer``) so the servers start once for all the tests
that use them.  When they cannot start (binaries missing, not allowed),
the layer records why and every test using it is skipped with that reason.
Everything started is stopped again, on failure too, and at exit.

When running as root, the servers run as the ``postgres`` / ``mysql``
system users (initdb refuses root), which then own the temporary directory.
"""
import atexit
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

#: Names in the replication databases (both pairs).
DBNAME = 'relstoragetest_private'
#: The unprivileged MariaDB account the storages use: without SUPER /
#: READ ONLY ADMIN, the replica's read_only=1 refuses its writes.
MYSQL_USER = 'rs'
MYSQL_PASSWORD = 'rs-secret-pw'


class Unavailable(Exception):
    """The private servers cannot run here; the message says why."""


def spare_port():
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    sock = socket.socket()
    try:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]
    finally:
        sock.close()


def wait_for(check, timeout, what):
    deadline = time.time() + timeout
    while True:
        try:
            return check()
        except Exception as exc:  # pylint:disable=broad-except
            if isinstance(exc, Unavailable) or time.time() > deadline:
                raise Unavailable('%s: not ready after %ss (%s)'
                                  % (what, timeout, exc)) from None
            time.sleep(0.2)


class _Servers:
    """Common plumbing: a private directory, commands run as its owner."""

    os_user = None

    def __init__(self):
        self.root = None
        self._started = []          # callables stopping what was started

    def _prepare_dir(self, binaries):
        missing = [b for b in binaries if not (os.path.exists(b) or shutil.which(b))]
        if missing:
            raise Unavailable('not installed here: %s' % ', '.join(missing))
        # Not tempfile's current default: ZODB's doctest set-up points it
        # at a per-test directory the servers' own users cannot enter.
        self.root = tempfile.mkdtemp(prefix='rs-private-%s-' % type(self).__name__.lower(),
                                     dir=os.environ.get('TMPDIR') or '/tmp')
        self._started.append(lambda: shutil.rmtree(self.root, ignore_errors=True))
        if os.geteuid() == 0:
            try:
                import pwd
                entry = pwd.getpwnam(self.os_user)
            except KeyError:
                raise Unavailable('running as root, and there is no %r system user to run '
                                  'the server as' % self.os_user) from None
            if not shutil.which('runuser'):
                raise Unavailable('running as root without runuser')
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            # The parent of the temporary directory must let the user in.
        os.chmod(self.root, 0o755)

    def _cmd(self, args):
        if os.geteuid() == 0:
            return ['runuser', '-u', self.os_user, '--'] + list(args)
        return list(args)

    def run(self, args, timeout=120, check=True):
        result = subprocess.run(self._cmd(args), capture_output=True, text=True,
                                timeout=timeout, cwd=self.root)
        if check and result.returncode != 0:
            raise Unavailable('%s failed (exit %s): %s' % (
                os.path.basename(args[0]), result.returncode,
                (result.stderr.strip() or result.stdout.strip())[-800:]))
        return result

    def start(self):
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)
        return self

    def stop(self):
        while self._started:
            stop = self._started.pop()
            try:
                stop()
            except Exception:  # pylint:disable=broad-except
                pass


# ----------------------------------------------------------------------
# PostgreSQL

def _pg_bindir():
    dirs = sorted(glob.glob('/usr/lib/postgresql/*/bin'),
                  key=lambda d: int(d.split('/')[-2]) if d.split('/')[-2].isdigit() else 0)
    if os.environ.get('RS_PG_BINDIR'):
        return os.environ['RS_PG_BINDIR']
    if dirs:
        return dirs[-1]
    initdb = shutil.which('initdb')
    return os.path.dirname(initdb) if initdb else '/usr/lib/postgresql/15/bin'


class PostgreSQLPair(_Servers):
    """A private primary and its streaming hot standby."""

    os_user = 'postgres'

    def __init__(self):
        super().__init__()
        self.bindir = _pg_bindir()
        self.ports = {}
        self._settings = {}

    def _bin(self, name):
        return os.path.join(self.bindir, name)

    def datadir(self, name):
        return os.path.join(self.root, name)

    def _start(self):
        self._prepare_dir([self._bin('initdb'), self._bin('pg_ctl'),
                           self._bin('pg_basebackup')])
        primary = self.datadir('primary')
        self.run([self._bin('initdb'), '-D', primary, '-U', 'postgres', '--auth=trust',
                  '--no-sync', '-E', 'UTF8', '--locale=C'])
        self._start_server('primary', wal_level='replica', max_wal_senders='5')
        self.sql('primary', 'CREATE DATABASE %s' % DBNAME)
        standby = self.datadir('standby')
        self.run([self._bin('pg_basebackup'), '-h', '127.0.0.1', '-p', str(self.ports['primary']),
                  '-U', 'postgres', '-D', standby, '-R', '-X', 'stream', '--no-sync',
                  '--checkpoint=fast'])
        # Every statement the standby runs is logged: the tests read the
        # log to prove that no write ever reaches it.
        self._start_server('standby', log_statement='all')

    def _start_server(self, name, **settings):
        port = self.ports.get(name) or spare_port()
        self.ports[name] = port
        self._settings[name] = settings
        base = {'port': str(port), 'listen_addresses': '127.0.0.1',
                'unix_socket_directories': self.root, 'fsync': 'off',
                'full_page_writes': 'off', 'shared_buffers': '32MB',
                'max_connections': '60', 'hot_standby': 'on',
                'logging_collector': 'off'}
        base.update(settings)
        options = ' '.join('-c %s=%s' % item for item in base.items())
        self.run([self._bin('pg_ctl'), '-D', self.datadir(name), '-l', self.logfile(name),
                  '-o', options, '-w', '-t', '60', 'start'])
        self._started.append(lambda: self.stop_server(name))

    def start_server(self, name):
        """Start a server stopped by stop_server again, on its port."""
        self._start_server(name, **self._settings[name])

    def logfile(self, name):
        return os.path.join(self.root, name + '.log')

    @staticmethod
    def client_statements(text):
        """The statements in log ``text`` (a standby logs no replayed WAL)."""
        return text

    def stop_server(self, name, mode='fast'):
        self.run([self._bin('pg_ctl'), '-D', self.datadir(name), '-m', mode, '-w', 'stop'],
                 check=False)

    def kill_server(self, name):
        """Stop the server at once, as a crash would."""
        self.stop_server(name, mode='immediate')

    def restart_server(self, name):
        # (-l: the server must not inherit our pipes, or run() waits on them.)
        self.run([self._bin('pg_ctl'), '-D', self.datadir(name), '-l', self.logfile(name),
                  '-m', 'fast', '-w', '-t', '60', 'restart'])

    def promote(self, name='standby'):
        self.run([self._bin('pg_ctl'), '-D', self.datadir(name), '-l', self.logfile(name),
                  '-w', '-t', '60', 'promote'])

    def dsn(self, name, dbname=DBNAME):
        return 'host=127.0.0.1 port=%d user=postgres dbname=%s' % (self.ports[name], dbname)

    def sql(self, name, stmt, dbname='postgres'):
        """Run ``stmt`` in autocommit; the rows, if any."""
        from relstorage.adapters.postgresql import drivers
        driver = drivers.select_driver('auto')
        return _run_sql(driver.connect(self.dsn(name, dbname) + ' connect_timeout=10', 'oid'),
                        stmt)

    def pause_replay(self):
        self.sql('standby', 'SELECT pg_wal_replay_pause()')

    def resume_replay(self):
        self.sql('standby', 'SELECT pg_wal_replay_resume()')

    def wait_caught_up(self, timeout=30):
        """Until the standby has replayed everything the primary wrote."""
        target = self.sql('primary', 'SELECT pg_current_wal_lsn()::text')[0][0]

        def check():
            done = self.sql('standby', "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn"
                            % _quote(target))[0][0]
            if not done:
                raise AssertionError('standby not at %s yet' % target)
        wait_for(check, timeout, 'PostgreSQL standby catching up')


def _run_sql(conn, stmt):
    """Run ``stmt`` on the autocommit connection ``conn``, then close it;
    the rows, if any."""
    try:
        cur = conn.cursor()
        cur.execute(stmt)
        return cur.fetchall() if cur.description else None
    finally:
        conn.close()


def _quote(text):
    return "'%s'" % text.replace("'", "''")


# ----------------------------------------------------------------------
# MariaDB

#: "[date time]<TAB>  thread Command<TAB>argument" in a general log.
_GENERAL_LOG_LINE = re.compile(r'\s(\d+) (Connect|Query|Quit|Init DB)\t(.*)$')


class MariaDBPair(_Servers):
    """A private MariaDB primary and a read-only replica of it."""

    os_user = 'mysql'
    daemon = '/usr/sbin/mariadbd'

    def __init__(self):
        super().__init__()
        self.ports = {}

    def _start(self):
        install = shutil.which('mariadb-install-db') or 'mariadb-install-db'
        self._prepare_dir([self.daemon, install])
        for server_id, name in enumerate(('primary', 'replica'), 1):
            datadir = os.path.join(self.root, name)
            self.run([install, '--no-defaults', '--datadir=' + datadir,
                      '--auth-root-authentication-method=normal', '--skip-test-db'],
                     timeout=180)
            self._start_server(name, server_id)
        self.sql('primary', "CREATE DATABASE %s" % DBNAME)
        self.sql('primary', "CREATE USER '%s'@'%%' IDENTIFIED BY '%s'"
                 % (MYSQL_USER, MYSQL_PASSWORD))
        self.sql('primary', "GRANT ALL ON `%s`.* TO '%s'@'%%'" % (DBNAME, MYSQL_USER))
        self.sql('replica', "CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT=%d, "
                 "MASTER_USER='root', MASTER_PASSWORD='', MASTER_USE_GTID=slave_pos, "
                 "MASTER_CONNECT_RETRY=1"
                 % self.ports['primary'])
        self.sql('replica', 'START SLAVE')
        self.wait_caught_up()

    def _start_server(self, name, server_id, port=None):
        port = port or spare_port()
        self.ports[name] = port
        datadir = os.path.join(self.root, name)
        args = [self.daemon, '--no-defaults', '--datadir=' + datadir, '--port=%d' % port,
                '--bind-address=127.0.0.1', '--socket=' + os.path.join(self.root, name + '.sock'),
                '--pid-file=' + os.path.join(self.root, name + '.pid'),
                '--log-error=' + os.path.join(self.root, name + '.err'),
                '--server-id=%d' % server_id, '--log-bin=' + os.path.join(datadir, 'binlog'),
                '--skip-name-resolve', '--innodb-buffer-pool-size=32M',
                '--innodb-log-file-size=16M', '--innodb-flush-log-at-trx-commit=0',
                '--sync-binlog=0', '--max-connections=60', '--skip-log-slave-updates']
        if name == 'replica':
            # Every statement the replica runs is logged: the tests read
            # the log to prove that no write ever reaches it.
            args += ['--read-only=1', '--general-log=1',
                     '--general-log-file=' + self.logfile(name)]
        log = open(os.path.join(self.root, name + '.out'), 'ab')
        try:
            proc = subprocess.Popen(self._cmd(args), stdout=log, stderr=subprocess.STDOUT,
                                    cwd=self.root)
        finally:
            log.close()
        self._started.append(lambda: self._stop_process(proc))
        self.procs = getattr(self, 'procs', {})
        self.procs[name] = proc

        def check():
            if proc.poll() is not None:
                err = os.path.join(self.root, name + '.err')
                with open(err, errors='replace') as f:
                    tail = f.read()[-800:]
                raise Unavailable('mariadbd exited (%s): %s' % (proc.returncode, tail))
            self.sql(name, 'SELECT 1')
        wait_for(check, 60, 'private mariadbd ' + name)

    def _stop_process(self, proc, timeout=30):
        if proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def logfile(self, name):
        return os.path.join(self.root, name + '.general.log')

    @staticmethod
    def client_statements(text, user=MYSQL_USER):
        """The statements in general-log ``text`` sent by sessions of
        ``user`` (not the replication threads, whose applied events the
        replica logs too)."""
        sessions = set()
        statements = []
        for line in text.splitlines():
            match = _GENERAL_LOG_LINE.search(line)
            if match is None:
                continue            # the next line of a statement
            thread, command, argument = match.groups()
            if command == 'Connect' and argument.startswith(user + '@'):
                sessions.add(thread)
            elif command == 'Query' and thread in sessions:
                statements.append(argument)
        return '\n'.join(statements)

    def kill_server(self, name):
        """Stop the server at once (SIGKILL), as a crash would."""
        proc = self.procs[name]
        # The pid of mariadbd itself (runuser, when used, stands between).
        with open(os.path.join(self.root, name + '.pid')) as f:
            os.kill(int(f.read().strip()), signal.SIGKILL)
        proc.wait(30)

    def stop_server(self, name):
        self._stop_process(self.procs[name])

    def start_server(self, name):
        """Start a server stopped by stop_server again, on its port."""
        self._start_server(name, 1 if name == 'primary' else 2, self.ports[name])

    def restart_server(self, name):
        self.stop_server(name)
        self.start_server(name)

    def params(self, name, user=MYSQL_USER, db=DBNAME):
        params = {'host': '127.0.0.1', 'port': self.ports[name], 'user': user,
                  'passwd': MYSQL_PASSWORD if user == MYSQL_USER else '',
                  'connect_timeout': 10}
        if db:
            params['db'] = db
        return params

    def connect(self, name, user='root', db=None):
        from relstorage.adapters.mysql import drivers
        driver = drivers.select_driver('auto')
        conn = driver.connect(self.params(name, user, db))
        conn.autocommit(True)
        return conn

    def sql(self, name, stmt, db=None):
        return _run_sql(self.connect(name, db=db), stmt)

    def pause_replay(self):
        self.sql('replica', 'STOP SLAVE SQL_THREAD')

    def resume_replay(self):
        self.sql('replica', 'START SLAVE SQL_THREAD')

    def promote(self, name='replica'):
        self.sql(name, 'STOP SLAVE')
        self.sql(name, 'RESET SLAVE ALL')
        self.sql(name, 'SET GLOBAL read_only = 0')

    def wait_caught_up(self, timeout=30):
        target = self.sql('primary', 'SELECT @@gtid_binlog_pos')[0][0]

        def check():
            pos = self.sql('replica', "SELECT MASTER_GTID_WAIT(%s, 1)" % _quote(target))[0][0]
            if pos != 0:
                status = self.sql('replica', 'SHOW SLAVE STATUS')
                raise AssertionError('replica not at %s yet (%s)' % (target, status and
                                                                    status[0][:3]))
        wait_for(check, timeout, 'MariaDB replica catching up')


# ----------------------------------------------------------------------
# A server that comes and goes

class Forwarder:
    """A TCP forwarder on a spare loopback port to ``target_port``, that a
    test stops (cutting every connection through it) and starts again:
    a second address of the same server, which can go away on its own."""

    def __init__(self, target_port):
        self.target_port = target_port
        self.port = spare_port()
        self._listener = None
        self._sockets = []
        self._lock = threading.Lock()

    def start(self):
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(('127.0.0.1', self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(('127.0.0.1', self.target_port), 10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source, sink):
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self):
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


# ----------------------------------------------------------------------
# zope.testrunner layers: start once for every test using them.

def _pair_layer(name, pair_class, label):
    """A zope.testrunner layer starting ``pair_class`` once for its tests.

    (Built by a function because zope.testrunner sets up every base class
    of a layer as a layer of its own.)
    """

    def setUp(cls):
        cls.pair = None
        cls.reason = None
        try:
            cls.pair = pair_class().start()
        except Unavailable as exc:
            cls.reason = 'private %s servers could not start: %s' % (label, exc)
        except (OSError, subprocess.SubprocessError) as exc:
            cls.reason = 'private %s servers could not start: %s: %s' % (
                label, type(exc).__name__, exc)
        if cls.reason:
            # Said once, where the run's output shows it.
            sys.stderr.write('\n  %s\n' % cls.reason)

    def tearDown(cls):
        if cls.pair is not None:
            cls.pair.stop()
            cls.pair = None

    def rebuild(cls):
        """New servers in place of ones a test broke (failover)."""
        cls.tearDown()
        cls.setUp()

    def require(cls, test):
        """The pair, or skip ``test`` saying why there is none."""
        if cls.pair is None:
            test.skipTest(cls.reason or 'the %s layer is not set up' % name)
        return cls.pair

    return type(name, (), {
        '__module__': __name__, 'pair': None, 'reason': None,
        'setUp': classmethod(setUp), 'tearDown': classmethod(tearDown),
        'rebuild': classmethod(rebuild), 'require': classmethod(require)})


PostgreSQLReplicationLayer = _pair_layer('PostgreSQLReplicationLayer', PostgreSQLPair,
                                         'PostgreSQL')
MariaDBReplicationLayer = _pair_layer('MariaDBReplicationLayer', MariaDBPair, 'MariaDB')
