"""Buffer of the states stored in the transaction being committed.

``store()`` only appends here; nothing reaches the database before vote.
States are kept in memory (a reference to the pickle ZODB passed: no copy)
up to ``SPOOL_BYTES``; past that they all move to an unnamed temporary file,
so a huge transaction does not have to fit in memory.  The file is only
appended to and read with positioned I/O (``os.pwrite``/``os.pread``): no
seek or tell per object.  An ordinary transaction never touches a file,
and reading its states back (upload, conflict resolution, the cache at
finish) costs nothing.
"""
import os
import tempfile

SPOOL_BYTES = 10 * 1024 * 1024


class TempStore:

    _file = None

    def __init__(self):
        # oid_int -> (state bytes, None for a deletion, or offset in the
        # file once spilled; length, -1 for a deletion; prev_tid_int)
        self._index = {}
        self._in_memory = 0     # bytes held in memory
        self._end = 0           # bytes written to the file
        self.max_oid = -1

    def __len__(self):
        return len(self._index)

    def __contains__(self, oid_int):
        return oid_int in self._index

    @property
    def nbytes(self):
        """Bytes of the states stored (of every store of an object
        stored twice)."""
        return self._in_memory + self._end

    def store(self, oid_int, prev_tid_int, state):
        if state is None:
            entry = (None, -1, prev_tid_int)
        else:
            if not isinstance(state, bytes):
                state = bytes(state)
            length = len(state)
            if self._file is None and self._in_memory + length <= SPOOL_BYTES:
                self._in_memory += length
                entry = (state, length, prev_tid_int)
            else:
                entry = (self._append(state), length, prev_tid_int)
        self._index[oid_int] = entry
        if oid_int > self.max_oid:
            self.max_oid = oid_int

    def _append(self, state):
        if self._file is None:
            self._spill()
        offset = self._end
        fd = self._file.fileno()
        view = memoryview(state)
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], offset + written)
        self._end += len(view)
        return offset

    def _spill(self):
        """Move the states held in memory to a new temporary file."""
        self._file = tempfile.TemporaryFile()
        index = self._index
        for oid_int, (state, length, prev_tid_int) in list(index.items()):
            if length >= 0:
                index[oid_int] = (self._append(state), length, prev_tid_int)
        self._in_memory = 0

    def read(self, oid_int):
        state, length, _ = self._index[oid_int]
        if length < 0 or self._file is None:
            return state
        data = os.pread(self._file.fileno(), length, state)
        while len(data) < length:
            data += os.pread(self._file.fileno(), length - len(data), state + len(data))
        return data

    def is_deletion(self, oid_int):
        return self._index[oid_int][1] < 0

    def prev_tid(self, oid_int):
        return self._index[oid_int][2]

    def prev_tids(self):
        """(oid, prev_tid) of every stored object, in OID order."""
        index = self._index
        return [(oid_int, index[oid_int][2]) for oid_int in sorted(index)]

    def oids(self):
        return sorted(self._index)

    def rows(self):
        """(oid, prev_tid, state) in OID order, read lazily."""
        index = self._index
        if self._file is None:
            for oid_int in sorted(index):
                state, _, prev_tid_int = index[oid_int]
                yield oid_int, prev_tid_int, state
            return
        for oid_int in sorted(index):
            yield oid_int, index[oid_int][2], self.read(oid_int)

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None
        self._index = {}
        self._in_memory = self._end = 0
