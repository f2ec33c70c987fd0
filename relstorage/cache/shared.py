"""The shared state cache: memcached or Redis, shared by processes and hosts.

Only immutable facts go there: the state of revision (oid, tid), under a
key made of the cache prefix, the oid and the tid.  Which tid is current in
a snapshot is never taken from the shared cache, so a stale entry can never
be served: at worst an entry is never asked for again and expires.  Hints
(which tid was current as of a snapshot) and the hot list are facts of the
same kind, checked by the reader's change index before use.

The shared cache being down, slow or full is not an error: reads fall back
to the database.  The first failure of a server is logged at WARNING,
later ones at DEBUG, and a failed server is left alone for ``RETRY_AFTER``
seconds so that a dead server does not cost a timeout per read.

Everything here is the same for both kinds of server: the keys, the hints,
the hot list, spreading keys over several servers, and the health of each
server.  What differs is a small client interface, :class:`Server`, with
one implementation per protocol (memcache.py and redis_cache.py), chosen by
:func:`open_shared_cache` from ``cache-servers``.
"""
import importlib.util
import logging
import struct
import time
import zlib

from ..options import redact_secrets

log = logging.getLogger(__name__)

#: Seconds a failed server is skipped before it is tried again.
RETRY_AFTER = 5.0
#: Socket timeouts (seconds).
CONNECT_TIMEOUT = 0.5
TIMEOUT = 0.5
#: Largest value sent (memcached's default item size limit is 1 MB, key
#: and overhead included; Redis is held to the same, as one large value
#: blocks its single thread for every other client).
MAX_VALUE = 1000 * 1000
#: A hint's value: (tid, as_of), see get_hints.
_HINT = struct.Struct('>QQ')
_TID = struct.Struct('>Q')
#: Entries of the hot list (16 bytes each, compressed under MAX_VALUE).
HOT_MAX = 50000


def is_redis_url(text):
    return text.lower().startswith(('redis://', 'rediss://'))


def split_servers(text):
    """The entries of ``cache-servers``: separated by spaces, and memcached
    ``host:port`` entries by commas too (as some configurations write
    them: ``h1:11211,h2:11211`` was taken for one host named
    ``h1:11211,h2`` and the cache silently unused).  Not a Redis URL,
    whose password may hold a comma."""
    items = []
    for item in (text or '').split():
        if is_redis_url(item):
            items.append(item)
        else:
            items.extend(part for part in item.split(',') if part)
    return items


def check_servers(servers, module_name=None):
    """The entries of ``cache-servers`` and whether they are Redis URLs;
    ValueError naming what is wrong.  Reads the text only (no server is
    contacted, no client imported): the configuration's check, made when
    it is parsed, before any database is contacted."""
    items = split_servers(servers)
    if not items:
        raise ValueError('cache-servers names no server')
    redis = [item for item in items if is_redis_url(item)]
    if redis:
        if len(redis) != len(items):
            raise ValueError('cache-servers: Redis URLs and memcached host:port entries '
                             'cannot be mixed')
        if module_name not in (None, 'redis'):
            raise ValueError('cache-module-name %r is a memcached client; cache-servers '
                             'names Redis URLs (leave cache-module-name unset)'
                             % (module_name,))
        from .redis_cache import parse_url
        for item in items:
            parse_url(item)
    else:
        from .memcache import parse_servers
        parse_servers(items)
        if module_name == 'redis':
            raise ValueError('cache-module-name redis needs Redis URLs in cache-servers '
                             '(redis://host:port/db)')
    return items, bool(redis)


def missing_client(servers, module_name=None):
    """What open_shared_cache would refuse for want of its client package
    (a message), or None; imports nothing.  Checked before the storage
    touches the database (a helper agent's check: the schema was made,
    then the storage refused to open)."""
    if not servers or not servers.strip():
        return None
    _items, redis = check_servers(servers, module_name)
    package = 'redis' if redis else ('pylibmc' if module_name == 'pylibmc' else 'pymemcache')
    if importlib.util.find_spec(package) is not None:
        return None
    return ('cache-servers needs the %s package, which is not installed (pip install %s)'
            % (package, package))


def open_shared_cache(servers, module_name=None, prefix='relstorage'):
    """The shared cache that ``cache-servers`` (and ``cache-module-name``)
    describe: Redis for ``redis://`` / ``rediss://`` URLs, memcached for
    ``host:port`` entries."""
    items, redis = check_servers(servers, module_name)
    if redis:
        from .redis_cache import redis_servers
        backends = redis_servers(items)
    else:
        from .memcache import memcache_servers
        backends = memcache_servers(items, module_name)
    return SharedStateCache(backends, prefix)


