"""zodburi resolvers: open a RelStorage from a URI.

Registered as ``zodburi.resolvers`` entry points (see setup.py)::

    postgres://user:password@host:5432/dbname?keep_history=false
    postgresql://...                     (the same)
    mysql://user:password@host:3306/dbname?cache-local-mb=50
    sqlite:///path/to/data-dir           or  sqlite://?data_dir=/path/to/data-dir
    sqlite3://...                        (the same)
    oracle://user:password@host:1521/service

Every ``<relstorage>`` option is accepted as a query argument, spelled with
dashes or underscores, and converted exactly as in a configuration file
(the datatypes come from relstorage.config, which takes them from
options.py).  Each adapter also takes its own section keys (``driver``; for
PostgreSQL ``dsn`` adding libpq parameters; for MySQL ``unix_socket``,
``connect_timeout``, ``compress``, ``read_default_file``,
``read_default_group``; for SQLite ``pragma_NAME=value``); a PostgreSQL URI
also takes libpq's connection parameters (``connect_timeout``,
``sslmode``, ``host=/var/run/postgresql``...).  Booleans are also
written as zodburi's resolvers write them (``keep_history=0``,
``read_only=1``), and ``demostorage=1`` wraps the storage in a
DemoStorage as zodburi's own resolvers do (deprecated there too).  ZODB.DB
arguments (``database_name``, ``connection_cache_size``, ...) are returned
in the second item, as every zodburi resolver does.  Anything else raises
``ValueError`` naming the argument.  A password never appears in a message.
"""
import re
import warnings
from urllib.parse import parse_qsl
from urllib.parse import unquote
from urllib.parse import urlsplit

from relstorage.adapters.mysql import drivers as mysql_drivers
from relstorage.options import PASSWORD_NOT_ENCODED
from relstorage.options import Options
from relstorage.options import password_not_encoded

#: Boolean spellings of zodburi's own resolvers (zodburi.datatypes), which
#: URIs written for them and for earlier RelStorage releases use
#: (``keep_history=0``, ``read_only=1``); ZConfig's boolean takes the words.
_TRUE = ('1', 'on', 'true', 't', 'yes', 'y')
_FALSE = ('', '0', 'off', 'false', 'f', 'no', 'n')

#: libpq's connection parameters, taken as query arguments of a PostgreSQL
#: URI (as libpq's own URIs take them) into the connection string.
LIBPQ_KEYS = (
    'host', 'hostaddr', 'port', 'dbname', 'user', 'password', 'passfile',
    'channel_binding', 'connect_timeout', 'client_encoding', 'options',
    'application_name', 'fallback_application_name', 'keepalives',
    'keepalives_idle', 'keepalives_interval', 'keepalives_count',
    'tcp_user_timeout', 'gssencmode', 'sslmode', 'requiressl', 'sslcompression',
    'sslcert', 'sslkey', 'sslpassword', 'sslrootcert', 'sslcrl', 'sslcrldir',
    'sslsni', 'requirepeer', 'ssl_min_protocol_version', 'ssl_max_protocol_version',
    'krbsrvname', 'gsslib', 'service', 'target_session_attrs', 'load_balance_hosts')


def _convert(scheme, convert, value):
    """``value`` through a ZConfig conversion of relstorage.config; a
    boolean also in zodburi's spellings."""
    if getattr(convert, 'datatype', None) == 'boolean':
        lowered = value.strip().lower()
        if lowered in _TRUE:
            value = 'true'
        elif lowered in _FALSE:
            value = 'false'
    try:
        return convert(value)
    except ValueError as exc:
        raise ValueError('%s URI: %s' % (scheme, exc)) from None


#: Query arguments handed back for ZODB.DB (zodburi converts them).
DB_ARGS = ('database_name',) + tuple('connection_' + name for name in (
    'pool_size', 'pool_timeout', 'cache_size', 'cache_size_bytes',
    'historical_pool_size', 'historical_cache_size', 'historical_cache_size_bytes',
    'historical_timeout', 'large_record_size'))


