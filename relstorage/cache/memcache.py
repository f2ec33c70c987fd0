"""memcached as a second-level state cache shared by processes and hosts.

Only immutable facts go to memcached: the state of revision (oid, tid),
under a key made of the cache prefix, the oid and the tid.  Which tid is
current in a snapshot is never taken from memcached, so a stale entry can
never be served: at worst an entry is never asked for again and expires.

memcached being down, slow or full is not an error: reads fall back to the
database.  The first failure of a server is logged at WARNING, later ones
at DEBUG, and a failed server is left alone for ``RETRY_AFTER`` seconds so
that a dead server does not cost a timeout per read.

``cache-module-name`` selects the client: ``pymemcache`` (the default) or
``pylibmc``.
"""
import importlib
import logging
import struct
import threading
import time
import zlib

log = logging.getLogger(__name__)

#: Seconds a failed server is skipped before it is tried again.
RETRY_AFTER = 5.0
#: Socket timeouts (seconds) for pymemcache.
CONNECT_TIMEOUT = 0.5
TIMEOUT = 0.5
#: memcached's default item size limit is 1 MB (key and overhead included).
MAX_VALUE = 1000 * 1000
#: A hint's value: (tid, as_of), see get_hints.
_HINT = struct.Struct('>QQ')
_TID = struct.Struct('>Q')
#: Entries of the hot list (16 bytes each, compressed under MAX_VALUE).
HOT_MAX = 50000


def parse_servers(text):
    """'h1:11211 h2:11212' -> [('h1', 11211), ('h2', 11212)]."""
    servers = []
    for item in (text or '').split():
        host, sep, port = item.rpartition(':')
        if not sep:
            host, port = item, '11211'
        host = host.strip('[]')
        try:
            servers.append((host, int(port)))
        except ValueError:
            raise ValueError('cache-servers: %r is not host:port' % (item,)) from None
    return servers


class _Server:
    """One server and its health."""

    def __init__(self, address, client):
        self.address = address
        self.client = client
        self.down_until = 0.0
        self.warned = False

    def usable(self):
        return not self.down_until or time.monotonic() >= self.down_until

    def failed(self, exc):
        self.down_until = time.monotonic() + RETRY_AFTER
        if not self.warned:
            self.warned = True
            log.warning("memcached at %s:%s is unavailable (%s); reading from the "
                        "database instead until it answers again.",
                        self.address[0], self.address[1], exc)
        else:
            log.debug("memcached at %s:%s still failing: %s",
                      self.address[0], self.address[1], exc)

    def worked(self):
        if self.down_until:
            self.down_until = 0.0
            log.info("memcached at %s:%s answers again.", self.address[0], self.address[1])
            self.warned = False


