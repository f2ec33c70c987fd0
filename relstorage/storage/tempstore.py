"""Buffer of the states stored in the transaction being committed.

``store()`` only appends here; nothing reaches the database before vote.
Pickles go to a spooled temporary file that stays in memory up to
``SPOOL_BYTES`` and then moves to disk, so a huge transaction does not have
to fit in memory.
"""
import tempfile

SPOOL_BYTES = 10 * 1024 * 1024


class TempStore:

    _file = None

    def __init__(self):
        self._index = {}   # oid_int -> (offset, length or -1 for None, prev_tid_int)
        self.max_oid = -1

    def __len__(self):
        return len(self._index)

    def __contains__(self, oid_int):
        return oid_int in self._index

    def store(self, oid_int, prev_tid_int, state):
        if state is None:
            offset, length = 0, -1
        else:
            if self._file is None:
                self._file = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
            self._file.seek(0, 2)
            offset = self._file.tell()
            self._file.write(state)
            length = len(state)
        self._index[oid_int] = (offset, length, prev_tid_int)
        if oid_int > self.max_oid:
            self.max_oid = oid_int

    def read(self, oid_int):
        offset, length, _ = self._index[oid_int]
        if length < 0:
            return None
        self._file.seek(offset)
        return self._file.read(length)

    def is_deletion(self, oid_int):
        return self._index[oid_int][1] < 0

    def prev_tid(self, oid_int):
        return self._index[oid_int][2]

    def oids(self):
        return sorted(self._index)

    def rows(self):
        """(oid, prev_tid, state) in OID order, read lazily."""
        for oid_int in sorted(self._index):
            yield oid_int, self._index[oid_int][2], self.read(oid_int)

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None
        self._index = {}
