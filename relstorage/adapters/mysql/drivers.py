"""MySQL/MariaDB drivers: mysqlclient (``MySQLdb``) and PyMySQL.

Everything that differs between the two DB-API modules lives here: how to
call ``connect()``, how a bytes value is spelled in the statement text (so
that bulk uploads can be sized against ``max_allowed_packet``) and which
exception carries which server error number.  ``classify_error`` maps error
numbers once, for both drivers.
"""
import logging
import os
import re
import socket

from ...interfaces import RelStorageError
from .. import drivers

log = logging.getLogger(__name__)

#: Canonical driver name -> other accepted spellings (case is ignored).
DRIVER_NAMES = {
    'auto': (),
    'MySQLdb': ('mysqlclient',),
    'pymysql': ('PyMySQL',),
}

#: Keys of the <mysql> section (and of MySQLAdapter), passed to the
#: driver's connect() when set, in mysqlclient's spelling.
CONNECT_KEYS = ('host', 'port', 'user', 'passwd', 'db', 'unix_socket',
                'connect_timeout', 'compress', 'read_default_file',
                'read_default_group')
#: Those a mysql:// URI spells in its network location and path.
URI_NETLOC_KEYS = ('host', 'port', 'user', 'passwd', 'db')

# Server and client error numbers (see the MySQL/MariaDB error references).
LOCK_ERRORS = frozenset((
    1205,   # ER_LOCK_WAIT_TIMEOUT
    1213,   # ER_LOCK_DEADLOCK
    3572,   # ER_LOCK_NOWAIT (MySQL 8)
))
#: Access denied: to a database (1044), for a command on a table (1142),
#: for lack of a global privilege (1227).
PERMISSION_ERRORS = frozenset((1044, 1142, 1227))
#: No room: ER_DISK_FULL (1021), ER_RECORD_FILE_FULL ("The table is
#: full", 1114); and, when the OS error is ENOSPC (28),
#: ER_ERROR_ON_WRITE (3) and ER_GET_ERRNO (1030, "Got error 28 from
#: storage engine").
FULL_ERRORS = frozenset((1021, 1114))
FULL_IF_ENOSPC_ERRORS = frozenset((3, 1030))
DUPLICATE_ERRORS = frozenset((
    1062,   # ER_DUP_ENTRY
    1586,   # ER_DUP_ENTRY_WITH_KEY_NAME
))
DISCONNECT_ERRORS = frozenset((
    1053,   # ER_SERVER_SHUTDOWN
    1077,   # ER_NORMAL_SHUTDOWN
    1078,   # ER_GOT_SIGNAL
    1079,   # ER_SHUTDOWN_COMPLETE
    1152,   # ER_ABORTING_CONNECTION
    1153,   # ER_NET_PACKET_TOO_LARGE (the server closes the connection)
    1927,   # ER_CONNECTION_KILLED (MariaDB)
    2002,   # CR_CONNECTION_ERROR (socket)
    2003,   # CR_CONN_HOST_ERROR
    2006,   # CR_SERVER_GONE_ERROR
    2013,   # CR_SERVER_LOST
    2055,   # CR_SERVER_LOST_EXTENDED
    4031,   # ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8)
))
#: A table not there (yet: a replica replaying a new database's schema).
MISSING_TABLE_ERRORS = frozenset((
    1146,   # ER_NO_SUCH_TABLE
    1412,   # ER_TABLE_DEF_CHANGED ("please retry transaction")
))
#: ER_OPTION_PREVENTS_STATEMENT ("running with the --read-only option").
OPTION_PREVENTS_STATEMENT = 1290
#: Errors that cannot be fixed by retrying: the configuration is wrong.
CONFIG_ERRORS = frozenset((
    1044,   # ER_DBACCESS_DENIED_ERROR
    1045,   # ER_ACCESS_DENIED_ERROR
    1049,   # ER_BAD_DB_ERROR
    1102,   # ER_WRONG_DB_NAME (a name too long, say)
    1698,   # ER_ACCESS_DENIED_NO_PASSWORD_ERROR
    2005,   # CR_UNKNOWN_HOST
))
PACKET_TOO_LARGE = 1153
#: CR_SSL_CONNECTION_ERROR: a configuration error when the certificates do
#: not verify (a helper agent's check found it retried as a disconnect);
#: other TLS failures (the link cut during the handshake) may pass.
SSL_CONNECTION_ERROR = 2026
SSL_CONFIG_WORDS = re.compile(r'certificate|self[- ]signed|verify|unknown ca|no such file',
                              re.IGNORECASE)


