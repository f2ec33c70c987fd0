"""A storage-wide, size-bounded LRU memo of pickled states keyed (oid, tid).

A state stored under (oid, tid) is that object's revision committed by
transaction tid, which never changes; so an entry can be stale (superseded)
but never wrong.  Knowing which tid is current for a given snapshot is the
business of :mod:`relstorage.cache.mvcc`, not this module's.

The bound counts the bytes of the stored pickles (after compression) and
what each entry costs besides (ENTRY_OVERHEAD), so that ``cache-local-mb``
bounds the memory it takes; 0 disables the cache.  (A helper agent's
check: counting only the pickles, 10 MB of 110-byte pickles took 33 MB.)  Pickles larger than
``cache-local-object-max`` are not kept.  With ``cache-local-compression
zlib`` a pickle is stored compressed when that makes it smaller.
"""
import threading
import zlib
from collections import OrderedDict

#: Pickles shorter than this are never compressed (zlib would not win).
COMPRESS_MIN = 64

#: Bytes an entry takes besides its pickle's: the ordered dict's slot and
#: link, the (oid, tid) key and its two ints, the bytes object's header
#: (measured with tracemalloc on CPython 3.11: about 235 plus 33).
ENTRY_OVERHEAD = 268


class _Compressed(bytes):
    """A zlib-compressed pickle (marks the entry, costs nothing extra)."""
    __slots__ = ()


class LocalStateCache:

    def __init__(self, limit_bytes, object_max, compression='none'):
        self.limit = max(0, int(limit_bytes))
        self.object_max = int(object_max)
        self.compress = (compression == 'zlib')
        self._data = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self):
        return len(self._data)

    def __contains__(self, key):
        return key in self._data

    @property
    def size(self):
        return self._size

    def get(self, oid_int, tid_int):
        """The state of revision (oid, tid), or None; counts a hit or miss."""
        key = (oid_int, tid_int)
        with self._lock:
            stored = self._data.get(key)
            if stored is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
        if type(stored) is _Compressed:
            return zlib.decompress(stored)
        return stored

    def put(self, oid_int, tid_int, state):
        if state is None or not self.limit or len(state) > self.object_max:
            return
        state = self._packed(state) if self.compress else bytes(state)
        key = (oid_int, tid_int)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._size -= len(old) + ENTRY_OVERHEAD
            self._data[key] = state
            self._size += len(state) + ENTRY_OVERHEAD
            while self._size > self.limit and self._data:
                _, evicted = self._data.popitem(last=False)
                self._size -= len(evicted) + ENTRY_OVERHEAD

    def put_many(self, entries):
        """``put`` for each (oid, tid, state) of ``entries`` (states are
        bytes, not None: not copied), under one acquisition of the lock."""
        if not self.limit:
            return
        object_max = self.object_max
        if self.compress:
            entries = [(oid_int, tid_int, self._packed(state))
                       for oid_int, tid_int, state in entries if len(state) <= object_max]
            object_max = float('inf')       # checked before compression
        data = self._data
        with self._lock:
            size = self._size
            for oid_int, tid_int, state in entries:
                length = len(state)
                if length > object_max:
                    continue
                key = (oid_int, tid_int)
                old = data.pop(key, None)
                if old is not None:
                    size -= len(old) + ENTRY_OVERHEAD
                data[key] = state
                size += length + ENTRY_OVERHEAD
            while size > self.limit and data:
                _, evicted = data.popitem(last=False)
                size -= len(evicted) + ENTRY_OVERHEAD
            self._size = size

    @staticmethod
    def _packed(state):
        state = bytes(state)
        if len(state) >= COMPRESS_MIN:
            packed = zlib.compress(state)
            if len(packed) < len(state):
                return _Compressed(packed)
        return state

    def discard(self, oid_int, tid_int):
        with self._lock:
            old = self._data.pop((oid_int, tid_int), None)
            if old is not None:
                self._size -= len(old) + ENTRY_OVERHEAD

    def items(self):
        """(oid, tid, state) from least to most recently used (a copy)."""
        with self._lock:
            entries = list(self._data.items())
        for (oid_int, tid_int), stored in entries:
            if type(stored) is _Compressed:
                stored = zlib.decompress(stored)
            yield oid_int, tid_int, stored

    def keys(self):
        """(oid, tid) from least to most recently used (a copy)."""
        with self._lock:
            return list(self._data)

    def clear(self):
        with self._lock:
            self._data.clear()
            self._size = 0

    def stats(self):
        with self._lock:
            total = self.hits + self.misses
            return {'hits': self.hits, 'misses': self.misses,
                    'ratio': (self.hits / total) if total else 0.0,
                    'entries': len(self._data), 'bytes': self._size,
                    'limit': self.limit}