class MemcacheStateCache:
    """get/set of states keyed (oid, tid) on one or more memcached servers."""

    def __init__(self, servers, module_name=None, prefix='relstorage'):
        addresses = parse_servers(servers) if isinstance(servers, str) else list(servers)
        if not addresses:
            raise ValueError('cache-servers names no server')
        self.prefix = prefix
        self.module_name = module_name or 'pymemcache'
        self.hits = self.misses = self.errors = self.stores = 0
        self.hint_hits = self.hint_misses = 0
        if self.module_name == 'pymemcache':
            from pymemcache.client.base import PooledClient
            self._servers = [
                _Server(addr, PooledClient(addr, connect_timeout=CONNECT_TIMEOUT,
                                           timeout=TIMEOUT, no_delay=True,
                                           default_noreply=True))
                for addr in addresses]
            self._lock = None
        elif self.module_name == 'pylibmc':
            module = importlib.import_module('pylibmc')
            # pylibmc hashes over its servers itself; one entry stands for all.
            client = module.Client(['%s:%d' % a for a in addresses], binary=True)
            self._servers = [_Server(addresses[0], client)]
            self._lock = threading.Lock()
        else:
            raise ValueError("cache-module-name: %r is not supported (use pymemcache "
                             "or pylibmc)" % (self.module_name,))

    # ------------------------------------------------------------------

    def key(self, oid, tid):
        return '%s:s:%x:%x' % (self.prefix, oid, tid)

    def _server_for(self, key):
        servers = self._servers
        if len(servers) == 1:
            return servers[0]
        return servers[zlib.crc32(key.encode('ascii')) % len(servers)]

    def _call(self, server, method, *args, **kw):
        if not server.usable():
            return None, False
        try:
            if self._lock is not None:
                with self._lock:
                    result = getattr(server.client, method)(*args, **kw)
            else:
                result = getattr(server.client, method)(*args, **kw)
        except Exception as exc:  # pylint:disable=broad-except
            self.errors += 1
            if _is_connection_error(exc):
                server.failed(exc)
            else:
                log.debug("memcached %s failed: %s", method, exc)
            return None, False
        server.worked()
        return result, True

    def get(self, oid, tid):
        key = self.key(oid, tid)
        value = self._get_keys((key,)).get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        return value

    def get_many(self, pairs):
        """{(oid, tid): state} for the pairs memcached has."""
        keys = {self.key(*pair): pair for pair in pairs}
        found = {keys[key]: value for key, value in self._get_keys(keys).items()}
        self.hits += len(found)
        self.misses += len(keys) - len(found)
        return found

    def set(self, oid, tid, state):
        self.set_many({(oid, tid): state})

    def set_many(self, states, hints=None, wait=False):
        """Store ``states`` {(oid, tid): state} and ``hints`` {oid: (tid,
        as_of)}; never raises.

        With ``wait`` false the replies are not awaited (states read from
        the database: a lost one only costs a later miss).  With ``wait``
        true the call returns once memcached has stored them, so another
        process told about the revision afterwards finds it (commits).
        """
        values = {}
        for (oid, tid), state in states.items():
            if state is not None and len(state) <= MAX_VALUE:
                values[self.key(oid, tid)] = bytes(state)
        if hints:
            for oid, (tid, as_of) in hints.items():
                values[self.hint_key(oid)] = _HINT.pack(tid, as_of)
        self._set_keys(values, wait)

    # ------------------------------------------------------------------
    # Hints: which revision was current, shared between processes.
    #
    # ``<prefix>:t:<oid>`` holds (tid, as_of): "in snapshot as_of, oid's
    # current revision was tid".  That stays true forever, so an old hint is
    # never wrong, only less useful; the reader combines it with its own
    # change log (mvcc.ChangeIndex.record) to decide whether it answers for
    # its snapshot.  It lets a fresh process find states in memcached
    # without asking the database which tid is current.

    def hint_key(self, oid):
        return '%s:t:%x' % (self.prefix, oid)

    def get_hints(self, oids):
        """{oid: (tid, as_of)} for the oids memcached has a hint for."""
        keys = {self.hint_key(oid): oid for oid in oids}
        found = {}
        for key, value in self._get_keys(keys).items():
            if len(value) == _HINT.size:
                found[keys[key]] = _HINT.unpack(value)
        self.hint_hits += len(found)
        self.hint_misses += len(keys) - len(found)
        return found

    # ------------------------------------------------------------------
    # The hot list: what one process had in its local cache, so that a
    # fresh process (another worker, another host) can start warm.
    # ``<prefix>:hot`` holds as_of and (oid, tid) pairs, most recently used
    # first, each a hint as above; the last process to publish wins.

    def hot_key(self):
        return '%s:hot' % (self.prefix,)

    def set_hot(self, as_of, pairs):
        pairs = pairs[:HOT_MAX]
        data = bytearray(_TID.pack(as_of))
        for oid, tid in pairs:
            data += _HINT.pack(oid, tid)
        self._set_keys({self.hot_key(): zlib.compress(bytes(data))}, wait=True)
        return len(pairs)

    def get_hot(self):
        """(as_of, [(oid, tid), ...]) or None."""
        key = self.hot_key()
        value = self._get_keys((key,)).get(key)
        if not value:
            return None
        try:
            data = zlib.decompress(value)
        except zlib.error:
            return None
        if len(data) < _TID.size or (len(data) - _TID.size) % _HINT.size:
            return None
        as_of, = _TID.unpack_from(data)
        return as_of, list(_HINT.iter_unpack(memoryview(data)[_TID.size:]))

    # ------------------------------------------------------------------

    def _get_keys(self, keys):
        """{key: bytes} for those of ``keys`` memcached has (one request per
        server)."""
        by_server = {}
        for key in keys:
            by_server.setdefault(id(self._server_for(key)), []).append(key)
        found = {}
        for server in self._servers:
            batch = by_server.get(id(server))
            if not batch:
                continue
            if len(batch) == 1:
                value, _ = self._call(server, 'get', batch[0])
                values = {batch[0]: value}
            else:
                method = 'get_multi' if self._lock is not None else 'get_many'
                values, _ = self._call(server, method, batch)
            for key, value in (values or {}).items():
                if isinstance(key, bytes):
                    key = key.decode('ascii')
                if value is not None and key in keys:
                    found[key] = bytes(value)
        return found

    def _set_keys(self, values, wait):
        by_server = {}
        for key, value in values.items():
            by_server.setdefault(id(self._server_for(key)), {})[key] = value
        for server in self._servers:
            batch = by_server.get(id(server))
            if batch:
                if self._lock is not None:
                    # pylibmc's set_multi always waits for its replies.
                    _, ok = self._call(server, 'set_multi', batch)
                else:
                    # pymemcache answers the keys that were not stored.
                    _, ok = self._call(server, 'set_many', batch,
                                       noreply=not wait)
                if ok:
                    self.stores += len(batch)

    def stats(self):
        total = self.hits + self.misses
        return {'hits': self.hits, 'misses': self.misses, 'errors': self.errors,
                'stores': self.stores, 'ratio': (self.hits / total) if total else 0.0,
                'hint_hits': self.hint_hits, 'hint_misses': self.hint_misses,
                'servers': ['%s:%d' % s.address for s in self._servers],
                'down': ['%s:%d' % s.address for s in self._servers if not s.usable()]}

    def close(self):
        for server in self._servers:
            try:
                close = getattr(server.client, 'close', None) or \
                    getattr(server.client, 'disconnect_all', None)
                if close is not None:
                    close()
            except Exception:  # pylint:disable=broad-except
                log.debug("closing memcached client failed", exc_info=True)


def _is_connection_error(exc):
    if isinstance(exc, (OSError, EOFError)):
        return True
    name = type(exc).__name__
    # pymemcache: MemcacheUnexpectedCloseError; pylibmc: ConnectionError,
    # ServerDown, SomeErrors, Timeout...
    return any(word in name for word in ('Close', 'Connection', 'ServerDown', 'Timeout',
                                         'SomeErrors', 'ServerDead'))
