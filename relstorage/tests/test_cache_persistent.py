"""The persistent cache file (cache-local-dir): reuse it, never trust it blindly."""
import logging
import multiprocessing
import os
import shutil
import time
import tempfile
import unittest

import transaction
import ZODB
from persistent.mapping import PersistentMapping
from ZODB.Connection import TransactionMetaData
from ZODB.utils import z64

from relstorage.adapters.sqlite.adapter import Sqlite3Adapter
from relstorage.cache import persistent
from relstorage.options import Options
from relstorage.storage import RelStorage


class PersistentCacheTests(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix='relstoragetest_pcache_')
        self.data = os.path.join(self.tmp, 'data')
        self.cache_dir = os.path.join(self.tmp, 'cache')
        os.mkdir(self.cache_dir)

    def tearDown(self):
        transaction.abort()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def open_db(self, cache=True, data=None, **kw):
        kw.setdefault('cache_prefix', 'test')
        if cache:
            kw['cache_local_dir'] = self.cache_dir
        options = Options(**kw)
        storage = RelStorage(Sqlite3Adapter(data or self.data, options=options),
                             options=options)
        return ZODB.DB(storage)

    def fill(self, db, count=20, value=0):
        with db.transaction() as conn:
            root = conn.root()
            for i in range(count):
                if i in root:
                    root[i]['v'] = value
                else:
                    root[i] = PersistentMapping(v=value)

    def read_all(self, db, count=20):
        with db.transaction() as conn:
            conn.cacheMinimize()
            return [conn.root()[i]['v'] for i in range(count)]

    def copy(self, source):
        """The source's transactions into the database (as zodbconvert)."""
        options = Options()
        storage = RelStorage(Sqlite3Adapter(self.data, options=options), options=options)
        try:
            storage.copyTransactionsFrom(source)
        finally:
            storage.close()

    def cache_file(self):
        return persistent.cache_path(self.cache_dir, 'test')

    def test_a_cache_directory_that_cannot_be_made_for_lack_of_room(self):
        # A helper agent's check: on a full disk, a storage whose
        # cache-local-dir was not there yet did not open ("cannot be
        # created: No space left on device"): it now opens without the
        # persistent cache, with a warning, and makes it when there is
        # room.  (A file system with no inode left here.)
        import subprocess
        import ZODB.config
        small = os.path.join(self.tmp, 'small')
        os.mkdir(small)
        mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m,nr_inodes=3',
                                  'tmpfs', small], capture_output=True, check=False)
        if mounted.returncode:
            self.skipTest('cannot mount a tmpfs here: %s' % mounted.stderr.decode().strip())
        # (Removed after the unmount: tearDown's rmtree cannot.)
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.addCleanup(subprocess.run, ['umount', small], check=False)
        fillers = [os.path.join(small, name) for name in ('filler1', 'filler2')]
        for filler in fillers:
            os.mkdir(filler)
        text = ('%%import relstorage\n<zodb>\n<relstorage>\n cache-local-dir %s\n'
                '<sqlite3>\n data-dir %s\n</sqlite3>\n</relstorage>\n</zodb>\n'
                % (os.path.join(small, 'cache'), self.data))
        logger = logging.getLogger('relstorage.cache.storage_cache')
        with self.assertLogs(logger, logging.WARNING) as logs:
            db = ZODB.config.databaseFromString(text)
        try:
            self.assertIn('No space left on device; the storage opens without its '
                          'persistent cache', '\n'.join(logs.output))
            self.fill(db)
        finally:
            db.close()
        for filler in fillers:
            os.rmdir(filler)
        db = ZODB.config.databaseFromString(text)
        try:
            self.assertEqual(self.read_all(db), [0] * 20)
        finally:
            db.close()
        self.assertTrue(os.listdir(os.path.join(small, 'cache')))

    def test_a_cache_file_that_cannot_be_written_is_one_line(self):
        # A helper agent's check: an unwritable cache-local-dir logged a
        # traceback at every close; the reason, on one line, is enough.
        db = self.open_db()
        self.fill(db)
        shutil.rmtree(self.cache_dir)
        with open(self.cache_dir, 'w') as f:       # no longer a directory
            f.write('x')
        logger = logging.getLogger('relstorage.cache.storage_cache')
        with self.assertLogs(logger, logging.WARNING) as logs:
            db.close()
        self.assertEqual(len(logs.records), 1, logs.output)
        record = logs.records[0]
        self.assertIn('Could not write the cache file', record.getMessage())
        self.assertIn('Not a directory', record.getMessage())
        self.assertIsNone(record.exc_info)

    def write_earlier_release_file(self, version):
        """The cache file rewritten in the format of ``version`` (1: no
        database key, 1 and 2: no pack mark)."""
        import struct
        import zlib
        content = persistent.read_file(self.cache_file())
        header = {1: persistent.HEADER_V1, 2: persistent.HEADER_V2}[version]
        fields = (persistent.MAGIC, version, content.last_tid, len(content.entries))
        if version == 2:
            fields += (content.database_key,)
        data = header.pack(*fields)
        for oid, tid, state in content.entries:
            data += persistent.RECORD.pack(oid, tid, len(state)) + state
        data += struct.pack('>I', zlib.crc32(data))
        with open(self.cache_file(), 'wb') as f:
            f.write(data)

    def test_files_of_earlier_releases(self):
        # A helper agent's check: a file of an earlier release (no pack
        # mark) was ignored as if "the database was emptied, restored or
        # packed more than once", and one without the database's key was
        # replaced as "written for another database".
        logger = logging.getLogger('relstorage.cache.persistent')
        db = self.open_db()
        self.fill(db)
        db.close()
        self.write_earlier_release_file(1)
        with self.assertLogs(logger, logging.INFO) as logs:
            db = self.open_db()
            self.assertGreaterEqual(db.storage.cache_stats()['persistent_loaded'], 21)
            db.close()
        self.assertIn("written without the database's key (by an earlier release",
                      '\n'.join(logs.output))
        self.assertNotIn('another database', '\n'.join(logs.output))
        db = self.open_db()
        db.pack(time.time() + 1)
        db.close()
        db = self.open_db()
        self.fill(db, value=1)
        db.pack(time.time() + 1)
        db.close()
        self.write_earlier_release_file(2)
        with self.assertLogs(logger, logging.INFO) as logs:
            db = self.open_db()
            self.assertEqual(db.storage.cache_stats()['persistent_loaded'], 0)
            self.assertEqual(self.read_all(db), [1] * 20)
            db.close()
        self.assertIn('written by an earlier release, which did not record the pack mark',
                      '\n'.join(logs.output))

    def test_written_on_close_and_reused(self):
        db = self.open_db()
        self.fill(db)
        self.assertEqual(self.read_all(db), [0] * 20)
        db.close()
        self.assertTrue(os.path.exists(self.cache_file()))
        self.assertFalse([n for n in os.listdir(self.cache_dir) if n.startswith('.tmp')])
        db = self.open_db()
        stats = db.storage.cache_stats()
        self.assertGreaterEqual(stats['persistent_loaded'], 21)   # 20 + the root
        self.assertEqual(stats['persistent_dropped'], 0)
        loads = stats['db_loads']
        self.assertEqual(self.read_all(db), [0] * 20)
        self.assertEqual(db.storage.cache_stats()['db_loads'], loads)
        db.close()

    def test_changes_made_while_the_worker_was_down(self):
        db = self.open_db()
        self.fill(db)
        self.read_all(db)
        db.close()
        other = self.open_db(cache=False)
        with other.transaction() as conn:
            for i in range(5):
                conn.root()[i]['v'] = 'changed'
        other.close()
        db = self.open_db()
        stats = db.storage.cache_stats()
        self.assertEqual(stats['persistent_dropped'], 5)
        self.assertEqual(self.read_all(db), ['changed'] * 5 + [0] * 15)
        db.close()

    def test_database_restored_from_an_older_backup(self):
        db = self.open_db()
        self.fill(db, value='old')
        db.close()
        backup = os.path.join(self.tmp, 'backup')
        shutil.copytree(self.data, backup)
        db = self.open_db()
        self.fill(db, value='newer')
        self.assertEqual(self.read_all(db), ['newer'] * 20)
        db.close()                                # the file now holds 'newer'
        shutil.rmtree(self.data)
        shutil.copytree(backup, self.data)        # restore the backup
        with self.assertLogs('relstorage.cache.persistent', logging.WARNING) as logs:
            db = self.open_db()
        self.assertIn('restored from an older backup', logs.output[0])
        self.assertEqual(db.storage.cache_stats()['persistent_loaded'], 0)
        self.assertEqual(self.read_all(db), ['old'] * 20)
        db.close()

    def test_restored_backup_that_then_moved_past_the_file(self):
        # Restore, then commit more before the worker restarts, so the
        # database's last tid is after the file's: entries are still
        # checked one by one (in bulk) and the stale ones dropped.
        db = self.open_db()
        self.fill(db, value='old')
        db.close()
        backup = os.path.join(self.tmp, 'backup')
        shutil.copytree(self.data, backup)
        db = self.open_db()
        self.fill(db, value='lost')
        self.read_all(db)
        db.close()
        shutil.rmtree(self.data)
        shutil.copytree(backup, self.data)
        other = self.open_db(cache=False)
        with other.transaction() as conn:
            conn.root()[0]['v'] = 'after restore'
        other.close()
        db = self.open_db()
        stats = db.storage.cache_stats()
        self.assertGreaterEqual(stats['persistent_dropped'], 20)
        self.assertEqual(self.read_all(db), ['after restore'] + ['old'] * 19)
        db.close()

    def test_restored_backup_whose_next_commit_took_a_lost_tid(self):
        # A helper agent's check: a database whose last tid is ahead of the
        # clock (copied from a source written by a clock ten days fast)
        # gives each commit the last tid plus one.  After a restore, the
        # next commit took the tid of a lost one, with another state, and
        # a process started afterwards served the lost state from its
        # file (the tids matched).  Revisions committed after the file's
        # writing time are not taken from it, nor carried over by another
        # process's save once the clock has passed them (a review
        # finding).  (Here the database is 2 s ahead.)
        from ZODB.TimeStamp import TimeStamp
        ahead = time.time() + 2
        future = TimeStamp(*time.gmtime(ahead)[:5] + (ahead % 60,)).raw()
        db = self.open_db(cache=False)
        with db.transaction() as conn:
            conn.root()['x'] = PersistentMapping(v='original')
        storage = db.storage
        txn = TransactionMetaData()
        storage.tpc_begin(txn, future)      # (a copy of the fast source)
        storage.restore(z64, future, storage.load(z64)[0], '', None, txn)
        storage.tpc_vote(txn)
        storage.tpc_finish(txn)
        db.close()
        backup = os.path.join(self.tmp, 'backup')
        shutil.copytree(self.data, backup)
        db = self.open_db()
        with db.transaction() as conn:
            conn.root()['x']['v'] = 'lost'
        self.assertEqual(self.read_all_x(db), 'lost')
        lost = db.storage.lastTransaction()
        db.close()                          # the file holds 'lost'
        shutil.rmtree(self.data)
        shutil.copytree(backup, self.data)
        other = self.open_db(cache=False)
        with other.transaction() as conn:
            conn.root()['x']['v'] = 'after the restore'
        self.assertEqual(other.storage.lastTransaction(), lost)     # the same tid
        other.close()
        time.sleep(max(0, ahead + 0.5 - time.time()))
        saver = self.open_db()          # never reads x; saves the file
        with saver.transaction() as conn:
            conn.root()
        saver.close()
        db = self.open_db()
        self.assertEqual(self.read_all_x(db), 'after the restore')
        db.close()

    def read_all_x(self, db):
        with db.transaction() as conn:
            conn.cacheMinimize()
            return conn.root()['x']['v']

    def test_database_made_again_with_the_same_tids(self):
        # A helper agent's check: a database emptied and filled again by
        # zodbconvert --clear from a source with the same oids and tids
        # but other states: every entry of the cache file matched its tid,
        # and a fresh process read the old contents until the file was
        # deleted.  The file names its database's key now.
        self._made_again_with_the_same_tids(
            lambda: Sqlite3Adapter(self.data, options=Options()).drop_all(),
            'written for another database')

    def test_database_zapped_and_filled_again_with_the_same_tids(self):
        # Another helper agent's check: the same through zap_all, which
        # keeps the database's key.  The file names the pack mark too.
        def zap():
            options = Options()
            storage = RelStorage(Sqlite3Adapter(self.data, options=options),
                                 options=options)
            storage.zap_all()
            storage.close()
        self._made_again_with_the_same_tids(zap, 'emptied (zap_all)', logging.INFO)

    def test_file_written_before_a_pack_is_still_used(self):
        # The pack mark moved, and the pack's removal lists say no zap_all
        # came between: the entries are checked one by one as usual.
        from ZODB.serialize import referencesf
        db = self.open_db()
        self.fill(db, count=30, value='kept')
        self.read_all(db, 30)
        with db.transaction() as conn:
            for i in range(20, 30):
                del conn.root()[i]              # garbage for the pack
        db.close()
        # Pack after pack, each followed by a restart (a review finding:
        # the file kept its first mark, and was ignored for good after two).
        for n in range(3):
            packer = self.open_db(cache=False)
            with packer.transaction() as conn:
                conn.root()['g%d' % n] = PersistentMapping()
            with packer.transaction() as conn:
                del conn.root()['g%d' % n]          # garbage again
            packer.storage.pack(time.time() + 1, referencesf)
            packer.close()
            db = self.open_db()
            stats = db.storage.cache_stats()
            self.assertGreaterEqual(stats['persistent_loaded'], 20, n)
            self.assertEqual(self.read_all(db), ['kept'] * 20)
            db.close()

    def _made_again_with_the_same_tids(self, empty, said, level=logging.WARNING):
        from ZODB.FileStorage import FileStorage
        sources = []
        for name, value in (('old', b'old-'), ('new', b'new-')):
            fs = FileStorage(os.path.join(self.tmp, name + '.fs'))
            sources.append(fs)
            self.addCleanup(fs.close)
            if name == 'old':
                db = ZODB.DB(fs)
                self.fill(db, value='old-')
            else:
                # The same transactions, the same tids, other states.
                for txn in sources[0].iterator():
                    fs.tpc_begin(txn, txn.tid)
                    for record in txn:
                        fs.restore(record.oid, record.tid,
                                   record.data.replace(b'old-', value), '', None, txn)
                    fs.tpc_vote(txn)
                    fs.tpc_finish(txn)
        self.copy(sources[0])
        db = self.open_db()
        self.assertEqual(self.read_all(db), ['old-'] * 20)
        db.close()
        empty()
        self.copy(sources[1])
        with self.assertLogs('relstorage.cache.persistent', level) as logs:
            db = self.open_db()
        self.assertIn(said, logs.output[0])
        self.assertEqual(db.storage.cache_stats()['persistent_loaded'], 0)
        self.assertEqual(self.read_all(db), ['new-'] * 20)
        db.close()
        self.assertNotEqual(persistent.read_file(self.cache_file()).database_key, 0)

    def test_validation_is_one_query_per_batch(self):
        db = self.open_db()
        self.fill(db, count=1200)
        self.read_all(db, 1200)
        db.close()
        options = Options()
        adapter = Sqlite3Adapter(self.data, options=options)
        calls = []
        original = adapter.current_tids

        def counting(conn, oids):
            calls.append(len(oids))
            return original(conn, oids)
        adapter.current_tids = counting
        kept = {}
        snapshot, loaded, dropped, _, _ = persistent.load_validated(
            self.cache_file(), adapter, lambda o, t, s: kept.__setitem__(o, t),
            lambda o, t, snap: None)
        adapter.close()
        # The 1200 objects, plus the root: its first, empty revision (the
        # newest one is larger than cache-local-object-max) is out of date.
        self.assertEqual((loaded, dropped), (1200, 1))
        self.assertEqual(calls, [500, 500, 201])

    def test_damaged_file_is_ignored(self):
        db = self.open_db()
        self.fill(db)
        db.close()
        with open(self.cache_file(), 'r+b') as f:
            f.seek(40)
            f.write(b'garbage!')
        with self.assertLogs('relstorage.cache.persistent', logging.WARNING):
            db = self.open_db()
        self.assertEqual(db.storage.cache_stats()['persistent_loaded'], 0)
        self.assertEqual(self.read_all(db), [0] * 20)
        db.close()
        with open(self.cache_file(), 'wb') as f:
            f.write(b'RSLCACHE')                   # truncated
        with self.assertLogs('relstorage.cache.persistent', logging.WARNING):
            db = self.open_db()
        self.assertEqual(self.read_all(db), [0] * 20)
        db.close()

    def test_two_workers_share_the_directory(self):
        db = self.open_db()
        self.fill(db, count=40)
        db.close()
        os.remove(self.cache_file())
        w1, w2 = self.open_db(), self.open_db()
        with w1.transaction() as conn:
            [conn.root()[i]['v'] for i in range(20)]
        with w2.transaction() as conn:
            [conn.root()[i]['v'] for i in range(20, 40)]
        w1.close()
        w2.close()                # merges with what w1 wrote
        entries = persistent.read_file(self.cache_file()).entries
        self.assertGreaterEqual(len({oid for oid, _, _ in entries}), 41)
        db = self.open_db()
        loads = db.storage.cache_stats()['db_loads']
        self.assertEqual(self.read_all(db, 40), [0] * 40)
        self.assertEqual(db.storage.cache_stats()['db_loads'], loads)
        db.close()

    def test_concurrent_writers_never_corrupt_the_file(self):
        path = self.cache_file()
        ctx = multiprocessing.get_context('fork')
        procs = [ctx.Process(target=_writer, args=(path, n)) for n in range(4)]
        for p in procs:
            p.start()
        for _ in range(30):
            content = persistent.read_file(path)      # never raises
            if content is not None:
                for oid, tid, state in content[1]:
                    self.assertEqual(state, b'%d-%d' % (oid, tid))
        for p in procs:
            p.join(60)
            self.assertEqual(p.exitcode, 0)
        last_tid, entries = persistent.read_file(path)[:2]
        self.assertEqual(last_tid, 1000 + 3 * 10 + 9)
        self.assertEqual({oid for oid, _, _ in entries}, set(range(4 * 100)))

    def test_save_killed_leaves_nothing_behind(self):
        # A helper agent's check: a process killed while saving left its
        # temporary file (as large as the cache) for good.  The next save
        # of the same file removes it; another cache file's is kept.
        import signal
        import time
        path = self.cache_file()
        other = os.path.join(self.cache_dir, '.tmp-other.rscache-x.rscache')
        with open(other, 'wb') as f:
            f.write(b'being written by the save of another cache file')
        ctx = multiprocessing.get_context('fork')
        proc = ctx.Process(target=_big_writer, args=(path,))
        proc.start()

        def temporary():
            return [n for n in os.listdir(self.cache_dir)
                    if n.startswith('.tmp') and n != os.path.basename(other)]
        deadline = time.time() + 30
        while not temporary() and time.time() < deadline:
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        self.assertEqual(len(temporary()), 1)
        db = self.open_db()
        self.fill(db)
        db.close()
        self.assertEqual(sorted(n for n in os.listdir(self.cache_dir) if n.startswith('.tmp')),
                         ['.tmp-other.rscache-x.rscache'])
        self.assertIsNotNone(persistent.read_file(path))


def _big_writer(path):
    state = b'x' * (1 << 20)
    persistent.save(path, 1000, [(oid, 1000, state) for oid in range(400)], 1 << 30)


def _writer(path, n):
    for round_ in range(10):
        tid = 1000 + n * 10 + round_
        entries = [(oid, tid, b'%d-%d' % (oid, tid)) for oid in range(n * 100, n * 100 + 100)]
        persistent.save(path, tid, entries, 10 * 1024 * 1024)


def _test_suite():
    return unittest.TestLoader().loadTestsFromTestCase(PersistentCacheTests)


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
