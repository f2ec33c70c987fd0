"""A storage-wide, size-bounded memo of pickled states keyed (oid, tid).

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

Eviction is a segmented LRU: an entry comes in on *probation*, and moves
to the *protected* segment (at most PROTECTED_SHARE of the bound) when it
is read again; the least recently used entry of probation goes first,
and the protected segment's least recently used one drops back to
probation when that segment is full.  A plain LRU read nothing back from
a cycle of reads only a little larger than the cache (a BTree's buckets
walked in order: each read evicts the entry needed next; a helper
agent's check saw 1 hit in 13,000 reads from a cache warmed from its
file); here what was read twice stays while one-time reads pass through
probation.  Entries restored from a cache file (``put_restored``, least
recently used first) are taken as read again: the most recent ones start
out protected.
"""
import threading
import zlib
from collections import OrderedDict

from .. import locks

#: Pickles shorter than this are never compressed (zlib would not win).
COMPRESS_MIN = 64

#: Bytes an entry takes besides its pickle's: the ordered dict's slot and
#: link, the key (one int: oid and tid, see _key), the bytes object's
#: header (measured with tracemalloc on CPython 3.11: about 141 plus 33;
#: with an (oid, tid) tuple as the key, 229 plus 33).
ENTRY_OVERHEAD = 180

_TID_BITS = 64
_TID_MASK = (1 << _TID_BITS) - 1


def _key(oid_int, tid_int):
    """One int for (oid, tid): 88 bytes less per entry than a tuple of
    two (a helper agent's comparison: RelStorage 4.3 kept about twice as
    many entries in the same cache-local-mb)."""
    return (oid_int << _TID_BITS) | tid_int

#: The share of the bound the protected segment may take.
PROTECTED_SHARE = 0.8


class _Compressed(bytes):
    """A zlib-compressed pickle (marks the entry, costs nothing extra)."""
    __slots__ = ()


class LocalStateCache:

    def __init__(self, limit_bytes, object_max, compression='none'):
        self.limit = max(0, int(limit_bytes))
        self.protected_limit = int(self.limit * PROTECTED_SHARE)
        self.object_max = int(object_max)
        self.compress = (compression == 'zlib')
        # {_key(oid, tid): state}, each from least to most recently used.
        self._probation = OrderedDict()
        self._protected = OrderedDict()
        self._size = 0                  # both segments
        self._protected_size = 0
        self._lock = threading.Lock()
        self._locks_made_with = locks.made_now(self)
        self.hits = self.misses = 0

    def renew_locks(self):
        """(relstorage/locks.py)"""
        if locks.stale(self):
            self._lock = threading.Lock()

    def __len__(self):
        return len(self._probation) + len(self._protected)

    def __contains__(self, pair):
        key = _key(*pair)
        return key in self._protected or key in self._probation

    @property
    def size(self):
        return self._size

    def get(self, oid_int, tid_int):
        """The state of revision (oid, tid), or None; counts a hit or miss."""
        key = (oid_int << _TID_BITS) | tid_int
        with self._lock:
            protected = self._protected
            stored = protected.get(key)
            if stored is not None:
                protected.move_to_end(key)
            else:
                stored = self._probation.pop(key, None)
                if stored is None:
                    self.misses += 1
                    return None
                protected[key] = stored
                self._protected_size += len(stored) + ENTRY_OVERHEAD
                if self._protected_size > self.protected_limit:
                    self._demote()
            self.hits += 1
        if type(stored) is _Compressed:
            return zlib.decompress(stored)
        return stored

    def put(self, oid_int, tid_int, state, protect=False):
        if state is None or not self.limit or len(state) > self.object_max:
            return
        state = self._packed(state) if self.compress else bytes(state)
        with self._lock:
            self._store(_key(oid_int, tid_int), state, protect)
            self._evict()

    def put_restored(self, oid_int, tid_int, state):
        """``put`` of an entry read from a cache file, where they come
        least recently used first: taken as read again (protected)."""
        self.put(oid_int, tid_int, state, protect=True)

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
        store = self._store
        with self._lock:
            for oid_int, tid_int, state in entries:
                if len(state) <= object_max:
                    store((oid_int << _TID_BITS) | tid_int, state)
            self._evict()

    def _store(self, key, state, protect=False):
        """(Lock held.)  Put ``state`` under ``key``: an entry already
        protected stays so, others go to the probation segment's most
        recently used end (``protect``: to the protected one's)."""
        cost = len(state) + ENTRY_OVERHEAD
        protected = self._protected
        old = protected.pop(key, None)
        if old is not None:
            self._protected_size -= len(old) + ENTRY_OVERHEAD
            self._size -= len(old) + ENTRY_OVERHEAD
            protect = True
        else:
            old = self._probation.pop(key, None)
            if old is not None:
                self._size -= len(old) + ENTRY_OVERHEAD
        self._size += cost
        if protect:
            protected[key] = state
            self._protected_size += cost
            if self._protected_size > self.protected_limit:
                self._demote()
        else:
            self._probation[key] = state

    def _demote(self):
        """(Lock held.)  Move the protected segment's least recently used
        entries to probation (most recently used there) until it fits."""
        protected, probation = self._protected, self._probation
        size = self._protected_size
        limit = self.protected_limit
        while size > limit and protected:
            key, stored = protected.popitem(last=False)
            size -= len(stored) + ENTRY_OVERHEAD
            probation[key] = stored
        self._protected_size = size

    def _evict(self):
        """(Lock held.)  Drop least recently used entries, probation's
        first, until the bound is kept."""
        size = self._size
        if size <= self.limit:
            return
        probation = self._probation
        while size > self.limit and probation:
            _, evicted = probation.popitem(last=False)
            size -= len(evicted) + ENTRY_OVERHEAD
        protected = self._protected
        while size > self.limit and protected:
            _, evicted = protected.popitem(last=False)
            size -= len(evicted) + ENTRY_OVERHEAD
            self._protected_size -= len(evicted) + ENTRY_OVERHEAD
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
        key = _key(oid_int, tid_int)
        with self._lock:
            old = self._protected.pop(key, None)
            if old is not None:
                self._protected_size -= len(old) + ENTRY_OVERHEAD
            else:
                old = self._probation.pop(key, None)
            if old is not None:
                self._size -= len(old) + ENTRY_OVERHEAD

    def _ordered(self):
        """(Lock held.)  (key, stored) from least to most recently used:
        probation's, then the protected ones (each segment in its order)."""
        return list(self._probation.items()) + list(self._protected.items())

    def items(self):
        """(oid, tid, state) from least to most recently used (a copy:
        probation's entries, then the protected ones)."""
        with self._lock:
            entries = self._ordered()
        for key, stored in entries:
            if type(stored) is _Compressed:
                stored = zlib.decompress(stored)
            yield key >> _TID_BITS, key & _TID_MASK, stored

    def keys(self):
        """(oid, tid) from least to most recently used (a copy), as items."""
        with self._lock:
            keys = list(self._probation) + list(self._protected)
        return [(key >> _TID_BITS, key & _TID_MASK) for key in keys]

    def clear(self):
        with self._lock:
            self._probation.clear()
            self._protected.clear()
            self._size = self._protected_size = 0

    def stats(self):
        with self._lock:
            total = self.hits + self.misses
            return {'hits': self.hits, 'misses': self.misses,
                    'ratio': (self.hits / total) if total else 0.0,
                    'entries': len(self), 'bytes': self._size,
                    'limit': self.limit}