class Server:
    """One server (or one client standing for several) and its health.

    Implementations define ``kind`` (for messages), ``label`` (safe to log:
    no password), and raise any exception from ``get_many`` / ``set_many``,
    which :class:`SharedStateCache` turns into a fallback to the database.
    """

    kind = 'shared cache'

    def __init__(self, label):
        self.label = label
        self.down_until = 0.0
        self.warned = False

    def get_many(self, keys):
        """{key: bytes} for those of ``keys`` (str) the server has."""
        raise NotImplementedError

    def set_many(self, values, wait):
        """Store ``values`` {key: bytes}.  With ``wait`` true, return only
        once the server has stored them; otherwise replies may be left
        unread where the protocol allows it."""
        raise NotImplementedError

    def close(self):
        pass

    def renew_locks(self):
        """(relstorage/locks.py) The clients' own locks are held only
        while they take a connection of their pool; a server whose client
        is not safe to share keeps a lock of its own (memcache.py)."""

    def is_connection_error(self, exc):
        return isinstance(exc, (OSError, EOFError))

    def usable(self):
        return not self.down_until or time.monotonic() >= self.down_until

    def failed(self, exc):
        self.down_until = time.monotonic() + RETRY_AFTER
        # (An error of no text, as pymemcache raises for a server that went
        # away, is named by its type: a helper agent saw "unavailable ()".)
        reason = redact_secrets(str(exc)) or type(exc).__name__
        if not self.warned:
            self.warned = True
            log.warning("%s at %s is unavailable (%s); reading from the database "
                        "instead until it answers again.", self.kind, self.label, reason)
        else:
            log.debug("%s at %s still failing: %s", self.kind, self.label, reason)

    def worked(self):
        if self.down_until:
            self.down_until = 0.0
            log.info("%s at %s answers again.", self.kind, self.label)
            self.warned = False


