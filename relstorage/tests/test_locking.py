"""The order in which commits lock rows (regression: crossed readCurrent
between two committers could deadlock when all exclusive locks were taken
before all shared ones)."""
import unittest

from relstorage.adapters.base import lock_runs


class LockRunsTests(unittest.TestCase):

    def test_one_global_order(self):
        runs = lock_runs([11, 1, 3, 10, 2], [6, 5])
        self.assertEqual(runs, [(True, [1, 2, 3]), (False, [5, 6]), (True, [10, 11])])
        flattened = [oid for _, run in runs for oid in run]
        self.assertEqual(flattened, sorted(flattened))

    def test_crossed_sets_lock_in_the_same_order(self):
        # T1 writes A=1, reads B=2 current; T2 writes B, reads A current.
        t1 = [oid for _, run in lock_runs([1], [2]) for oid in run]
        t2 = [oid for _, run in lock_runs([2], [1]) for oid in run]
        self.assertEqual(t1, t2)

    def test_single_mode(self):
        self.assertEqual(lock_runs([4, 2], []), [(True, [2, 4])])
        self.assertEqual(lock_runs([], [7, 2]), [(False, [2, 7])])
        self.assertEqual(lock_runs([], []), [])


def _test_suite():
    return unittest.defaultTestLoader.loadTestsFromTestCase(LockRunsTests)


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
