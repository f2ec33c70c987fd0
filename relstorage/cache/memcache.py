"""memcached servers for the shared state cache (shared.py).

``cache-servers`` lists ``host:port`` entries; ``cache-module-name``
selects the client: ``pymemcache`` (the default) or ``pylibmc``.
"""
import importlib
import logging
import os
import threading

from .. import locks
from ..options import redact_secrets
from .shared import CONNECT_TIMEOUT
from .shared import TIMEOUT
from .shared import Server

log = logging.getLogger(__name__)


def parse_servers(items):
    """'h1:11211 h2:11212' (or a list of such entries) -> [('h1', 11211),
    ('h2', 11212)]."""
    if isinstance(items, str):
        from .shared import split_servers
        items = split_servers(items)
    servers = []
    for item in items or ():
        host, sep, port = item.rpartition(':')
        if not sep:
            host, port = item, '11211'
        host = host.strip('[]')
        # (A helper agent's check: an entry that is no host:port, such as
        # a URL of another scheme, may hold a password: it is shown
        # without, and the int() error, which quotes it, is not kept.)
        shown = redact_secrets(item)
        if '@' in shown:
            # (user:password@host, without a scheme: a review finding.)
            shown = '...@' + shown.rsplit('@', 1)[1]
        if not port.isdigit():
            raise ValueError('cache-servers: %r is not host:port' % (shown,))
        servers.append((host, int(port)))
        if not host or (':' in host and not item.startswith('[')):
            raise ValueError('cache-servers: %r is not host:port (an IPv6 address '
                             'goes in brackets: [::1]:11211)' % (shown,))
        if not 0 < servers[-1][1] < 65536:
            # (A helper agent's check: taken, then never reached.)
            raise ValueError('cache-servers: %r: the port is not a number from 1 to 65535'
                             % (shown,))
    return servers


def memcache_servers(items, module_name=None):
    """One :class:`~.shared.Server` per memcached server (pylibmc: one for
    all, as it spreads keys over its servers itself)."""
    addresses = parse_servers(items)
    if not addresses:
        raise ValueError('cache-servers names no server')
    module_name = module_name or 'pymemcache'
    if module_name == 'pymemcache':
        return [PymemcacheServer(address) for address in addresses]
    if module_name == 'pylibmc':
        return [PylibmcServer(addresses)]
    raise ValueError("cache-module-name: %r is not supported (use pymemcache "
                     "or pylibmc)" % (module_name,))


def _is_memcache_connection_error(exc):
    if isinstance(exc, (OSError, EOFError)):
        return True
    name = type(exc).__name__
    # pymemcache: MemcacheUnexpectedCloseError; pylibmc: ConnectionError,
    # ServerDown, SomeErrors, Timeout...
    return any(word in name for word in ('Close', 'Connection', 'ServerDown', 'Timeout',
                                         'SomeErrors', 'ServerDead'))


#: Clients a forked child inherited (see _MemcachedServer.client): kept,
#: never closed.
_INHERITED = []


class _MemcachedServer(Server):
    """A memcached client made by ``make()``, made again in a child
    process forked after it was made: the parent's sockets are not the
    child's to use (two processes reading replies from one socket take
    each other's), nor to close (the parent's goes on using them).  The
    parent's client is kept referenced, so that nothing closes its
    sockets."""

    kind = 'memcached'
    is_connection_error = staticmethod(_is_memcache_connection_error)

    def __init__(self, label, make):
        Server.__init__(self, label)
        self._make = make
        self._pid = os.getpid()
        self._client = make()
        # (A pylibmc client is not thread-safe; pymemcache's pool is.)
        self._lock = threading.Lock()
        self._locks_made_with = locks.made_now(self)

    def renew_locks(self):
        if locks.stale(self):
            self._lock = threading.Lock()

    @property
    def client(self):
        pid = os.getpid()
        if self._pid != pid:
            _INHERITED.append(self._client)
            # (The lock possibly held by a thread of the parent as it
            # forked.  Replaced before the pid says it is done: a review
            # finding.)
            self._lock = threading.Lock()
            self._client = self._make()
            self._pid = pid
        return self._client

    def _close_client(self, client):
        raise NotImplementedError

    def close(self):
        if self._pid == os.getpid():
            self._close_client(self._client)


class PymemcacheServer(_MemcachedServer):

    def __init__(self, address):
        try:
            from pymemcache.client.base import PooledClient
        except ImportError:
            raise ValueError('cache-servers names memcached servers, but the pymemcache '
                             'package is not installed (pip install '
                             'relstorage[memcache])') from None
        _MemcachedServer.__init__(
            self, '%s:%d' % address,
            lambda: PooledClient(address, connect_timeout=CONNECT_TIMEOUT, timeout=TIMEOUT,
                                 no_delay=True, default_noreply=True))

    def get_many(self, keys):
        client = self.client
        if len(keys) == 1:
            return {keys[0]: client.get(keys[0])}
        return client.get_many(keys)

    def set_many(self, values, wait):
        # Without noreply pymemcache reads the replies (the keys not stored).
        self.client.set_many(values, noreply=not wait)

    def failed(self, exc):
        _MemcachedServer.failed(self, exc)
        # The pool's other connections were most likely cut by the same
        # restart: dropped now, rather than each failing in turn and
        # keeping the server unused RETRY_AFTER longer (a helper agent's
        # check: one restart of memcached, three warnings and as many
        # pauses).  The pool opens new ones when asked.
        try:
            self.client.close()
        except Exception:  # pylint:disable=broad-except
            log.debug("Could not close the connections to memcached at %s", self.label,
                      exc_info=True)

    def _close_client(self, client):
        client.close()


class PylibmcServer(_MemcachedServer):

    def __init__(self, addresses):
        try:
            module = importlib.import_module('pylibmc')
        except ImportError:
            raise ValueError('cache-module-name pylibmc, but the pylibmc package is not '
                             'installed (pip install pylibmc, or leave cache-module-name '
                             'unset for pymemcache)') from None
        _MemcachedServer.__init__(
            self, ' '.join('%s:%d' % a for a in addresses),
            lambda: module.Client(['%s:%d' % a for a in addresses], binary=True))

    def get_many(self, keys):
        client = self.client        # (before the lock: see client)
        with self._lock:
            return client.get_multi(keys)

    def set_many(self, values, wait):
        client = self.client
        # pylibmc's set_multi always waits for its replies.
        with self._lock:
            client.set_multi(values)

    def _close_client(self, client):
        client.disconnect_all()