def is_config_error(errno, text):
    """Whether a failure to connect comes from the configuration (no
    retry helps)."""
    return errno in CONFIG_ERRORS or (
        errno == SSL_CONNECTION_ERROR and SSL_CONFIG_WORDS.search(text) is not None)


def canonical_name(name):
    return drivers.canonical_name(DRIVER_NAMES, name, 'MySQL')


class Driver:
    """One DB-API module and its quirks."""

    name = None
    module_name = None
    package = None          # what to pip install
    #: Typical size of a bytes literal relative to the bytes.
    literal_factor = 1

    def __init__(self):
        self.module = __import__(self.module_name)
        self.Error = self.module.Error

    def connect(self, kwargs):
        raise NotImplementedError

    def bytes_literal_size(self, data):
        """Length of ``data`` once written into a statement."""
        raise NotImplementedError

    def socket_fd(self, raw):
        """The descriptor of ``raw``'s socket (None when closed)."""
        raise NotImplementedError

    def _limited(self, conn):
        """``conn``, its socket given TCP_LIMITS (closed if that fails)."""
        try:
            limit_dead_links(self.socket_fd(conn))
        except BaseException:
            conn.close()
            raise
        return conn

    def streaming_cursor(self):
        """The cursor class that fetches rows as they are read."""
        return self.module.cursors.SSCursor

    def errno(self, exc):
        if isinstance(exc, self.Error) and exc.args and isinstance(exc.args[0], int):
            return exc.args[0]
        return None

    def is_closed_error(self, exc):
        """The driver refusing to use a connection it knows is closed."""
        return (isinstance(exc, self.module.InterfaceError)
                and self.errno(exc) in (0, None))

    def __repr__(self):
        return '<MySQL driver %s>' % self.name


#: TCP settings of every connection's socket, as on PostgreSQL (see
#: DEFAULT_TCP_LIMITS there): a link that went silently dead (a helper
#: agent's check: a load and a commit hung for as long as it stayed down,
#: the commit lock held) ends within about two minutes: keepalive probes
#: after 60 s idle, every 10 s, 6 of them; data unacknowledged for 60 s.
#: A server that answers acknowledges at once however long its query
#: runs.  (Linux names; what the platform lacks is left as it is.)
TCP_LIMITS = (('TCP_KEEPIDLE', 60), ('TCP_KEEPINTVL', 10), ('TCP_KEEPCNT', 6),
              ('TCP_USER_TIMEOUT', 60000))


