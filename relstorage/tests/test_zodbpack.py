"""zodbpack from the command line, on SQLite."""
import io
import os
import shutil
import tempfile
import unittest
from contextlib import redirect_stderr

import ZODB
import ZODB.config
from persistent.mapping import PersistentMapping
from ZODB.POSException import POSKeyError

from relstorage import zodbpack

CONFIG = """
%%import relstorage
<relstorage main>
  pack-gc %s
  <sqlite3>
    data-dir %s
  </sqlite3>
</relstorage>
"""


class ZodbpackTests(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix='relstoragetest_')
        self.data_dir = os.path.join(self.tmp, 'data')

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def write_config(self, gc=True):
        path = os.path.join(self.tmp, 'pack.conf')
        with open(path, 'w') as f:
            f.write(CONFIG % ('true' if gc else 'false', self.data_dir))
        return path

    def test_pack_removes_history_and_garbage(self):
        conf = self.write_config()
        db = ZODB.DB(ZODB.config.storageFromFile(open(conf)))
        with db.transaction() as conn:
            conn.root()['keep'] = PersistentMapping(v=1)
            conn.root()['drop'] = PersistentMapping(v=1)
        with db.transaction() as conn:
            conn.root()['keep']['v'] = 2
            dropped_oid = conn.root()['drop']._p_oid
            first_serial = conn.root()['keep']._p_serial
            del conn.root()['drop']
        storage = db.storage
        keep_oid = None
        with db.transaction() as conn:
            keep_oid = conn.root()['keep']._p_oid
        old = [h['tid'] for h in storage.history(keep_oid, 10)]
        self.assertEqual(len(old), 2)
        db.close()

        self.assertEqual(zodbpack.main(['-q', conf]), 0)

        storage = ZODB.config.storageFromFile(open(conf))
        try:
            self.assertEqual(len(storage.history(keep_oid, 10)), 1)
            with self.assertRaises(POSKeyError):
                storage.load(dropped_oid)
            self.assertEqual(len(storage), 2)     # root and 'keep'
        finally:
            storage.close()

    def test_bad_config_is_a_usage_error(self):
        path = os.path.join(self.tmp, 'bad.conf')
        with open(path, 'w') as f:
            f.write(CONFIG.replace('pack-gc', 'pack-gcc') % ('true', self.data_dir))
        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(zodbpack.main([path]), 2)
        self.assertIn('pack-gcc', err.getvalue())
        self.assertFalse(os.path.exists(self.data_dir))


def _test_suite():
    return unittest.defaultTestLoader.loadTestsFromTestCase(ZodbpackTests)


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
