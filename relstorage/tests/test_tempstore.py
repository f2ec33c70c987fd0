"""The commit's buffer of stored states (storage/tempstore.py)."""
import os
import unittest

from relstorage.storage import tempstore
from relstorage.storage.tempstore import TempStore


class TempStoreTests(unittest.TestCase):

    def _fill(self, store):
        store.store(5, 50, b'five')
        store.store(1, 0, b'one' * 10)
        store.store(3, 30, None)                 # a deletion
        store.store(4, 0, b'')
        store.store(5, 51, b'five again')        # stored twice: the last wins

    def _check(self, store):
        self.assertEqual(len(store), 4)
        self.assertEqual(store.max_oid, 5)
        self.assertEqual(list(store.rows()), [
            (1, 0, b'one' * 10), (3, 30, None), (4, 0, b''), (5, 51, b'five again')])
        self.assertEqual(store.prev_tids(), [(1, 0), (3, 30), (4, 0), (5, 51)])
        self.assertEqual(store.read(5), b'five again')
        self.assertTrue(store.is_deletion(3))
        self.assertFalse(store.is_deletion(4))
        self.assertIn(4, store)
        self.assertNotIn(2, store)

    def test_in_memory(self):
        store = TempStore()
        self._fill(store)
        self.assertIsNone(store._file)
        self._check(store)
        store.close()
        self.assertEqual(len(store), 0)

    def test_spills_to_a_file_past_the_limit(self):
        old = tempstore.SPOOL_BYTES
        tempstore.SPOOL_BYTES = 20
        self.addCleanup(setattr, tempstore, 'SPOOL_BYTES', old)
        store = TempStore()
        store.store(9, 90, memoryview(b'x' * 15))    # bytes-like, held as bytes
        self.assertIsNone(store._file)
        self._fill(store)
        self.assertIsNotNone(store._file)
        store.store(2, 20, os.urandom(100000))
        big = store.read(2)
        self.assertEqual(len(big), 100000)
        self.assertEqual(store.read(9), b'x' * 15)
        store.store(9, 91, b'nine')                   # after the spill too
        self.assertEqual(store.read(9), b'nine')
        self.assertEqual([row[0] for row in store.rows()], [1, 2, 3, 4, 5, 9])
        self.assertEqual(store.read(2), big)          # reads do not move writes
        store.store(2, 0, None)
        self.assertTrue(store.is_deletion(2))
        store.store(7, 0, b'after a deletion')
        self.assertEqual(store.read(7), b'after a deletion')
        store.close()
        self.assertIsNone(store._file)


def test_suite():
    return unittest.defaultTestLoader.loadTestsFromName(__name__)
