"""The leak check (leaks.py) sees what the test run leaves unclosed."""
import gc
import os
import shutil
import tempfile
import unittest

from . import leaks


class LeakCheckTests(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix='relstoragetest_leaks_')
        self.addCleanup(shutil.rmtree, self.tmp, True)
        leaks.collect()         # nothing earlier counted here

    def leave_open(self, name):
        f = open(os.path.join(self.tmp, name), 'wb')   # noqa: SIM115 on purpose
        del f
        gc.collect()

    def test_our_unclosed_file_is_recorded(self):
        self.leave_open('main.sqlite3')
        found = leaks.collect()
        self.assertEqual(len(found), 1, found)
        self.assertIn('main.sqlite3', found[0])

    def test_a_filestorage_file_is_not_ours(self):
        self.leave_open('Data.fs')
        self.assertEqual(leaks.collect(), [])

    def test_a_filestorage_file_under_a_driver_named_directory_is_not_ours(self):
        # Regression: ZODB's nested test directories carry driver names
        # (ZODBTests_mysql_MySQLdb_...), and a ZEO server's Data.fs left to
        # the collector there was counted as a driver's object.
        os.mkdir(os.path.join(self.tmp, 'ZODBTests_mysql_MySQLdb_x'))
        self.leave_open(os.path.join('ZODBTests_mysql_MySQLdb_x', 'zeo.fs'))
        self.assertEqual(leaks.collect(), [])
        self.assertFalse(leaks.is_ours(
            "unclosed file <_io.FileIO name='/tmp/ZODBTests_postgresql_psycopg_a/"
            "zeo.fs' mode='rb' closefd=True>"))

    def test_driver_sessions_and_server_sockets_are_ours(self):
        self.assertTrue(leaks.is_ours(
            "<psycopg.Connection object at 0x1> was deleted while still open"))
        self.assertTrue(leaks.is_ours(
            "unclosed database in <sqlite3.Connection object at 0x1>"))
        self.assertTrue(leaks.is_ours(
            "unclosed <socket.socket fd=5, family=2, type=1, proto=6, "
            "laddr=('127.0.0.1', 40000), raddr=('127.0.0.1', 3306)>"))
        self.assertFalse(leaks.is_ours(
            "unclosed <socket.socket fd=5, family=2, type=1, proto=6, "
            "laddr=('127.0.0.1', 40000), raddr=('10.0.0.1', 80)>"))


def _test_suite():
    return unittest.defaultTestLoader.loadTestsFromName(__name__)


def test_suite():
    return leaks.checked(_test_suite(), __name__)
