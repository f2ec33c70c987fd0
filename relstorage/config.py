"""ZConfig factories for ``%import relstorage`` (see component.xml).

Everything here runs when a configuration file is parsed, so a bad value
fails then, naming its key, before any database is touched. Storage,
adapter and driver modules are imported only by ``open()``/``create()``.
"""

import logging
import os
import re

import ZConfig
import ZConfig.datatypes
from ZODB.config import BaseConfig

from relstorage.adapters.mysql import drivers as mysql_drivers
from relstorage.adapters.oracle import drivers as oracle_drivers
from relstorage.adapters.postgresql import drivers as postgresql_drivers
from relstorage.adapters.sqlite import drivers as sqlite_drivers
from relstorage.directories import not_a_directory
from relstorage.options import Options
from relstorage.options import redact_secrets

logger = logging.getLogger(__name__)

_registry = ZConfig.datatypes.Registry()


def _dirpath(value):
    """A directory the storage makes at open, with its missing parents
    (blob-dir, cache-local-dir): RelStorage 4.3 made the whole path, and
    its configurations naming one whose parent did not exist yet did not
    load (a helper agent's check).  What cannot be a directory is still
    refused here.  An empty value (a %define left empty) stays empty,
    which is no directory (a review finding: it became the working
    directory, and blobs went where the process happened to start)."""
    if not value.strip():
        return ''
    path = os.path.abspath(os.path.expanduser(value))
    problem = not_a_directory(path)
    if problem:
        raise ValueError('%s: %s' % (value, problem))
    return path


_registry.register('dirpath', _dirpath)


def _named_datatype(key, datatype, option=None, valid=None):
    """Return a ZConfig conversion for *datatype* whose errors start with
    the key's name (ZConfig's own messages give only the value and line).
    With an *option*, the converted value goes through its ``convert``
    (aliases, choices); ``valid`` is (predicate, what it demands) for a
    key that has no Option."""
    convert = _registry.get(datatype)

    def conversion(value):
        try:
            result = convert(value)
        except ValueError as e:
            # ZConfig says "does not exist" also when a file is in the way.
            problem = datatype == 'existing-dirpath' and not_a_directory(value)
            if problem:
                e = '%s: %s' % (value, problem)
            raise ValueError('%s: %s' % (key, e)) from None
        if datatype == 'existing-dirpath' and result:
            # ZConfig checks only the parent: the path itself, or a part of
            # it, may be a file (a helper agent's check: blob-dir naming a
            # file was refused once the storage had made its schema).
            problem = not_a_directory(result)
            if problem:
                raise ValueError('%s: %s: %s' % (key, value, problem))
        if option is not None:
            result = option.convert(result)
        if valid is not None and result is not None and not valid[0](result):
            raise ValueError('%s: %r %s' % (key, value, valid[1]))
        return result
    conversion.key = key
    conversion.datatype = datatype
    conversion.choices = option.choices if option is not None else None
    conversion.__name__ = key.replace('-', '_')
    return conversion


def dashed_key(name):
    """Key type of sections whose keys are spelled with dashes
    (``keep-history``): the underscore spelling names the same key."""
    return _registry.get('basic-key')(name).replace('_', '-')


def underscored_key(name):
    """Key type of sections whose keys are spelled with underscores
    (``unix_socket``): the dash spelling names the same key."""
    return _registry.get('basic-key')(name).replace('-', '_')


def _driver_datatype(database, names):
    """Conversion for an adapter's ``driver`` key: case-insensitive match
    against *names*, returning the canonical spelling."""
    lookup = {}
    for canonical, aliases in names.items():
        for alias in (canonical,) + aliases:
            lookup[alias.lower()] = canonical
    # Kept as written; AdapterFactory replaces them, with a warning.
    for legacy in LEGACY_DRIVER_NAMES.get(database, ()):
        lookup[legacy.lower()] = legacy

    def conversion(value):
        try:
            return lookup[value.strip().lower()]
        except KeyError:
            raise ValueError('driver: %r is not a known %s driver; use one '
                             'of %s' % (value, database,
                                        ', '.join(names))) from None
    conversion.names = dict(names)
    return conversion


#: Driver names of earlier releases: database -> {name: the driver used
#: instead}. Accepted with a warning.  The gevent drivers become 'auto',
#: which in a process gevent has patched takes the driver that waits
#: cooperatively (psycopg 3, PyMySQL: adapters/drivers.gevent_patched);
#: the plain psycopg2 and MySQLdb they were mapped to before stopped every
#: greenlet while a commit waited for the commit lock (a helper agent's
#: check).
LEGACY_DRIVER_NAMES = {
    'sqlite3': {'gevent sqlite3': 'sqlite3'},
    'postgresql': {'gevent psycopg2': 'auto', 'psycopg2cffi': 'auto',
                   'pg8000': 'auto'},
    'mysql': {'gevent MySQLdb': 'auto', 'C MySQL Connector': 'auto',
              'Py MySQL Connector': 'auto'},
}