def limit_dead_links(fd):
    """Set TCP_LIMITS on the socket ``fd`` (unless it is a Unix socket)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        for level, name, value in ((socket.SOL_SOCKET, 'SO_KEEPALIVE', 1),) + tuple(
                (socket.IPPROTO_TCP, name, value) for name, value in TCP_LIMITS):
            option = getattr(socket, name, None)
            if option is None:
                continue
            try:
                sock.setsockopt(level, option, value)
            except OSError as exc:
                # (A kernel that names the option and refuses it: the
                # connection works without, as before.  A review finding.)
                log.debug("Cannot set %s on a MySQL connection's socket: %s", name, exc)
    finally:
        # (Closes the duplicate only: the driver's descriptor stays open.)
        sock.close()


class MySQLdbDriver(Driver):
    name = 'MySQLdb'
    module_name = 'MySQLdb'
    package = 'mysqlclient'
    blocks_gevent = True        # libmysqlclient's waits, in C

    def connect(self, kwargs):
        kwargs = dict(kwargs)
        # Bytes go out as _binary'...': never reinterpreted as text.
        kwargs['binary_prefix'] = True
        kwargs.setdefault('charset', 'utf8mb4')
        kwargs['autocommit'] = False
        return self._limited(self.module.connect(**kwargs))

    def socket_fd(self, raw):
        return raw.fileno()

    def bytes_literal_size(self, data):
        # mysql_real_escape_string escapes these seven bytes with a backslash.
        specials = (data.count(b'\\') + data.count(b"'") + data.count(b'"')
                    + data.count(b'\0') + data.count(b'\n') + data.count(b'\r')
                    + data.count(b'\x1a'))
        return len(data) + specials + 10          # _binary'...'


class PyMySQLDriver(Driver):
    name = 'pymysql'
    module_name = 'pymysql'
    package = 'PyMySQL'
    literal_factor = 2          # hexadecimal

    def connect(self, kwargs):
        kwargs = dict(kwargs)
        if kwargs.pop('compress', False):
            raise RelStorageError(
                "The PyMySQL driver does not support compress; "
                "use the MySQLdb (mysqlclient) driver or turn compress off.")
        # PyMySQL's own spelling of the MySQLdb-style keys.
        if 'passwd' in kwargs:
            kwargs['password'] = kwargs.pop('passwd')
        if 'db' in kwargs:
            kwargs['database'] = kwargs.pop('db')
        kwargs.setdefault('charset', 'utf8mb4')
        kwargs['autocommit'] = False
        if kwargs.get('connect_timeout') == 0:
            # 0 is libmysqlclient's "no limit"; PyMySQL refused it with a
            # ValueError of its own, naming no section (a helper agent's
            # check).  (Its longest, a year: it takes no None.)
            kwargs['connect_timeout'] = 31536000
        # PyMySQL's connect_timeout bounds the TCP connect only: a server
        # that accepts and never greets (hung, or a proxy without its
        # backend) held the storage's open for ever (a helper agent's
        # check).  The handshake's reads get the same bound, lifted after.
        handshake = 'read_timeout' not in kwargs and kwargs.get('connect_timeout')
        if handshake:
            kwargs['read_timeout'] = kwargs['connect_timeout']
        conn = self.module.connect(**kwargs)
        if handshake:
            conn._read_timeout = None       # (its reads set the socket's timeout from it)
        return self._limited(conn)

    def socket_fd(self, raw):
        sock = raw._sock
        return None if sock is None else sock.fileno()

    def bytes_literal_size(self, data):
        return 2 * len(data) + 12                 # _binary X'hex'


_DRIVERS = {'MySQLdb': MySQLdbDriver, 'pymysql': PyMySQLDriver}


def select_driver(name='auto'):
    """The driver for ``name``; 'auto' prefers MySQLdb, then PyMySQL (in a
    process gevent has patched, PyMySQL, whose waits for the server are
    the patched sockets': see drivers.gevent_patched)."""
    canonical = canonical_name(name)
    if canonical == 'auto':
        order = (MySQLdbDriver, PyMySQLDriver)
        if drivers.gevent_patched():
            order = order[::-1]
        driver, missing = drivers.first_importable(order)
        if driver is not None:
            return drivers.warn_if_blocking(driver, 'MySQL', 'pymysql')
        raise RelStorageError(
            "No MySQL driver is installed: install mysqlclient or PyMySQL "
            "(tried: %s)." % '; '.join(missing))
    cls = _DRIVERS[canonical]
    try:
        return drivers.warn_if_blocking(cls(), 'MySQL', 'pymysql')
    except ImportError as exc:
        raise RelStorageError(
            "The MySQL driver %r is not installed (pip install %s): %s"
            % (name, cls.package, exc)) from None


def classify_error(driver, exc):
    """'lock', 'disconnect', 'duplicate', 'permission', 'missing' (a
    table), 'full' (no room) or None for an exception raised by
    ``driver``."""
    if driver is None or not isinstance(exc, driver.Error):
        return None
    errno = driver.errno(exc)
    if errno in LOCK_ERRORS:
        return 'lock'
    if errno in DUPLICATE_ERRORS:
        return 'duplicate'
    if errno in PERMISSION_ERRORS:
        return 'permission'
    if errno in MISSING_TABLE_ERRORS:
        return 'missing'
    if errno in FULL_ERRORS or (errno in FULL_IF_ENOSPC_ERRORS
                                and re.search(r'\b(errno|errcode|error):? ?28\b', str(exc), re.I)):
        return 'full'
    if errno in DISCONNECT_ERRORS or driver.is_closed_error(exc):
        return 'disconnect'
    if errno == OPTION_PREVENTS_STATEMENT and 'read-only' in str(exc):
        # A write to a read-only server: with replica-conf, a replica not
        # promoted yet (failover in progress), as PostgreSQL's 25006.  A
        # helper agent's check: the driver's error was not transient, and
        # transaction managers gave up where a retry after the promotion
        # commits.
        return 'disconnect'
    return None