class SharedStateCache:
    """get/set of states keyed (oid, tid), hints, the hot list and small
    blobs, on one or more servers (keys are spread by a hash of the key)."""

    def __init__(self, servers, prefix='relstorage'):
        self._servers = list(servers)
        self.kind = self._servers[0].kind
        self.prefix = prefix
        # Hints and the hot list say which revision is current: a pack
        # makes that false for what it removed, so they live in a namespace
        # of the pack mark (StorageCache.note_pack_mark).  States, keyed by
        # (oid, tid), stay true.
        self.hint_prefix = prefix
        self.hits = self.misses = self.errors = self.stores = 0
        self.hint_hits = self.hint_misses = 0
        self.blob_hits = self.blob_misses = 0

    # ------------------------------------------------------------------

    def renew_locks(self):
        """(relstorage/locks.py)"""
        for server in self._servers:
            server.renew_locks()

    def key(self, oid, tid):
        return '%s:s:%x:%x' % (self.prefix, oid, tid)

    def _server_for(self, key):
        servers = self._servers
        if len(servers) == 1:
            return servers[0]
        return servers[zlib.crc32(key.encode('ascii')) % len(servers)]

    def _call(self, server, method, *args):
        if not server.usable():
            return None, False
        try:
            result = getattr(server, method)(*args)
        except Exception as exc:  # pylint:disable=broad-except
            self.errors += 1
            if server.is_connection_error(exc):
                server.failed(exc)
            else:
                log.debug("%s %s failed: %s", server.kind, method, redact_secrets(str(exc)))
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
        """{(oid, tid): state} for the pairs the shared cache has."""
        keys = {self.key(*pair): pair for pair in pairs}
        found = {keys[key]: value for key, value in self._get_keys(keys).items()}
        self.hits += len(found)
        self.misses += len(keys) - len(found)
        return found

    def set(self, oid, tid, state):
        self.set_many({(oid, tid): state})

    def set_many(self, states, hints=None, wait=False, hint_prefix=None):
        """Store ``states`` {(oid, tid): state} and ``hints`` {oid: (tid,
        as_of)} (under ``hint_prefix``, by default the current one); never
        raises.

        With ``wait`` false the replies may not be awaited (states read
        from the database: a lost one only costs a later miss).  With
        ``wait`` true the call returns once the servers have stored them,
        so another process told about the revision afterwards finds it
        (commits).
        """
        values = {}
        for (oid, tid), state in states.items():
            if state is not None and len(state) <= MAX_VALUE:
                values[self.key(oid, tid)] = bytes(state)
        if hints:
            for oid, (tid, as_of) in hints.items():
                values[self.hint_key(oid, hint_prefix)] = _HINT.pack(tid, as_of)
        self._set_keys(values, wait)

    # ------------------------------------------------------------------
    # Hints: which revision was current, shared between processes.
    #
    # ``<prefix>:t:<oid>`` holds (tid, as_of): "in snapshot as_of, oid's
    # current revision was tid".  That stays true forever, so an old hint is
    # never wrong, only less useful, until a pack removes the object or
    # the revision (hence hint_prefix: the pack mark in the key); the
    # reader combines it with its own
    # change log (mvcc.ChangeIndex.record) to decide whether it answers for
    # its snapshot.  It lets a fresh process find states in the shared
    # cache without asking the database which tid is current.

    def hint_key(self, oid, prefix=None):
        return '%s:t:%x' % (prefix or self.hint_prefix, oid)

    def get_hints(self, oids):
        """{oid: (tid, as_of)} for the oids the shared cache has a hint for."""
        keys = {self.hint_key(oid): oid for oid in oids}
        found = {}
        for key, value in self._get_keys(keys).items():
            if len(value) == _HINT.size:
                found[keys[key]] = _HINT.unpack(value)
        self.hint_hits += len(found)
        self.hint_misses += len(keys) - len(found)
        return found

    # ------------------------------------------------------------------
    # Blobs (blobs/cached.py): ``<prefix>:b:<oid>:<tid>`` holds the bytes
    # of a blob revision of at most MAX_VALUE bytes.

    def blob_key(self, oid, tid):
        return '%s:b:%x:%x' % (self.prefix, oid, tid)

    def get_blob(self, oid, tid):
        key = self.blob_key(oid, tid)
        value = self._get_keys((key,)).get(key)
        if value is None:
            self.blob_misses += 1
        else:
            self.blob_hits += 1
        return value

    def set_blob(self, oid, tid, data):
        if len(data) <= MAX_VALUE:
            self._set_keys({self.blob_key(oid, tid): data}, wait=True)

    # ------------------------------------------------------------------
    # The hot list: what one process had in its local cache, so that a
    # fresh process (another worker, another host) can start warm.
    # ``<prefix>:hot`` holds as_of and (oid, tid) pairs, most recently used
    # first, each a hint as above; the last process to publish wins.

    def hot_key(self):
        return '%s:hot' % (self.hint_prefix,)

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

    def _by_server(self, keys):
        if len(self._servers) == 1:
            return [(self._servers[0], list(keys))]
        batches = {}
        for key in keys:
            server = self._server_for(key)
            batches.setdefault(id(server), (server, []))[1].append(key)
        return list(batches.values())

    def _get_keys(self, keys):
        """{key: bytes} for those of ``keys`` the servers have (one request
        per server)."""
        found = {}
        for server, batch in self._by_server(keys):
            values, _ = self._call(server, 'get_many', batch)
            for key, value in (values or {}).items():
                if isinstance(key, bytes):
                    key = key.decode('ascii')
                if value is not None and key in keys:
                    found[key] = bytes(value)
        return found

    def _set_keys(self, values, wait):
        if len(self._servers) == 1:
            batches = [(self._servers[0], values)]
        else:
            batches = [(server, {key: values[key] for key in keys})
                       for server, keys in self._by_server(values)]
        for server, batch in batches:
            _, ok = self._call(server, 'set_many', batch, wait)
            if ok:
                self.stores += len(batch)

    def stats(self):
        total = self.hits + self.misses
        return {'kind': self.kind, 'hits': self.hits, 'misses': self.misses,
                'errors': self.errors, 'stores': self.stores,
                'ratio': (self.hits / total) if total else 0.0,
                'hint_hits': self.hint_hits, 'hint_misses': self.hint_misses,
                'blob_hits': self.blob_hits, 'blob_misses': self.blob_misses,
                'servers': [s.label for s in self._servers],
                'down': [s.label for s in self._servers if not s.usable()]}

    def close(self):
        for server in self._servers:
            try:
                server.close()
            except Exception:  # pylint:disable=broad-except
                log.debug("closing the %s client failed", server.kind, exc_info=True)
