"""Oracle drivers: python-oracledb (``oracledb``) and cx_Oracle, behind one face.

python-oracledb is cx_Oracle's successor and runs in *thin* mode by default:
pure Python, no Oracle client libraries.  The name ``cx_Oracle`` is accepted
too; when the cx_Oracle module is not installed it resolves to oracledb, as
python-oracledb documents (``import oracledb as cx_Oracle``).

Everything that depends on the driver lives here: connecting with our
connection and cursor classes, fetching BLOBs as bytes, binding booleans and
large byte strings, reading an error's ORA-/DPY- code, and parsing a DSN for
messages.  ``classify_error`` maps the codes once, for both drivers.
"""
import importlib
import re
import socket

from ...interfaces import RelStorageError
from .. import drivers

#: Canonical driver name -> other accepted spellings (case is ignored).
DRIVER_NAMES = {
    'auto': (),
    'oracledb': ('python-oracledb',),
    'cx_Oracle': (),
}

#: Byte strings longer than this are bound as BLOB (a temporary LOB) rather
#: than RAW: SQL accepts a RAW bind into a LOB column up to 32767 bytes.
LOB_BIND_LIMIT = 32767

# Oracle error numbers (Database Error Messages, 19c/23ai).
LOCK_ERRORS = frozenset((
    54,      # ORA-00054 resource busy and acquire with NOWAIT specified
    60,      # ORA-00060 deadlock detected while waiting for resource
    30006,   # ORA-30006 resource busy; acquire with WAIT timeout expired
))
DUPLICATE_ERROR = 1   # ORA-00001 unique constraint violated
NAME_IN_USE_ERROR = 955   # ORA-00955 name is already used by an existing object
#: The server refuses this user a statement: a grant or a quota is missing.
PERMISSION_ERRORS = frozenset((
    1031,    # ORA-01031 insufficient privileges
    1950,    # ORA-01950 no privileges on tablespace (no quota)
))
FULL_ERRORS = frozenset((
    1652,    # ORA-01652 unable to extend temp segment
    1653,    # ORA-01653 unable to extend table
    1654,    # ORA-01654 unable to extend index
    1688,    # ORA-01688 unable to extend table partition
    1691,    # ORA-01691 unable to extend lob segment
    1536,    # ORA-01536 space quota exceeded for tablespace
    30036,   # ORA-30036 unable to extend segment in undo tablespace
))
DISCONNECT_ERRORS = frozenset((
    28,      # ORA-00028 your session has been killed
    31,      # ORA-00031 session marked for kill
    1012,    # ORA-01012 not logged on
    1033,    # ORA-01033 initialization or shutdown in progress
    1034,    # ORA-01034 ORACLE not available
    1089,    # ORA-01089 immediate shutdown or close in progress
    1092,    # ORA-01092 ORACLE instance terminated
    2396,    # ORA-02396 exceeded maximum idle time
    3113,    # ORA-03113 end-of-file on communication channel
    3114,    # ORA-03114 not connected to ORACLE
    3135,    # ORA-03135 connection lost contact
    12537,   # ORA-12537 TNS:connection closed
    12547,   # ORA-12547 TNS:lost contact
    12570,   # ORA-12570 TNS:packet reader failure
    12571,   # ORA-12571 TNS:packet writer failure
    12583,   # ORA-12583 TNS:no reader
))
#: python-oracledb's own codes for a connection that is gone.
DISCONNECT_DRIVER_CODES = frozenset((
    'DPY-1001',   # not connected to database
    'DPY-4011',   # the database or network closed the connection
    'DPI-1010',   # not connected (thick mode)
    'DPI-1080',   # connection was closed by ORA-%d (thick mode)
))
#: The server refused our credentials or account: retrying will not help.
LOGIN_ERRORS = frozenset((
    1005,    # ORA-01005 null password given; logon denied
    1017,    # ORA-01017 invalid username/password; logon denied
    1045,    # ORA-01045 user lacks CREATE SESSION privilege
    28000,   # ORA-28000 the account is locked
    28001,   # ORA-28001 the password has expired
))
LOGIN_DRIVER_CODES = frozenset(('DPY-4001',))   # no credentials given
#: The service could not be reached: the network, the listener or the
#: database is down, or the name of the host or service is wrong.
CANNOT_CONNECT_ERRORS = frozenset((
    12154,   # ORA-12154 could not resolve the connect identifier
    12170,   # ORA-12170 connect timeout occurred
    12505,   # ORA-12505 SID not registered with the listener
    12514,   # ORA-12514 service not registered with the listener
    12516,   # ORA-12516 no available handler
    12520,   # ORA-12520 no available handler for the server type
    12521,   # ORA-12521 instance not known by the listener
    12528,   # ORA-12528 all instances are blocking new connections
    12535,   # ORA-12535 operation timed out
    12541,   # ORA-12541 no listener
    12543,   # ORA-12543 destination host unreachable
    12545,   # ORA-12545 target host or object does not exist
)) | DISCONNECT_ERRORS
CANNOT_CONNECT_DRIVER_CODES = frozenset((
    'DPY-4000',   # TNS alias not found in tnsnames.ora
    'DPY-4026',   # tnsnames.ora missing
    'DPY-4027',   # TNS alias given but no configuration directory
    'DPY-6000',   # listener refused the connection
    'DPY-6001',   # service not registered with the listener (ORA-12514)
    'DPY-6003',   # SID not registered with the listener (ORA-12505)
    'DPY-6005',   # cannot connect (network)
)) | DISCONNECT_DRIVER_CODES
#: Of those, the ones a retry cannot cure: the name does not resolve.
CONFIG_DRIVER_CODES = frozenset(('DPY-4000', 'DPY-4026', 'DPY-4027'))
CONFIG_ERRORS = frozenset((12154,))