#: Driver names accepted by each adapter section: canonical name (the
#: importable module) -> other accepted spellings. Matching ignores case.
#: (Each vendor's drivers module owns its table; none imports a driver.)
DRIVER_NAMES = {
    'sqlite3': sqlite_drivers.DRIVER_NAMES,
    'postgresql': postgresql_drivers.DRIVER_NAMES,
    'mysql': mysql_drivers.DRIVER_NAMES,
    'oracle': oracle_drivers.DRIVER_NAMES,
}


class keys:
    """Datatypes named in component.xml as ``relstorage.config.keys.NAME``.

    One per ``<relstorage>`` key (from options.py) and per adapter key that
    can hold a bad value, so every conversion error names its key.
    """


for _option in Options.OPTIONS:
    setattr(keys, _option.attribute,
            _named_datatype(_option.name, _option.datatype, _option))
for _database, _names in DRIVER_NAMES.items():
    setattr(keys, _database + '_driver', _driver_datatype(_database, _names))
keys.sqlite3_data_dir = _named_datatype('data-dir', 'existing-dirpath')
# (Not ZConfig's port-number: "-1 is below lower bound (0)", where 0
# is refused too.)
keys.mysql_port = _named_datatype('port', 'integer', valid=(
    lambda v: 0 < v < 65536, 'is not a port number (1 to 65535)'))
keys.mysql_connect_timeout = _named_datatype('connect_timeout', 'integer', valid=(
    lambda v: v >= 0, 'must be a number of seconds, 0 or more'))
keys.mysql_compress = _named_datatype('compress', 'boolean')
keys.oracle_commit_lock_id = _named_datatype('commit-lock-id', 'integer')
keys.oracle_twophase = _named_datatype('twophase', 'boolean')


def _mysql_ssl(value):
    # Ignored with a warning like the other keys of earlier releases, it
    # let a configuration that asked for TLS connect without it.
    raise ValueError(
        'ssl: not supported in <mysql>; RelStorage would connect without TLS. To '
        'connect with TLS, name an option file whose [client] group has ssl-ca (and '
        'ssl-cert, ssl-key) with read_default_file')


keys.mysql_ssl = _mysql_ssl
del _option, _database, _names

#: Keys of the adapter sections that earlier releases documented and that no
#: longer apply: database -> (keys, why). component.xml declares them; they
#: are accepted and ignored, with one warning when the section is read.
LEGACY_ADAPTER_KEYS = {
    'mysql': (('conv', 'named_pipe', 'init_command', 'cursorclass',
               'use_unicode', 'charset', 'sql_mode', 'client_flag', 'load_infile'),
              'RelStorage sets up its MySQL sessions itself: utf8mb4, '
              'binary data, its own SQL mode'),
    'sqlite3': (('gevent_yield_interval',),
                'there is no gevent driver; use driver sqlite3'),
}


def pragmas(section):
    """Datatype of ``<pragmas>``: pragma name -> value, checked against the
    pragmas SQLite documents so a misspelt name or a bad value fails while
    the file is parsed."""
    from relstorage.adapters.sqlite.pragmas import check_pragmas
    return check_pragmas(section.pragmas)


class RelStorageFactory(BaseConfig):
    """Datatype of the ``<relstorage>`` section.

    Builds :class:`~relstorage.options.Options` immediately, so a bad
    combination fails while the file is parsed; ``open()`` creates the
    adapter and the storage.
    """

    def __init__(self, config):
        BaseConfig.__init__(self, config)
        self.options = self._build_options()

    def _build_options(self):
        section = self.config
        values = {}
        for option in Options.OPTIONS:
            if option.attribute == 'driver':
                continue
            values[option.attribute] = getattr(section, option.attribute)
        # Without a name key, a named section (<relstorage foo>) names it.
        if values['name'] is None and self.name:
            values['name'] = self.name
        values['driver'] = section.adapter.driver
        try:
            return Options(**values)
        except (TypeError, ValueError) as e:
            raise ZConfig.ConfigurationError(str(e)) from None

    def open(self, database_name='unnamed', databases=None):
        from relstorage.storage.earlier import open_storage
        options = self.options
        return open_storage(self.config.adapter.create(options), options)


