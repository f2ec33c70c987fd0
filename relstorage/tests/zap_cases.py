"""zap_all(): empty the database, keep the schema (run for every database
by make_suite, history-preserving and history-free)."""
import os
import shutil
import tempfile

import transaction
import ZODB
from persistent.mapping import PersistentMapping
from ZODB.blob import Blob
from ZODB.POSException import POSKeyError
from ZODB.POSException import ReadOnlyError
from ZODB.utils import z64

from .core_cases import FactoryCase


class ZapAllTests(FactoryCase):

    def fill(self, db, n=20):
        with db.transaction() as conn:
            conn.root()['items'] = items = PersistentMapping()
            for i in range(n):
                items[i] = PersistentMapping(v=i)
        return [items[i]._p_oid for i in range(n)]

    def test_zap_all_empties_the_database_and_new_commits_work(self):
        storage = self.storage()
        db = ZODB.DB(storage)
        try:
            oids = self.fill(db)
            self.assertGreater(len(storage), 20)
            storage.zap_all()
            self.assertEqual(len(storage), 0)
            self.assertEqual(storage.lastTransaction(), z64)
            self.assertRaises(POSKeyError, storage.load, z64)
            self.assertRaises(POSKeyError, storage.load, oids[0])
            if self.keep_history:
                self.assertEqual(storage.undoLog(0, 100), [])
        finally:
            db.close()
        # The schema is still there: a new DB creates its root and commits.
        storage = self.storage()
        db = ZODB.DB(storage)
        try:
            self.assertEqual(len(storage), 1)
            new_oids = self.fill(db, 5)
            # OIDs are never handed out twice, even across a zap.
            self.assertFalse(set(new_oids) & set(oids))
            with db.transaction() as conn:
                self.assertEqual([conn.root()['items'][i]['v'] for i in range(5)],
                                 list(range(5)))
            self.assertEqual(len(storage), 7)
            if self.keep_history:
                self.assertEqual(len(storage.undoLog(0, 100)), 2)
        finally:
            db.close()

    def test_pack_after_zap_and_an_older_history_keeps_what_is_reachable(self):
        # Regression: zap_all left the pack's recorded analysis (pack_info's
        # refs_tid, object_ref) in place; history copied in afterwards with
        # older tids counted as analysed, its references were never read,
        # and a pack with GC removed objects reachable from the root.
        import time
        from ZODB.Connection import TransactionMetaData
        from ZODB.serialize import referencesf
        from ZODB.tests.MinPO import MinPO
        from ZODB.tests.StorageTestBase import zodb_pickle
        from ZODB.utils import p64
        from ZODB.utils import u64
        storage = self.storage()
        db = ZODB.DB(storage)
        try:
            self.fill(db)
            storage.pack(time.time() + 1, referencesf)
            before = u64(storage.lastTransaction())
            storage.zap_all()
            child_oid = storage.new_oid()
            child = MinPO('child')
            child._p_oid = child_oid
            old_tid = p64(before - (3600 << 32))        # an hour before the zap
            txn = TransactionMetaData()
            storage.tpc_begin(txn, old_tid)
            storage.store(z64, z64, zodb_pickle(MinPO(child)), '', txn)
            storage.store(child_oid, z64, zodb_pickle(MinPO('child')), '', txn)
            storage.tpc_vote(txn)
            storage.tpc_finish(txn)
            storage.mark_copy(None)     # (the copy of that history finished)
            storage.pack(time.time() + 1, referencesf)
            self.assertEqual(storage.load(child_oid)[1], old_tid)
        finally:
            db.close()

    def test_zodbshootout_style_zap_while_the_db_is_open(self):
        # zodbshootout --zap force: open the database (ZODB.DB creates the
        # root), call db.storage.zap_all() with the DB open, close it, and
        # open it again for the benchmark.
        db = ZODB.DB(self.storage())
        self.fill(db, 50)
        db.close()
        db = ZODB.DB(self.storage())
        conn = db.open()
        self.assertEqual(len(conn.root()['items']), 50)
        conn.close()                      # stays in the pool, cache warm
        db.storage.zap_all()
        db.close()
        db = ZODB.DB(self.storage())
        try:
            self.assertEqual(len(db.storage), 1)
            with db.transaction() as conn:
                self.assertEqual(dict(conn.root()), {})
                conn.root()['again'] = PersistentMapping(v=1)
            with db.transaction() as conn:
                self.assertEqual(conn.root()['again']['v'], 1)
        finally:
            db.close()

    def test_other_process_does_not_serve_zapped_objects(self):
        db1 = ZODB.DB(self.storage())
        db2 = ZODB.DB(self.storage())             # "another process"
        try:
            oids = self.fill(db1)
            tm2 = transaction.TransactionManager()
            conn2 = db2.open(tm2)
            self.assertEqual(conn2.get(oids[3])['v'], 3)
            tm2.abort()
            db1.storage.zap_all()
            tm2.begin()                           # polls: learns of the zap
            self.assertRaises(POSKeyError, lambda: conn2.get(oids[3])['v'])
            self.assertRaises(POSKeyError, db2.storage.load, oids[3])
            tm2.abort()
            conn2.close()
            # New history after the zap is seen as usual.
            db1.close()
            db1 = ZODB.DB(self.storage())
            with db1.transaction() as conn:
                conn.root()['after'] = PersistentMapping(v='after')
            with db2.transaction() as conn:
                self.assertEqual(conn.root()['after']['v'], 'after')
                self.assertNotIn('items', conn.root())
            self.assertEqual(db2.storage.cache_stats()['index_mismatches'], 0)
        finally:
            db1.close()
            db2.close()

    def test_snapshot_from_before_the_zap_does_not_leak_into_the_cache(self):
        # An instance still reading a snapshot from before the zap may load
        # an object the zap removed; what it learns must not answer for
        # the new history (whose tids restart below that snapshot's).
        storage = self.storage()
        db = ZODB.DB(storage)
        try:
            oids = self.fill(db)
            old = storage.new_instance()
            old.poll_invalidations()
            storage.zap_all()
            self.assertIsNotNone(old.load(oids[5])[0])   # MVCC: still there
            old.release()
            self.commit(storage, storage.new_oid(), z64, 'new history')
            new = storage.new_instance()
            new.poll_invalidations()
            self.assertRaises(POSKeyError, new.load, oids[5])
            new.release()
        finally:
            db.close()

    def test_blobs_are_zapped(self):
        for shared in (True, False):
            self.factory.fresh(self.keep_history)
            blob_dir = tempfile.mkdtemp(prefix='relstoragetest_zapblobs_')
            self.addCleanup(shutil.rmtree, blob_dir, True)
            storage = self.storage(blob_dir=blob_dir, shared_blob_dir=shared)
            db = ZODB.DB(storage)
            try:
                with db.transaction() as conn:
                    conn.root()['blob'] = blob = Blob(b'zap me')
                oid = blob._p_oid
                with db.transaction() as conn:
                    with conn.root()['blob'].open() as f:
                        self.assertEqual(f.read(), b'zap me')
                storage.zap_all()
                self.assertFalse(os.path.exists(storage.fshelper.getPathForOID(oid)))
                self.assertRaises(POSKeyError, storage.loadBlob, oid,
                                  storage.lastTransaction())
            finally:
                db.close()

    def test_persistent_cache_file_from_before_the_zap_is_not_used(self):
        cache_dir = tempfile.mkdtemp(prefix='relstoragetest_zapcache_')
        self.addCleanup(shutil.rmtree, cache_dir, True)
        db = ZODB.DB(self.storage(cache_local_dir=cache_dir))
        oids = self.fill(db)
        with db.transaction() as conn:
            self.assertEqual(conn.get(oids[2])['v'], 2)
        db.close()                                # writes the cache file
        self.storage().zap_all()                  # another process zaps
        storage = self.storage(cache_local_dir=cache_dir)
        self.assertEqual(storage.cache_stats()['persistent_loaded'], 0)
        self.assertRaises(POSKeyError, storage.load, oids[2])

    def test_read_only_storage_refuses(self):
        self.storage()                            # creates the schema
        self.assertRaises(ReadOnlyError, self.storage(read_only=True).zap_all)


CASES = (ZapAllTests,
         type('ZapAllTestsHF', (ZapAllTests,), {'keep_history': False}))