_CODE = re.compile(r'\b(ORA|DPY|DPI)-(\d+)')


def error_codes(exc):
    """``(ora_number, full_code)`` of a driver exception, e.g.
    ``(54, 'ORA-00054')`` or ``(3113, 'DPY-4011')``; ``(None, None)`` for
    anything else.  python-oracledb turns some server errors into its own
    codes (ORA-03113 becomes DPY-4011) but keeps the ORA number."""
    if not exc.args:
        return None, None
    err = exc.args[0]
    code = getattr(err, 'code', None) or None
    full_code = getattr(err, 'full_code', None) or None
    if full_code is None:
        match = _CODE.search(str(err))
        if match:
            full_code = '%s-%s' % match.groups()
            if code is None and match.group(1) == 'ORA':
                code = int(match.group(2))
    if code is None and full_code is None:
        return None, None
    return code, full_code


def classify_error(driver, exc):
    """'lock', 'disconnect', 'duplicate', 'full' (a tablespace or its
    quota), 'permission' or None for an exception raised by ``driver``."""
    if driver is None or not isinstance(exc, driver.Error):
        return None
    code, full_code = error_codes(exc)
    if code in LOCK_ERRORS:
        return 'lock'
    if code == DUPLICATE_ERROR:
        return 'duplicate'
    if code in FULL_ERRORS:
        return 'full'
    if code in PERMISSION_ERRORS:
        return 'permission'
    if (code in DISCONNECT_ERRORS or full_code in DISCONNECT_DRIVER_CODES
            or getattr(exc.args[0] if exc.args else None, 'is_session_dead', False)):
        return 'disconnect'
    return None


def classify_connect_error(driver, exc):
    """Why a connection attempt failed: 'login' (credentials or account),
    'config' (the name does not resolve), 'unreachable' (worth retrying
    later) or None (something else)."""
    if isinstance(exc, OSError):
        # python-oracledb's thin mode lets the socket's errors through (a
        # helper agent's check: a host name that does not resolve raised
        # a bare socket.gaierror).
        return 'config' if isinstance(exc, socket.gaierror) else 'unreachable'
    code, full_code = error_codes(exc)
    if code in LOGIN_ERRORS or full_code in LOGIN_DRIVER_CODES:
        return 'login'
    if code in CONFIG_ERRORS or full_code in CONFIG_DRIVER_CODES:
        return 'config'
    if code in CANNOT_CONNECT_ERRORS or full_code in CANNOT_CONNECT_DRIVER_CODES:
        return 'unreachable'
    return None


def bind_plan(rows):
    """``(rows, lob_columns)``: ``rows`` with booleans as 0/1 (before 23ai
    SQL has no BOOLEAN), and the positions holding a byte string too long
    for a RAW bind, which must be bound as BLOB."""
    lob_columns = set()
    adapted = []
    for row in rows:
        new = None
        for i, value in enumerate(row):
            if value is True or value is False:
                if new is None:
                    new = list(row)
                new[i] = int(value)
            elif isinstance(value, (bytes, bytearray, memoryview)) and \
                    len(value) > LOB_BIND_LIMIT:
                lob_columns.add(i)
        adapted.append(row if new is None else tuple(new))
    return adapted, lob_columns


def canonical_name(name):
    return drivers.canonical_name(DRIVER_NAMES, name, 'Oracle')


class Driver:
    """One DB-API module and what we need from it."""

    name = None
    module_name = None
    package = None          # what to pip install

    def __init__(self):
        self.module = importlib.import_module(self.module_name)
        self.Error = self.module.Error
        self.DB_TYPE_BLOB = self.module.DB_TYPE_BLOB
        self.DB_TYPE_LONG_RAW = self.module.DB_TYPE_LONG_RAW
        self.connection_class = _connection_class(self.module)

    def __repr__(self):
        return '<Oracle driver %s>' % self.name

    def connect(self, user, password, dsn, purpose, connect_timeout):
        conn = self._connect(user, password, dsn, connect_timeout)
        conn.outputtypehandler = self.output_type_handler()
        # 'oid' connections only draw sequence values: nothing to roll back.
        conn.autocommit = (purpose == 'oid')
        return conn

    def _connect(self, user, password, dsn, connect_timeout):
        raise NotImplementedError

    def output_type_handler(self):
        """A handler fetching BLOB columns as bytes instead of LOB locators
        (one round trip per value)."""
        raise NotImplementedError

    def parse_dsn(self, dsn):
        """(host, port, service_name or sid) for messages, or None when the
        DSN cannot be read without resolving it (a TNS alias)."""
        return None

    def split_credentials(self, dsn):
        """(user, password, dsn) of a ``user/password@connect-string`` DSN."""
        if '@' not in dsn or dsn.lstrip().startswith('('):
            return None, None, dsn
        credentials, _, rest = dsn.rpartition('@')
        user, _, password = credentials.partition('/')
        return user or None, password or None, rest