class AdapterFactory:
    """Base for the datatypes of the adapter sections."""

    database = None

    def __init__(self, config):
        self.config = config
        self.name = config.getSectionName()
        self.driver = config.driver
        self._replace_legacy()

    def _replace_legacy(self):
        replacement = LEGACY_DRIVER_NAMES.get(self.database, {}).get(self.driver)
        if replacement is not None:
            logger.warning('%s driver %r is from an earlier release and not '
                           'supported; using driver %s', self.database,
                           self.driver, replacement)
            self.driver = replacement
        names, why = LEGACY_ADAPTER_KEYS.get(self.database, ((), None))
        for key in names:
            if getattr(self.config, key, None) is not None:
                logger.warning('%s key %s is from an earlier release and no '
                               'longer used (%s)', self.database, key, why)

    def create(self, options):
        """Return the adapter for *options* (imports the driver lazily)."""
        raise NotImplementedError

    def adapter_class(self):
        """The class ``create`` makes (its module imports no driver)."""
        raise NotImplementedError

    def __repr__(self):
        return '<%s driver=%r>' % (type(self).__name__, self.driver)


class Sqlite3AdapterFactory(AdapterFactory):
    database = 'sqlite3'

    @property
    def data_dir(self):
        return self.config.data_dir

    @property
    def pragmas(self):
        return dict(self.config.pragmas or {})

    def adapter_class(self):
        from relstorage.adapters.sqlite.adapter import Sqlite3Adapter
        return Sqlite3Adapter

    def create(self, options):
        from relstorage.adapters.sqlite.adapter import Sqlite3Adapter
        return Sqlite3Adapter(data_dir=self.data_dir, pragmas=self.pragmas,
                              options=options)

    def __repr__(self):
        return '<%s data_dir=%r driver=%r>' % (
            type(self).__name__, self.data_dir, self.driver)


class PostgreSQLAdapterFactory(AdapterFactory):
    database = 'postgresql'

    @property
    def dsn(self):
        return self.config.dsn

    def adapter_class(self):
        from relstorage.adapters.postgresql.adapter import PostgreSQLAdapter
        return PostgreSQLAdapter

    def create(self, options):
        from relstorage.adapters.postgresql.adapter import PostgreSQLAdapter
        return PostgreSQLAdapter(dsn=self.dsn, options=options)

    def __repr__(self):
        return '<%s dsn=%r driver=%r>' % (
            type(self).__name__, redact_secrets(self.dsn), self.driver)


class MySQLAdapterFactory(AdapterFactory):
    database = 'mysql'

    #: Keys passed to the driver's connect(), when set.
    CONNECT_KEYS = mysql_drivers.CONNECT_KEYS

    @property
    def connect_kwargs(self):
        kwargs = {}
        for key in self.CONNECT_KEYS:
            value = getattr(self.config, key)
            if value is not None:
                kwargs[key] = value
        return kwargs

    def adapter_class(self):
        from relstorage.adapters.mysql.adapter import MySQLAdapter
        return MySQLAdapter

    def create(self, options):
        from relstorage.adapters.mysql.adapter import MySQLAdapter
        return MySQLAdapter(options=options, **self.connect_kwargs)

    def __repr__(self):
        shown = {k: ('***' if k == 'passwd' else v)
                 for k, v in self.connect_kwargs.items()}
        return '<%s %r driver=%r>' % (type(self).__name__, shown, self.driver)


class OracleAdapterFactory(AdapterFactory):
    database = 'oracle'

    def adapter_class(self):
        from relstorage.adapters.oracle.adapter import OracleAdapter
        return OracleAdapter

    def create(self, options):
        from relstorage.adapters.oracle.adapter import OracleAdapter
        # zodburi builds a section without the compatibility keys.
        return OracleAdapter(user=self.config.user,
                             password=self.config.password,
                             dsn=self.config.dsn, options=options,
                             commit_lock_id=getattr(self.config, 'commit_lock_id', None),
                             twophase=getattr(self.config, 'twophase', False))

    def __repr__(self):
        dsn = self.config.dsn
        if dsn:
            # Oracle's own user/password@connect-string form.
            dsn = re.sub(r'^([^/@(]*)/[^@]*@', r'\1/***@', dsn)
        return '<%s user=%r dsn=%r driver=%r>' % (
            type(self).__name__, self.config.user, redact_secrets(dsn), self.driver)


__all__ = ['RelStorageFactory', 'AdapterFactory', 'Sqlite3AdapterFactory',
           'PostgreSQLAdapterFactory', 'MySQLAdapterFactory',
           'OracleAdapterFactory', 'DRIVER_NAMES', 'keys']