class _Section:
    """Stands in for a parsed adapter section so that the factories of
    relstorage.config build the adapter exactly as for a config file."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def getSectionName(self):
        return None


class Resolver:
    """Base of the per-database resolvers; subclasses parse the location."""

    scheme = None
    database = None         # key of relstorage.config.DRIVER_NAMES
    adapter_keys = ()       # extra query keys for the adapter section

    def __call__(self, uri):
        if password_not_encoded(uri):
            # Else the rest of the password is read as the path or the
            # query, and quoted as an unknown argument (a helper agent's
            # check).
            raise ValueError('%s URI: %s' % (self.scheme, PASSWORD_NOT_ENCODED))
        parts = urlsplit(uri)
        if parts.fragment:
            raise ValueError('%s URI: fragments (#...) are not allowed' % self.scheme)
        query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False)
        demo = [value for key, value in query if key == 'demostorage']
        query = [(key, value) for key, value in query if key != 'demostorage']
        if len(demo) > 1:
            raise ValueError("%s URI: 'demostorage' is given more than once" % self.scheme)
        # zodburi's resolvers wrap their storage in a DemoStorage when asked
        # (deprecated there in favour of demo://, but URIs still carry it).
        demo = bool(demo) and _convert(self.scheme, _boolean('demostorage'), demo[-1])
        if demo:
            warnings.warn("demostorage option is deprecated, use demo:// instead",
                          DeprecationWarning, stacklevel=2)
        option_values, adapter_values, dbkw = self._split_query(query)
        section = self.section(parts, adapter_values)
        adapter_factory = self.factory_class()(section)
        options = self._options(option_values, adapter_factory.driver)

        def factory():
            from relstorage.storage.earlier import open_storage
            storage = open_storage(adapter_factory.create(options), options)
            if demo:
                from ZODB.DemoStorage import DemoStorage
                return DemoStorage(base=storage)
            return storage
        factory.options = options
        factory.adapter_factory = adapter_factory
        return factory, dbkw

    # ------------------------------------------------------------------

    def _split_query(self, query):
        from relstorage import config
        options, adapter, dbkw = {}, {}, {}
        given = {}
        for key, value in query:
            name = key.replace('-', '_')
            if name in given:
                # As in a configuration file: which one was meant?
                raise ValueError('%s URI: %r is given more than once (as %s and %s)'
                                 % (self.scheme, name, given[name], key))
            given[name] = key
            if name in DB_ARGS:
                dbkw[name] = value
            elif name == 'driver' or name in self.adapter_keys or self._is_adapter_key(name):
                adapter[name] = value
            elif hasattr(config.keys, name) and name in Options._by_attribute \
                    and name != 'driver':
                options[name] = _convert(self.scheme, getattr(config.keys, name), value)
            else:
                # (A helper agent's check: ?ssl=1 was only "unknown".)
                hint = (' (TLS: name a MySQL option file with its ssl settings, '
                        'read_default_file)' if name.startswith('ssl')
                        and 'read_default_file' in self.adapter_keys else '')
                raise ValueError(
                    '%s URI: unknown argument %r%s; use a RelStorage option (%s), an '
                    'adapter key (%s) or a ZODB.DB argument (%s)' % (
                        self.scheme, key, hint,
                        ', '.join(o.name for o in Options.OPTIONS
                                  if o.attribute != 'driver'),
                        ', '.join(('driver',) + tuple(self.adapter_keys)),
                        ', '.join(DB_ARGS)))
        return options, adapter, dbkw

    def _is_adapter_key(self, name):
        return False

    def _driver(self, adapter_values):
        from relstorage import config
        convert = getattr(config.keys, self.database + '_driver')
        try:
            return convert(adapter_values.pop('driver', 'auto'))
        except ValueError as exc:
            raise ValueError('%s URI: %s' % (self.scheme, exc)) from None

    def _options(self, values, driver):
        values = dict(values)
        values['driver'] = driver
        try:
            return Options(**values)
        except (TypeError, ValueError) as exc:
            raise ValueError('%s URI: %s' % (self.scheme, exc)) from None

    def section(self, parts, adapter_values):
        raise NotImplementedError

    def factory_class(self):
        raise NotImplementedError


def _libpq_quote(value):
    return "'%s'" % str(value).replace('\\', '\\\\').replace("'", "\\'")


class PostgreSQLResolver(Resolver):
    scheme = 'postgresql'
    database = 'postgresql'
    adapter_keys = ('dsn',) + LIBPQ_KEYS

    def section(self, parts, adapter_values):
        driver = self._driver(adapter_values)
        params = []
        hosts = parts.netloc.rsplit('@', 1)[-1]
        if ',' in hosts:
            # libpq's list of servers (postgresql://h1:5432,h2:5433/db, with
            # target_session_attrs): a helper agent's check found it refused
            # as a port that is not a number.
            params.extend(_host_list(hosts, self.scheme))
        else:
            if parts.hostname:
                params.append(('host', unquote(parts.hostname)))
            if _port(parts, self.scheme):
                params.append(('port', str(_port(parts, self.scheme))))
        if parts.username:
            params.append(('user', unquote(parts.username)))
        if parts.password is not None:
            params.append(('password', unquote(parts.password)))
        dbname = unquote(parts.path.lstrip('/'))
        if dbname:
            params.append(('dbname', dbname))
        # libpq parameters given as query arguments (a socket directory as
        # host=/var/run/postgresql, connect_timeout=10, sslmode=...).
        for key in LIBPQ_KEYS:
            if key in adapter_values:
                if any(name == key for name, _ in params):
                    raise ValueError('%s URI: %s is given both in the address and as a '
                                     'query argument' % (self.scheme, key))
                params.append((key, adapter_values.pop(key)))
        dsn = ' '.join('%s=%s' % (k, _libpq_quote(v)) for k, v in params)
        extra = adapter_values.pop('dsn', '')
        if extra:
            dsn = (dsn + ' ' + extra).strip()
        return _Section(dsn=dsn, driver=driver)

    def factory_class(self):
        from relstorage.config import PostgreSQLAdapterFactory
        return PostgreSQLAdapterFactory


def _legacy_adapter_keys(database):
    from relstorage.config import LEGACY_ADAPTER_KEYS
    return LEGACY_ADAPTER_KEYS[database][0]


class MySQLResolver(Resolver):
    scheme = 'mysql'
    database = 'mysql'
    adapter_keys = tuple(key for key in mysql_drivers.CONNECT_KEYS
                         if key not in mysql_drivers.URI_NETLOC_KEYS
                         ) + _legacy_adapter_keys('mysql')

    def section(self, parts, adapter_values):
        from relstorage import config
        driver = self._driver(adapter_values)
        values = dict.fromkeys(mysql_drivers.CONNECT_KEYS + _legacy_adapter_keys('mysql'))
        values['host'] = unquote(parts.hostname) if parts.hostname else None
        values['port'] = _port(parts, self.scheme)
        values['user'] = unquote(parts.username) if parts.username else None
        values['passwd'] = unquote(parts.password) if parts.password is not None else None
        values['db'] = unquote(parts.path.lstrip('/')) or None
        for key, value in adapter_values.items():
            convert = getattr(config.keys, 'mysql_' + key, None)
            if convert is not None:
                value = _convert(self.scheme, convert, value)
            values[key] = value
        return _Section(driver=driver, **values)

    def factory_class(self):
        from relstorage.config import MySQLAdapterFactory
        return MySQLAdapterFactory


class SqliteResolver(Resolver):
    scheme = 'sqlite'
    database = 'sqlite3'
    adapter_keys = ('data_dir',) + _legacy_adapter_keys('sqlite3')

    def _is_adapter_key(self, name):
        return name.startswith('pragma_')

    def section(self, parts, adapter_values):
        driver = self._driver(adapter_values)
        if parts.netloc:
            raise ValueError('%s URI: no host is allowed; write sqlite:///path/to/dir or '
                             'sqlite://?data_dir=/path/to/dir' % self.scheme)
        path = unquote(parts.path)
        data_dir = adapter_values.pop('data_dir', None)
        if path and data_dir:
            raise ValueError('%s URI: give the data directory either as the path or as '
                             'data_dir, not both' % self.scheme)
        data_dir = data_dir or path
        if not data_dir:
            raise ValueError('%s URI: the data directory is missing; write '
                             'sqlite:///path/to/dir or sqlite://?data_dir=/path/to/dir'
                             % self.scheme)
        # Checked as in a configuration file: its parent must exist.
        from relstorage import config
        data_dir = _convert(self.scheme, config.keys.sqlite3_data_dir, data_dir)
        from relstorage.adapters.sqlite.pragmas import check_pragmas
        try:
            pragmas = check_pragmas({key[len('pragma_'):]: value
                                     for key, value in adapter_values.items()
                                     if key.startswith('pragma_')})
        except ValueError as exc:
            raise ValueError('%s URI: %s' % (self.scheme, exc)) from None
        return _Section(data_dir=data_dir, pragmas=pragmas, driver=driver,
                        **{key: adapter_values.get(key)
                           for key in _legacy_adapter_keys('sqlite3')})

    def factory_class(self):
        from relstorage.config import Sqlite3AdapterFactory
        return Sqlite3AdapterFactory


class OracleResolver(Resolver):
    scheme = 'oracle'
    database = 'oracle'
    adapter_keys = ('dsn',)

    def section(self, parts, adapter_values):
        driver = self._driver(adapter_values)
        dsn = adapter_values.pop('dsn', None)
        if not dsn:
            host = parts.hostname or ''
            port = _port(parts, self.scheme)
            dsn = host + (':%d' % port if port else '') + parts.path
        return _Section(user=unquote(parts.username) if parts.username else None,
                        password=unquote(parts.password) if parts.password is not None
                        else None,
                        dsn=dsn or None, driver=driver)

    def factory_class(self):
        from relstorage.config import OracleAdapterFactory
        return OracleAdapterFactory


def _boolean(key):
    from relstorage import config
    return config._named_datatype(key, 'boolean')


def _host_list(hosts, scheme):
    """[('host', 'h1,h2'), ('port', 'p1,p2')] of a libpq URI's list of
    servers (``h1:5432,[::1]:5433,h3``; an empty port is the default)."""
    names, ports = [], []
    for entry in hosts.split(','):
        match = re.fullmatch(r'(\[[^\]]*\]|[^:\[\]]*)(?::([^:]*))?', entry)
        if match is None or not match.group(1):
            raise ValueError('%s URI: %r in the list of servers is not host[:port]'
                             % (scheme, entry))
        name, port = match.group(1).strip('[]'), match.group(2) or ''
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError('%s URI: the port of %r is not a number from 1 to 65535'
                             % (scheme, entry))
        names.append(unquote(name))
        ports.append(port)
    params = [('host', ','.join(names))]
    if any(ports):
        params.append(('port', ','.join(ports)))
    return params


def _port(parts, scheme):
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 0 < port < 65536:
        # (0 too, as a config file says: a helper agent's check found
        # ``:0`` opened the default port and reported ":0".)
        raise ValueError('%s URI: the port is not a number from 1 to 65535'
                         % scheme) from None
    return port


postgresql_resolver = PostgreSQLResolver()
mysql_resolver = MySQLResolver()
sqlite_resolver = SqliteResolver()
oracle_resolver = OracleResolver()