class OracledbDriver(Driver):
    name = 'oracledb'
    module_name = 'oracledb'
    package = 'oracledb'

    def _connect(self, user, password, dsn, connect_timeout):
        return self.module.connect(user=user, password=password, dsn=dsn,
                                   tcp_connect_timeout=connect_timeout,
                                   conn_class=self.connection_class)

    def output_type_handler(self):
        blob, long_raw = self.DB_TYPE_BLOB, self.DB_TYPE_LONG_RAW

        def handler(cursor, metadata):
            if metadata.type_code is blob:
                return cursor.var(long_raw, arraysize=cursor.arraysize)
            return None
        return handler

    def parse_dsn(self, dsn):
        params = self.module.ConnectParams()
        try:
            params.parse_connect_string(dsn)
        except self.Error:
            return None
        return (params.host, params.port, params.service_name or params.sid)

    def split_credentials(self, dsn):
        if '@' not in dsn:
            return None, None, dsn
        return self.module.ConnectParams().parse_dsn_with_credentials(dsn)


class CxOracleDriver(Driver):
    """The cx_Oracle module itself (thick: needs the Oracle client)."""

    name = 'cx_Oracle'
    module_name = 'cx_Oracle'
    package = 'cx_Oracle'

    def _connect(self, user, password, dsn, connect_timeout):
        return self.connection_class(user=user, password=password, dsn=dsn)

    def output_type_handler(self):
        blob, long_raw = self.DB_TYPE_BLOB, self.DB_TYPE_LONG_RAW

        def handler(cursor, name, default_type, size, precision, scale):
            if default_type is blob:
                return cursor.var(long_raw, arraysize=cursor.arraysize)
            return None
        return handler


def _connection_class(module):
    """Connection and cursor subclasses (a documented extension point of
    both drivers) whose cursors adapt bind values with ``bind_plan``."""

    class Cursor(module.Cursor):

        # Our statements bind by position; names (dicts, keywords) pass as is.
        def execute(self, statement, parameters=None, **kwargs):
            if parameters and isinstance(parameters, (list, tuple)):
                (parameters,), lobs = bind_plan([parameters])
                if lobs:
                    return self.connection.run_with_lobs(
                        'execute', statement, parameters, len(parameters), lobs)
            return super().execute(statement, parameters, **kwargs)

        def executemany(self, statement, parameters, **kwargs):
            if not isinstance(parameters, int):      # (an int: a row count)
                parameters = list(parameters)
                if all(isinstance(row, (list, tuple)) for row in parameters):
                    parameters, lobs = bind_plan(parameters)
                    if lobs:
                        return self.connection.run_with_lobs(
                            'executemany', statement, parameters, len(parameters[0]), lobs)
            return super().executemany(statement, parameters, **kwargs)

    class Connection(module.Connection):
        lob_type = getattr(module, 'DB_TYPE_BLOB', None)

        def cursor(self, *args, **kwargs):
            return Cursor(self, *args, **kwargs)

        def run_with_lobs(self, method, statement, parameters, width, lob_columns):
            # On a cursor of its own: bind variables typed by setinputsizes
            # would otherwise be reused by the next statements of the
            # connection's main cursor, making every byte string a LOB.
            cursor = super().cursor()
            try:
                cursor.setinputsizes(*[self.lob_type if i in lob_columns else None
                                       for i in range(width)])
                return getattr(cursor, method)(statement, parameters)
            finally:
                cursor.close()

    return Connection


_DRIVERS = {'oracledb': OracledbDriver, 'cx_Oracle': CxOracleDriver}


def select_driver(name='auto'):
    """The driver for ``name``.

    'auto' and 'oracledb' use python-oracledb; 'cx_Oracle' uses the
    cx_Oracle module when it is installed and python-oracledb otherwise.
    """
    canonical = canonical_name(name)
    if canonical == 'auto':
        candidates = (OracledbDriver, CxOracleDriver)
    elif canonical == 'cx_Oracle':
        candidates = (CxOracleDriver, OracledbDriver)
    else:
        candidates = (OracledbDriver,)
    driver, problems = drivers.first_importable(candidates)
    if driver is not None:
        return driver
    raise RelStorageError(
        "The Oracle driver %r is not installed: install oracledb "
        "(pip install oracledb; thin mode needs no Oracle client). Tried: %s"
        % (name or 'auto', '; '.join(problems)))
