"""Our own blob tests, run by make_suite for every database factory."""
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
import unittest

import transaction
import ZODB
from ZODB.POSException import POSKeyError
from ZODB.blob import Blob
from ZODB.Connection import TransactionMetaData
from ZODB.tests.MinPO import MinPO
from ZODB.tests.StorageTestBase import zodb_pickle
from ZODB.utils import p64
from ZODB.utils import u64
from ZODB.utils import z64

from relstorage.blobs import make_blobs
from relstorage.interfaces import RelStorageError
from relstorage.options import Options
from relstorage.storage import faults
from relstorage.storage import RelStorage

from .core_cases import FactoryCase

MB = 1 << 20


def cached_bytes(directory):
    """The bytes of the blob files under ``directory``.  (A prune removes
    files while this walks: CI saw one go between the listing and its
    size.)"""
    total = 0
    for base, _, files in os.walk(directory):
        for name in files:
            if name.endswith('.blob'):
                try:
                    total += os.path.getsize(os.path.join(base, name))
                except FileNotFoundError:
                    pass
    return total


class BlobCase(FactoryCase):

    def setUp(self):
        super().setUp()
        self.tmp = tempfile.mkdtemp(prefix='relstoragetest_blobs_')

    def tearDown(self):
        super().tearDown()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def blob_storage(self, name='blobs', **kw):
        """A storage keeping blobs in the database, ``name`` its cache."""
        kw.setdefault('blob_dir', os.path.join(self.tmp, name))
        kw.setdefault('shared_blob_dir', False)
        return self.storage(**kw)


def _committed_blob(db, key, data):
    """(oid, serial) of a blob of ``data`` committed as the root's ``key``."""
    with db.transaction() as conn:
        conn.root()[key] = Blob(data)
    with db.transaction() as conn:
        blob = conn.root()[key]
        blob._p_activate()
        return blob._p_oid, blob._p_serial


class BlobCacheTests(BlobCase):

    def test_a_revision_replaced_while_read_outside_the_snapshot(self):
        # A helper agent's check: a blob revision committed after the
        # reader's snapshot began is read outside it (a fresh session); one
        # replaced between the count of its chunks and their read (history
        # free: its rows go with the replacement) gave a bare TypeError.
        # POSKeyError now, as for a revision not there at all.
        if self.keep_history:
            self.skipTest('history-free: a replaced revision leaves')
        from relstorage.adapters.base import Adapter
        writer = ZODB.DB(self.blob_storage('writer'))
        reader = ZODB.DB(self.blob_storage('reader'))
        self.addCleanup(writer.close)
        self.addCleanup(reader.close)
        oid, serial0 = _committed_blob(writer, 'b', b'v0')
        instance = reader.storage.new_instance()
        instance.poll_invalidations()       # its snapshot: before v1
        with writer.transaction() as conn:
            with conn.root()['b'].open('w') as f:
                f.write(b'v1')
        with writer.transaction() as conn:
            conn.root()['b']._p_activate()
            serial1 = conn.root()['b']._p_serial
        count = Adapter.blob_chunk_count
        replaced = []

        def replaced_after_the_count(adapter, *args):
            found = count(adapter, *args)
            if found and not replaced:
                replaced.append(True)
                with writer.transaction() as conn:
                    with conn.root()['b'].open('w') as f:
                        f.write(b'v2')
            return found
        Adapter.blob_chunk_count = replaced_after_the_count
        self.addCleanup(setattr, Adapter, 'blob_chunk_count', count)
        with self.assertRaises(POSKeyError):
            instance.loadBlob(oid, serial1)
        self.assertTrue(replaced)
        instance.release()
        self.assertNotEqual(serial0, serial1)

    def test_a_file_pruned_as_it_is_found_is_read_again(self):
        # A helper agent's check: loadBlob found the file, a prune removed
        # it before its touch (which failed quietly), and the caller got a
        # path to nothing.  The prune comes at that moment here.
        from unittest import mock
        from relstorage.blobs import cached
        db = ZODB.DB(self.blob_storage('cache'))
        self.addCleanup(db.close)
        oid, serial = _committed_blob(db, 'b', b'kept')
        path = db.storage.loadBlob(oid, serial)
        utime = os.utime
        pruned = []

        def pruned_first(target, *args, **kw):
            if target == path and not pruned:
                pruned.append(target)
                os.chmod(target, 0o600)
                os.remove(target)
            return utime(target, *args, **kw)
        with mock.patch.object(cached.os, 'utime', pruned_first):
            again = db.storage.loadBlob(oid, serial)
        self.assertTrue(pruned)
        with open(again, 'rb') as f:
            self.assertEqual(f.read(), b'kept')

    def test_a_downloaded_file_is_its_owner_s_only(self):
        # A helper agent's check: a blob file downloaded into the cache was
        # made readable by everyone (0o444), whatever the umask; ZODB
        # leaves a committed one readable by its owner only.
        writer = ZODB.DB(self.blob_storage('writer'))
        self.addCleanup(writer.close)
        oid, serial = _committed_blob(writer, 'b', b'private')
        reader = self.blob_storage('reader')
        path = reader.loadBlob(oid, serial)
        self.assertTrue(path.startswith(os.path.join(self.tmp, 'reader')))
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o400)

    def test_unusable_blob_dir_fails_at_open(self):
        not_a_dir = os.path.join(self.tmp, 'file')
        with open(not_a_dir, 'w') as f:
            f.write('x')
        with self.assertRaises(RelStorageError) as cm:
            self.blob_storage(blob_dir=os.path.join(not_a_dir, 'blobs'))
        self.assertIn('blob-dir', str(cm.exception))
        self.assertIn('%s is a file, not a directory' % not_a_dir, str(cm.exception))

    def test_a_refused_configuration_makes_no_schema(self):
        # A helper agent's check: blob-dir naming a file, or a shared cache
        # whose client package is missing, was refused once the storage
        # had made its schema in the (empty) database.
        not_a_dir = os.path.join(self.tmp, 'file')
        with open(not_a_dir, 'w') as f:
            f.write('x')
        for options, problem in (
                (dict(blob_dir=not_a_dir), 'is a file, not a directory'),
                (dict(cache_local_dir=not_a_dir), 'is a file, not a directory'),
                (dict(cache_servers='127.0.0.1:11211', cache_module_name='pylibmc'),
                 'pylibmc package')):
            with self.subTest(options=options):
                if options.get('cache_module_name') == 'pylibmc':
                    import importlib.util
                    if importlib.util.find_spec('pylibmc') is not None:
                        continue
                with self.assertRaises(RelStorageError) as cm:
                    self.storage(**options)
                self.assertIn(problem, str(cm.exception))
                with self.assertRaises(RelStorageError) as cm:
                    self.storage(create_schema=False)
                self.assertIn('No RelStorage schema', str(cm.exception))

    def test_a_small_cache_size_is_kept(self):
        # A helper agent's check: blob-cache-size 5 made the size check
        # happen every 0 bytes, that is never: an unlimited cache.
        db = ZODB.DB(self.blob_storage('small', blob_cache_size=5))
        self.addCleanup(db.close)
        with db.transaction() as conn:
            for i in range(10):
                conn.root()[i] = Blob(b'z' * 50 * 1000)
        cache = os.path.join(self.tmp, 'small')
        deadline = time.time() + 30
        while time.time() < deadline:
            kept = sum(len([n for n in names if n.endswith('.blob')])
                       for _, _, names in os.walk(cache))
            if kept <= 1:
                break
            time.sleep(0.05)
        self.assertLessEqual(kept, 1)

    def commit_gone_and_kept(self, writer):
        """'kept' (a blob) replaced and 'gone' (a blob) made garbage:
        the (oid, tid) of the blob revisions a pack removes."""
        with writer.transaction() as conn:
            conn.root()['kept'] = Blob(b'first')
            conn.root()['gone'] = Blob(b'garbage')
        with writer.transaction() as conn:
            for name in ('kept', 'gone'):
                conn.root()[name]._p_activate()
            wanted = [(conn.root()['gone']._p_oid, conn.root()['gone']._p_serial)]
            if self.keep_history:
                wanted.append((conn.root()['kept']._p_oid, conn.root()['kept']._p_serial))
            with conn.root()['kept'].open('w') as f:
                f.write(b'second')
        with writer.transaction() as conn:
            del conn.root()['gone']
        return wanted

    def assert_packed_away(self, reader, wanted, paths):
        """The files of ``wanted`` leave ``reader``'s cache (a thread of
        their own removes them), and it refuses them."""
        from ZODB.POSException import POSKeyError
        deadline = time.time() + 30
        while any(os.path.exists(path) for path in paths) and time.time() < deadline:
            time.sleep(0.01)
        for (oid, tid), path in zip(wanted, paths):
            self.assertFalse(os.path.exists(path))
            with self.assertRaises(POSKeyError):
                reader.loadBlob(oid, tid)

    def test_what_a_pack_removes_goes_from_other_caches(self):
        # A helper agent's check: after a pack, a process whose blob cache
        # held removed revisions (and the blob of a removed object) still
        # served them, where a fresh process and FileStorage raise
        # POSKeyError.
        from ZODB.serialize import referencesf
        writer = ZODB.DB(self.blob_storage('writer-cache'))
        self.addCleanup(writer.close)
        wanted = self.commit_gone_and_kept(writer)
        reader = self.blob_storage('reader-cache')
        self.addCleanup(reader.close)
        paths = [reader.loadBlob(oid, tid) for oid, tid in wanted]
        self.assertTrue(all(os.path.exists(path) for path in paths))
        time.sleep(0.01)
        writer.storage.pack(time.time(), referencesf)
        reader.poll_invalidations()
        self.assert_packed_away(reader, wanted, paths)
        reader.release()

    def test_a_process_started_after_a_pack_drops_what_it_removed(self):
        # A helper agent's check: a process that read old revisions into
        # its blob cache and was down while a pack (of another process,
        # with another cache) removed them served them again after its
        # restart, where the storage raises POSKeyError.
        from ZODB.serialize import referencesf
        from relstorage.blobs.cached import PACK_MARK_FILE
        writer = ZODB.DB(self.blob_storage('writer-cache'))
        self.addCleanup(writer.close)

        def read_then_close(wanted):
            reader = self.blob_storage('reader-cache')
            paths = [reader.loadBlob(oid, tid) for oid, tid in wanted]
            self.assertTrue(all(os.path.exists(path) for path in paths))
            reader.close()
            return paths

        def reopen_and_check(wanted, paths):
            reader = self.blob_storage('reader-cache')
            self.addCleanup(reader.close)
            self.assert_packed_away(reader, wanted, paths)
            reader.close()

        # The lists of the pack's batches say what went.
        wanted = self.commit_gone_and_kept(writer)
        paths = read_then_close(wanted)
        time.sleep(0.01)
        writer.storage.pack(time.time(), referencesf)
        reopen_and_check(wanted, paths)
        self.assertTrue(os.path.exists(os.path.join(self.tmp, 'reader-cache', PACK_MARK_FILE)))
        # Two packs meanwhile (the second empties the first's lists): every
        # file goes.
        wanted = self.commit_gone_and_kept(writer)
        paths = read_then_close(wanted)
        other = os.path.join(self.tmp, 'reader-cache', 'other.blob')
        with open(other, 'wb') as f:
            f.write(b'a file no pack named')
        time.sleep(0.01)
        writer.storage.pack(time.time(), referencesf)
        with writer.transaction() as conn:
            conn.root()['more'] = Blob(b'more')
        with writer.transaction() as conn:
            del conn.root()['more']
        writer.storage.pack(time.time(), referencesf)
        reopen_and_check(wanted, paths)
        self.assertFalse(os.path.exists(other))
        with writer.transaction() as conn:
            with conn.root()['kept'].open('r') as f:
                self.assertEqual(f.read(), b'second')

    def test_a_cache_belongs_to_one_database(self):
        # A helper agent's check: two databases given one blob cache served
        # each other's bytes where their blobs had the same OID and tid (a
        # database restored with its tids): the cache now names its
        # database, as a shared blob-dir does.
        from relstorage.blobs.cached import CACHE_MARKER
        from relstorage.blobs.cached import CACHE_MARKER_TEXT
        db_a = ZODB.DB(self.blob_storage('cache'))
        self.addCleanup(db_a.close)
        with db_a.transaction() as conn:
            conn.root()['x'] = Blob(b'A data')
        marker = os.path.join(self.tmp, 'cache', CACHE_MARKER)
        other = self.factory.named('cached_blobs_b')
        other.fresh(self.keep_history)
        self.addCleanup(other.cleanup)
        options = Options(keep_history=self.keep_history, shared_blob_dir=False,
                          blob_dir=os.path.join(self.tmp, 'cache'))
        for read_only in (False, True):
            options.read_only = read_only
            with self.assertRaises(RelStorageError) as raised:
                RelStorage(other.make_adapter(options), options=options)
            self.assertIn('is the blob cache of another database', str(raised.exception))
        # A marker of an earlier release (no key) is bound to the first
        # database that opens the directory.
        with open(marker, 'w') as f:
            f.write(CACHE_MARKER_TEXT)
        self.blob_storage('cache').close()
        options.read_only = False
        with self.assertRaises(RelStorageError):
            RelStorage(other.make_adapter(options), options=options)
        with db_a.transaction() as conn:
            with conn.root()['x'].open('r') as f:
                self.assertEqual(f.read(), b'A data')

    def test_a_download_whose_directory_went_meanwhile(self):
        # A helper agent's check: a pack's clean-up of the cache in another
        # process removed an object's directory while this process
        # downloaded one of its blobs: the rename into place failed.
        import shutil as _shutil
        from relstorage.blobs import cached
        writer = ZODB.DB(self.blob_storage('cache'))
        self.addCleanup(writer.close)
        oid, serial = _committed_blob(writer, 'b', b'still there')
        reader = self.blob_storage('other-cache')
        self.addCleanup(reader.close)
        blobs = reader._blobs
        real = cached.CachedBlobs._read

        def read_then_lose_the_directory(this, read_chunks, oid_int, tid_int, write):
            size = real(this, read_chunks, oid_int, tid_int, write)
            _shutil.rmtree(os.path.dirname(this.filename(oid_int, tid_int)))
            return size
        blobs._read = read_then_lose_the_directory.__get__(blobs)
        for call in (reader.loadBlob, reader.openCommittedBlobFile):
            path = blobs.filename(u64(oid), u64(serial))
            if os.path.exists(path):
                os.chmod(path, 0o644)
                os.remove(path)
            found = call(oid, serial)
            if isinstance(found, str):
                with open(found, 'rb') as f:
                    found = f.read()
            else:
                with found:
                    found = found.read()
            self.assertEqual(found, b'still there')

    def test_ids_beyond_the_database_s_range(self):
        # A helper agent's check: on SQLite, loadBlob and
        # openCommittedBlobFile of a serial past 2**63 failed with the
        # driver's OverflowError; no such blob is a POSKeyError.
        from ZODB.POSException import POSKeyError
        db = ZODB.DB(self.blob_storage('cache'))
        self.addCleanup(db.close)
        with db.transaction() as conn:
            conn.root()['b'] = Blob(b'data')
        with db.transaction() as conn:
            oid = conn.root()['b']._p_oid
        for bad_oid, serial in ((oid, p64(2 ** 63 + 5)), (p64(2 ** 64 - 1), p64(1))):
            for call in (db.storage.loadBlob, db.storage.openCommittedBlobFile):
                with self.assertRaises(POSKeyError):
                    call(bad_oid, serial)

    def test_two_databases_opening_a_new_cache_at_once(self):
        # A review finding: the cache's marker was read, then written: two
        # processes of different databases opening a new cache together
        # both bound it.  Here the other database's process writes its
        # marker right after this one found none.
        from unittest import mock
        from relstorage.blobs import cached
        directory = os.path.join(self.tmp, 'race')
        marker = os.path.join(directory, cached.CACHE_MARKER)
        real = cached._marker_key

        def raced(path):
            found = real(path)
            if found is None and not os.path.exists(marker):
                os.makedirs(directory, exist_ok=True)
                with open(marker, 'w') as f:
                    f.write(cached.CACHE_MARKER_TEXT + cached.CACHE_KEY_LINE % 12345)
            return found
        with mock.patch.object(cached, '_marker_key', raced):
            with self.assertRaises(RelStorageError) as raised:
                self.blob_storage('race')
        self.assertIn('is the blob cache of another database', str(raised.exception))
        self.assertEqual(real(marker), 12345)
        self.assertEqual([n for n in os.listdir(directory) if n.endswith('.tmp')], [])

    def test_processes_opening_a_new_directory_at_once(self):
        # ZODB's FilesystemHelper.create tests, then writes, its layout
        # marker in place: another process opening the directory then
        # could read it empty ("names the layout ''").  Here ZODB's write
        # of the marker waits, while another storage opens the directory.
        from unittest import mock
        import ZODB.blob
        from relstorage.blobs import make_blobs
        real_open = open

        class SlowWrite:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, text):
                time.sleep(0.3)
                return self.f.write(text)

        def slow_open(path, mode='r', *args, **kw):
            f = real_open(path, mode, *args, **kw)
            if path.endswith(ZODB.blob.LAYOUT_MARKER) and 'w' in mode:
                return SlowWrite(f)
            return f
        for shared in (False, True):
            directory = os.path.join(self.tmp, 'new-%s' % shared)
            errors = []

            def open_directory():
                try:
                    make_blobs(Options(blob_dir=directory, shared_blob_dir=shared), None)
                except Exception as exc:  # pylint:disable=broad-except
                    errors.append(repr(exc))
            with mock.patch.object(ZODB.blob, 'open', slow_open, create=True):
                first = threading.Thread(target=open_directory)
                first.start()
                time.sleep(0.1)
                open_directory()
                first.join()
            self.assertEqual(errors, [])
            with open(os.path.join(directory, ZODB.blob.LAYOUT_MARKER)) as f:
                self.assertEqual(f.read(), 'bushy')

    def test_a_cache_over_its_size_at_open_is_pruned(self):
        # A helper agent's check: a cache left over its size (by earlier
        # processes, or a prune that gave up while files were in use)
        # stayed so in a process that only read files it had: it added
        # none, and never pruned (142 MB in a cache of 4 MB).
        db = ZODB.DB(self.blob_storage('big-then-small'))
        with db.transaction() as conn:
            for i in range(8):
                conn.root()['b%d' % i] = Blob(b'%d' % i * (256 * 1024))
        db.close()
        directory = os.path.join(self.tmp, 'big-then-small')
        self.assertGreaterEqual(cached_bytes(directory), 2 * MB)
        storage = self.blob_storage('big-then-small', blob_cache_size=MB)
        self.addCleanup(storage.close)
        deadline = time.time() + 30
        while cached_bytes(directory) > MB and time.time() < deadline:
            time.sleep(0.1)
        self.assertLessEqual(cached_bytes(directory), MB)

    def test_closing_a_reader_waits_for_no_prune(self):
        # A review finding: with the prune at open, a storage that added
        # nothing to its cache walked it twice at close (1.2 s for 100,000
        # files), and waited without limit while another process pruned
        # (its lock held here, as that process's prune holds it).
        import fcntl
        directory = os.path.join(self.tmp, 'reader')
        db = ZODB.DB(self.blob_storage('reader'))
        _committed_blob(db, 'b', b'x' * 1000)
        db.close()
        with open(os.path.join(directory, '.prune.lock'), 'a') as other:
            fcntl.flock(other, fcntl.LOCK_EX)
            storage = self.blob_storage('reader', blob_cache_size=100)
            closing = threading.Thread(target=storage.close, daemon=True)
            closing.start()
            closing.join(30)
            self.assertFalse(closing.is_alive(), 'close waited for the other prune')
            fcntl.flock(other, fcntl.LOCK_UN)
        # Its prune, stopped by the close, ends in a moment (a thread left
        # running is reported by the test runner).
        if storage._blobs._prune_thread is not None:
            storage._blobs._prune_thread.join(30)
            self.assertFalse(storage._blobs._prune_thread.is_alive())

    def test_the_external_prune_runs_one_process_at_a_time(self):
        # A helper agent's check: blob-cache-size-check-external started a
        # Python process at every check, each waiting for the prune lock
        # (21 at once for 60 reads); and one that could not import
        # relstorage failed unseen.  One at a time now, and the cache ends
        # within its size.
        from unittest import mock
        from relstorage.blobs import cached
        writer = ZODB.DB(self.blob_storage('writer'))
        self.addCleanup(writer.close)
        blobs = [_committed_blob(writer, 'b%d' % i, b'%d' % i * 5000) for i in range(12)]
        children = []
        overlapped = []
        popen = subprocess.Popen

        def counted(*args, **kw):
            overlapped.extend(child for child in children if child.poll() is None)
            child = popen(*args, **kw)
            children.append(child)
            return child
        directory = os.path.join(self.tmp, 'reader')
        reader = self.blob_storage('reader', blob_cache_size=20000,
                                   blob_cache_size_check=10,
                                   blob_cache_size_check_external=True)
        with mock.patch.object(cached.subprocess, 'Popen', counted):
            for oid, serial in blobs:
                with open(reader.loadBlob(oid, serial), 'rb') as f:
                    f.read()
            deadline = time.time() + 60
            while time.time() < deadline and (
                    any(child.poll() is None for child in children)
                    or reader._blobs._pruning):
                time.sleep(0.05)
        self.assertTrue(children)
        self.assertEqual(overlapped, [])
        self.assertEqual([child.returncode for child in children], [0] * len(children))
        self.assertLessEqual(cached_bytes(directory), 20000)

    def test_a_prune_waits_for_another_without_blocking(self):
        # A review finding: a prune waiting for another process's held a
        # blocking flock; under gevent, where the prune thread is a
        # greenlet, every greenlet of the process stopped meanwhile.  It
        # now looks again after short sleeps (here the other process lets
        # go at the first one).
        import fcntl
        from unittest import mock
        from relstorage.blobs import cached
        directory = os.path.join(self.tmp, 'waiting')
        os.makedirs(directory)
        with open(os.path.join(directory, '.prune.lock'), 'a') as other:
            fcntl.flock(other, fcntl.LOCK_EX)
            slept = []

            def sleep(seconds):
                slept.append(seconds)
                fcntl.flock(other, fcntl.LOCK_UN)
            clock = types.SimpleNamespace(time=time.time, sleep=sleep)
            done = []
            with mock.patch.object(cached, 'time', clock):
                thread = threading.Thread(
                    target=lambda: done.append(cached.prune(directory, 1000, wait=True)))
                thread.daemon = True
                thread.start()
                thread.join(10)
            fcntl.flock(other, fcntl.LOCK_UN)
        self.assertEqual(done, [0])
        self.assertEqual(slept, [cached.PRUNE_LOCK_POLL])

    def test_a_child_forked_while_its_parent_pruned_prunes(self):
        # A review finding: a child forked while its parent's prune thread
        # ran took the prune for running for good (the thread is not in the
        # child), and its cache grew without bound.
        blobs = make_blobs(Options(blob_dir=os.path.join(self.tmp, 'forked'),
                                   shared_blob_dir=False), None)
        blobs._pruning = True       # as while the parent's prune thread runs
        read, write = os.pipe()
        pid = os.fork()
        if not pid:
            try:
                os.write(write, b'%d' % blobs._pruning)
            finally:
                os._exit(0)
        os.close(write)
        try:
            self.assertEqual(os.read(read, 10), b'0')
        finally:
            os.close(read)
            os.waitpid(pid, 0)
        self.assertTrue(blobs._pruning)

    def test_two_databases_binding_an_earlier_releases_cache_at_once(self):
        # A helper agent's reading: a cache an earlier release marked
        # without a key, opened by processes of two databases at once:
        # both read no key, and both wrote theirs.  Here each read of the
        # marker waits, so that both read before either writes.
        from unittest import mock
        from relstorage.blobs import cached
        from relstorage.blobs import make_blobs
        directory = os.path.join(self.tmp, 'earlier')
        os.makedirs(directory)
        marker = os.path.join(directory, cached.CACHE_MARKER)
        with open(marker, 'w') as f:
            f.write(cached.CACHE_MARKER_TEXT)
        real = cached._marker_key

        def slow(path):
            found = real(path)
            time.sleep(0.2)
            return found
        outcomes = {}

        def bind(key):
            blobs = make_blobs(Options(blob_dir=directory, shared_blob_dir=False), None)
            try:
                blobs._bind(marker, key, 'database %d' % key)
                outcomes[key] = 'bound'
            except RelStorageError as exc:
                outcomes[key] = str(exc)
        with mock.patch.object(cached, '_marker_key', slow):
            threads = [threading.Thread(target=bind, args=(key,)) for key in (111, 222)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        bound = [key for key, outcome in outcomes.items() if outcome == 'bound']
        self.assertEqual(len(bound), 1, outcomes)
        self.assertEqual(real(marker), bound[0])
        other = ({111, 222} - set(bound)).pop()
        self.assertIn('is the blob cache of another database', outcomes[other])

    def test_a_path_handed_out_is_not_pruned_at_once(self):
        # A helper agent's check: a path from loadBlob (what ZODB's
        # Blob.committed() returns, which Plone opens to stream a file)
        # was pruned before its caller opened it when a blob larger than
        # the whole cache was read in between.
        from unittest import mock
        from relstorage.blobs import cached
        # (The storage's own prunes stay out of the way; the grace is long
        # enough for a loaded machine.)
        db = ZODB.DB(self.blob_storage('cache', blob_cache_size=100 * MB))
        self.addCleanup(db.close)
        with db.transaction() as conn:
            conn.root()['small'] = Blob(b's' * 100)
            conn.root()['big'] = Blob(b'b' * 5000)
        slept = []
        clock = types.SimpleNamespace(time=time.time, sleep=slept.append)
        with mock.patch.object(cached, 'PRUNE_GRACE', 60):
            with db.transaction() as conn:
                small = conn.root()['small'].committed()
                big = conn.root()['big'].committed()
            with mock.patch.object(cached, 'time', clock):
                removed = cached.prune(os.path.join(self.tmp, 'cache'), 1000, wait=True)
                # Pruning again waits for the grace to pass, once: not after
                # its last attempt (it did, for the whole grace).
                cached.prune(os.path.join(self.tmp, 'cache'), 1000, wait=True, again=1)
        self.assertEqual(removed, 0)
        self.assertEqual(len(slept), 1)
        with open(small, 'rb') as f:
            self.assertEqual(f.read(), b's' * 100)
        # Once it has passed, they go.
        with mock.patch.object(cached, 'PRUNE_GRACE', 0):
            cached.prune(os.path.join(self.tmp, 'cache'), 1000, wait=True)
        self.assertFalse(os.path.exists(big))

    def test_files_another_process_removed_first(self):
        # A helper agent's check (6 processes sharing one blob cache while
        # a pack removed 3000 blobs): an object's directory that another
        # process removed between this one's test and its listing failed
        # polls, commits (after tpc_finish) and the pack itself with
        # FileNotFoundError.  Here the listing finds it gone.
        from unittest import mock
        from ZODB.serialize import referencesf
        writer = ZODB.DB(self.blob_storage('writer-cache'))
        self.addCleanup(writer.close)
        with writer.transaction() as conn:
            conn.root()['gone'] = Blob(b'garbage')
        with writer.transaction() as conn:
            blob = conn.root()['gone']
            blob._p_activate()
            oid, tid = blob._p_oid, blob._p_serial
            del conn.root()['gone']
        reader = self.blob_storage('reader-cache')
        self.addCleanup(reader.close)
        reader.loadBlob(oid, tid)
        time.sleep(0.01)
        writer.storage.pack(time.time(), referencesf)
        cache_dir = os.path.join(self.tmp, 'reader-cache')
        listdir = os.listdir

        def removed_meanwhile(path='.'):
            if str(path).startswith(cache_dir) and str(path) != cache_dir:
                raise FileNotFoundError(2, 'No such file or directory', path)
            return listdir(path)
        with mock.patch('relstorage.blobs.common.os.listdir', removed_meanwhile):
            with self.assertNoLogs('relstorage', 'WARNING'):
                reader.poll_invalidations()
                time.sleep(0.5)     # (the removal's thread)
        reader.release()

    def test_blob_chunk_size_out_of_bounds_is_brought_within(self):
        # A helper agent's check: blob-chunk-size 99999999999999999999999
        # (accepted at parse, as earlier releases accept it) failed every
        # blob commit with OverflowError; 1 took seconds per 20 KB.
        from relstorage.options import BLOB_CHUNK_MAX
        from relstorage.options import BLOB_CHUNK_MIN
        for wanted, used in ((10 ** 23, BLOB_CHUNK_MAX), (1, BLOB_CHUNK_MIN)):
            with self.assertLogs('relstorage.options', 'WARNING') as logged:
                storage = self.blob_storage('chunks-%d' % used, blob_chunk_size=wanted)
            # (The database's own limit, PostgreSQL's, named at open.)
            used = min(used, storage.adapter.blob_chunk_max)
            self.assertIn('blob-chunk-size %d is outside' % wanted, logged.output[0])
            self.assertIn('using %d' % used, logged.output[0])
            self.assertEqual(storage._blobs.chunk_size, used)
            db = ZODB.DB(storage)
            data = os.urandom(200000)
            with db.transaction() as conn:
                conn.root()['b'] = Blob(data)
            with db.transaction() as conn:
                with conn.root()['b'].open() as f:
                    self.assertEqual(f.read(), data)
            db.close()

    def test_a_cache_emptied_while_the_process_runs(self):
        # A helper agent's check: with the cache directory emptied (by
        # hand, by tmpreaper) while the process ran, every blob read and
        # write failed with FileNotFoundError (its tmp/ was gone) until a
        # restart.
        db = ZODB.DB(self.blob_storage())
        self.addCleanup(db.close)
        with db.transaction() as conn:
            conn.root()['b'] = Blob(b'payload')
        cache_dir = os.path.join(self.tmp, 'blobs')
        for name in os.listdir(cache_dir):
            path = os.path.join(cache_dir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        with db.transaction() as conn:
            conn.cacheMinimize()
            with conn.root()['b'].open() as f:
                self.assertEqual(f.read(), b'payload')
            conn.root()['c'] = Blob(b'new')
        with db.transaction() as conn:
            with conn.root()['c'].open() as f:
                self.assertEqual(f.read(), b'new')

    def test_commits_that_write_nothing_on_a_new_session(self):
        # A store session makes its temporary tables at its first commit
        # that writes: an empty commit and a readCurrent-only one come
        # first here, with blobs kept in the database (history-free, the
        # vote replaces the old blobs of what it writes), then a blob.
        setup = ZODB.DB(self.blob_storage('setup-cache'))
        with setup.transaction() as conn:
            conn.root()['b'] = Blob(b'first')
        setup.close()
        storage = self.blob_storage()
        oid, serial = z64, storage.load(z64)[1]
        for read_current in (False, True):
            txn = TransactionMetaData()
            storage.tpc_begin(txn)
            if read_current:
                storage.checkCurrentSerialInTransaction(oid, serial, txn)
            storage.tpc_vote(txn)
            storage.tpc_finish(txn)
        db = ZODB.DB(storage)
        try:
            with db.transaction() as conn:
                with conn.root()['b'].open('w') as f:
                    f.write(b'second')
            with db.transaction() as conn:
                with conn.root()['b'].open() as f:
                    self.assertEqual(f.read(), b'second')
        finally:
            db.close()

    def test_pruning_under_concurrent_readers(self):
        # 40 blobs of 256 KB with a cache limit of 1 MB: every reader keeps
        # missing and downloading while the cache is pruned under it.
        writer = self.blob_storage('writer-cache')
        db = ZODB.DB(writer)
        expected = {}
        with db.transaction() as conn:
            for i in range(40):
                data = (b'%04d' % i) * (64 * 1024)
                blob = Blob(data)
                conn.root()['b%d' % i] = blob
                expected['b%d' % i] = hashlib.sha1(data).hexdigest()
        db.close()

        reader_dir = os.path.join(self.tmp, 'reader-cache')
        reader = self.blob_storage('reader-cache', blob_cache_size=MB,
                                   blob_cache_size_check=10)
        rdb = ZODB.DB(reader)
        errors = []

        def read_all(seed):
            tm = transaction.TransactionManager()
            conn = rdb.open(tm)
            try:
                for round_ in range(3):
                    keys = sorted(expected)[seed::1] + sorted(expected)[:seed]
                    for key in keys:
                        with conn.root()[key].open('r') as f:
                            got = hashlib.sha1(f.read()).hexdigest()
                        if got != expected[key]:
                            errors.append((key, got))
                    tm.abort()
                    conn.cacheMinimize()
            except Exception as exc:  # pylint:disable=broad-except
                errors.append(repr(exc))
            finally:
                conn.close()

        def cached():
            return cached_bytes(reader_dir)

        threads = [threading.Thread(target=read_all, args=(i * 7,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        self.assertEqual(errors, [])
        # A helper agent's check: once the readers stop, the cache comes
        # back within its limit by itself (a prune that found another one
        # running gave up, and the files renamed into place after that one
        # had counted stayed: 3 to 7 times the limit in 3 runs of 14)...
        deadline = time.time() + 30
        while cached() > MB and time.time() < deadline:
            time.sleep(0.05)
        self.assertLessEqual(cached(), MB)
        # ... and closing the storage leaves it within too (its prune
        # thread, a daemon, may be cut short at exit).
        rdb.close()
        self.assertLessEqual(cached(), MB)

    def test_a_blob_that_cannot_be_taken_leaves_no_file(self):
        # A helper agent's check: a commit whose blob copy failed (a full
        # disk) left its partial file in blob-dir/tmp, which kept the disk
        # full for the next commit.  (Here the file to take is missing.)
        for shared in (False, True):
            blob_dir = os.path.join(self.tmp, 'take-%s' % shared)
            storage = self.blob_storage(blob_dir=blob_dir, shared_blob_dir=shared)
            txn = TransactionMetaData()
            storage.tpc_begin(txn)
            with self.assertRaises(OSError):
                storage.storeBlob(storage.new_oid(), z64, b'state',
                                  os.path.join(self.tmp, 'no-such-file'), '', txn)
            storage.tpc_abort(txn)
            self.assertEqual(os.listdir(os.path.join(blob_dir, 'tmp')), [])
            storage.close()

    def test_an_interrupt_as_the_commit_returns_keeps_the_blob(self):
        # A helper agent's check: a KeyboardInterrupt (Ctrl-C, which
        # arrives as the COMMIT's fsync returns) in tpc_finish removed the
        # placed blob file of a transaction the server had committed: with
        # a shared blob directory the blob was lost.
        from unittest import mock

        from relstorage.adapters import connections
        for shared in (False, True):
            if shared:
                self.factory.fresh(self.keep_history)
            blob_dir = os.path.join(self.tmp, 'interrupted-%s' % shared)
            storage = self.blob_storage(blob_dir=blob_dir, shared_blob_dir=shared)
            path = os.path.join(self.tmp, 'precious-%s' % shared)
            with open(path, 'wb') as f:
                f.write(b'precious data')
            oid = storage.new_oid()
            txn = TransactionMetaData()
            storage.tpc_begin(txn)
            storage.storeBlob(oid, z64, zodb_pickle(MinPO(1)), path, '', txn)
            storage.tpc_vote(txn)
            real = connections.DBConnection.commit

            def commit_then_interrupt(conn):
                real(conn)
                raise KeyboardInterrupt
            with mock.patch.object(connections.DBConnection, 'commit', commit_then_interrupt):
                with self.assertRaises(KeyboardInterrupt):
                    storage.tpc_finish(txn)
            storage.tpc_abort(txn)          # (what the transaction does next)
            storage.close()
            reader = self.blob_storage(blob_dir=blob_dir, shared_blob_dir=shared)
            serial = reader.load(oid)[1]
            with open(reader.loadBlob(oid, serial), 'rb') as f:
                self.assertEqual(f.read(), b'precious data')
            reader.close()

    def test_files_of_commits_that_never_finished(self):
        # A helper agent's check: a process killed during a commit leaves
        # its blobs' files in blob-dir/tmp for good.  They go when a storage
        # opens the directory a day later; a recent one may be a commit in
        # progress in another process.
        blob_dir = os.path.join(self.tmp, 'killed')
        self.blob_storage(blob_dir=blob_dir).close()
        tmp = os.path.join(blob_dir, 'tmp')
        for name in ('pending-1-old.tmp', 'pending-2-new.tmp', 'other-old.tmp'):
            with open(os.path.join(tmp, name), 'wb') as f:
                f.write(b'x' * 1000)
        two_days_ago = time.time() - 2 * 24 * 3600
        for name in ('pending-1-old.tmp', 'other-old.tmp'):
            os.utime(os.path.join(tmp, name), (two_days_ago, two_days_ago))
        self.blob_storage(blob_dir=blob_dir).close()
        self.assertEqual(sorted(os.listdir(tmp)), ['other-old.tmp', 'pending-2-new.tmp'])

    def test_reads_that_never_finished(self):
        # A helper agent's check: a process killed while it read a blob
        # into its cache left a download-*.tmp as large as what it had
        # read, which nothing removed or counted.  A download writes all
        # the time: one untouched for six hours is gone when a storage
        # opens the directory, and, in a process that keeps running, when
        # the cache is next pruned.
        blob_dir = os.path.join(self.tmp, 'killed-reads')
        self.blob_storage(blob_dir=blob_dir).close()
        tmp = os.path.join(blob_dir, 'tmp')

        def leave(*names):
            for name in names:
                with open(os.path.join(tmp, name), 'wb') as f:
                    f.write(b'x' * 1000)
            then = time.time() - 7 * 3600
            for name in names:
                if 'old' in name:
                    os.utime(os.path.join(tmp, name), (then, then))
        leave('download-old1.tmp', 'download-new1.tmp')
        storage = self.blob_storage(blob_dir=blob_dir, blob_cache_size=100 * 1000,
                                    blob_cache_size_check=1)
        self.assertEqual(sorted(os.listdir(tmp)), ['download-new1.tmp'])
        leave('download-old2.tmp')
        db = ZODB.DB(storage)
        self.addCleanup(db.close)
        with db.transaction() as conn:
            for i in range(3):
                conn.root()[i] = Blob(b'y' * 60 * 1000)
        deadline = time.time() + 30
        while 'download-old2.tmp' in os.listdir(tmp) and time.time() < deadline:
            time.sleep(0.01)
        self.assertEqual(sorted(os.listdir(tmp)), ['download-new1.tmp'])

    def test_a_read_into_a_full_cache_directory_names_the_file(self):
        # A helper agent's check: reading a blob into a cache on a full
        # disk failed with a bare "[Errno 28] No space left on device".
        # Here the process may not write files past 1 MB (EFBIG, where a
        # full disk says ENOSPC: the same write fails).
        import errno
        import resource
        import signal
        db = ZODB.DB(self.blob_storage(blob_dir=os.path.join(self.tmp, 'writer')))
        self.addCleanup(db.close)
        with db.transaction() as conn:
            conn.root()['big'] = Blob(b'z' * (2 << 20))
        blob_dir = os.path.join(self.tmp, 'reader')
        reader = ZODB.DB(self.blob_storage(blob_dir=blob_dir))
        self.addCleanup(reader.close)
        tm = transaction.TransactionManager()
        conn = reader.open(tm)
        blob = conn.root()['big']
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        try:
            with self.assertRaises(OSError) as cm:
                blob.open().close()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)
        self.assertEqual(cm.exception.errno, errno.EFBIG)
        self.assertIn(os.path.join(blob_dir, 'tmp', 'download-'), cm.exception.filename)
        self.assertIn('into the blob cache', str(cm.exception))
        self.assertEqual(os.listdir(os.path.join(blob_dir, 'tmp')), [])
        with blob.open() as f:
            self.assertEqual(len(f.read()), 2 << 20)
        tm.abort()
        conn.close()

    def test_an_old_file_stored_as_a_blob_is_not_a_leftover(self):
        # A review finding: a rename keeps the file's time, so a blob
        # consumed from a file of last year looked like a killed commit's
        # leftover to a storage opening the directory during the commit.
        blob_dir = os.path.join(self.tmp, 'consumed')
        storage = self.blob_storage(blob_dir=blob_dir)
        old = os.path.join(self.tmp, 'last-year.bin')
        with open(old, 'wb') as f:
            f.write(b'an old file')
        a_year_ago = time.time() - 365 * 24 * 3600
        os.utime(old, (a_year_ago, a_year_ago))
        oid = storage.new_oid()
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        storage.storeBlob(oid, z64, zodb_pickle(MinPO(1)), old, '', txn)
        self.blob_storage(blob_dir=blob_dir).close()     # another process starting
        storage.tpc_vote(txn)
        tid = storage.tpc_finish(txn)
        with open(storage.loadBlob(oid, tid), 'rb') as f:
            self.assertEqual(f.read(), b'an old file')

    def test_a_blob_the_cache_cannot_keep_does_not_fail_the_finish(self):
        # A helper agent's check: with the blob cache's file system full,
        # making the object's directory failed in tpc_finish, after the
        # COMMIT (ZODB's createPathForOID raises AssertionError), and the
        # transaction manager aborted the other databases of a committed
        # transaction.  Here a file stands where the directory must go.
        storage = self.blob_storage('blocked')
        oid = storage.new_oid()
        helper = storage._blobs.fshelper
        top = os.path.relpath(helper.getPathForOID(oid), helper.base_dir).split(os.sep)[0]
        blob_file = os.path.join(self.tmp, 'upload.blob')
        with open(blob_file, 'wb') as f:
            f.write(b'kept in the database')
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        storage.storeBlob(oid, z64, zodb_pickle(MinPO(1)), blob_file, '', txn)
        storage.tpc_vote(txn)
        with open(os.path.join(helper.base_dir, top), 'w') as f:
            f.write('in the way')
        with self.assertLogs('relstorage.blobs', 'WARNING'):
            tid = storage.tpc_finish(txn)
        os.remove(os.path.join(helper.base_dir, top))
        other = self.blob_storage('other')
        with open(other.loadBlob(oid, tid), 'rb') as f:
            self.assertEqual(f.read(), b'kept in the database')

    def test_a_prune_that_meets_another_runs_after_it(self):
        # A helper agent's check (3 processes sharing a cache of 1 MB): a
        # prune that found the lock held by another one returned at once,
        # so the files renamed into place after that one had counted stayed
        # over the limit until the next read.  Here the lock is held as
        # another process's prune holds it, while this one reads 3 MB.
        import fcntl
        writer = self.blob_storage('writer-cache')
        db = ZODB.DB(writer)
        with db.transaction() as conn:
            for i in range(12):
                conn.root()['b%d' % i] = Blob(b'%04d' % i * (64 * 1024))
        db.close()
        reader_dir = os.path.join(self.tmp, 'reader-cache')
        rdb = ZODB.DB(self.blob_storage('reader-cache', blob_cache_size=MB,
                                        blob_cache_size_check=10))
        self.addCleanup(rdb.close)

        def cached():
            return cached_bytes(reader_dir)
        with open(os.path.join(reader_dir, '.prune.lock'), 'a') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with rdb.transaction() as conn:
                for i in range(12):
                    with conn.root()['b%d' % i].open('r') as f:
                        f.read()
            self.assertGreater(cached(), 2 * MB)
            fcntl.flock(lock, fcntl.LOCK_UN)
        deadline = time.time() + 30
        while cached() > MB and time.time() < deadline:
            time.sleep(0.05)
        self.assertLessEqual(cached(), MB)

    def test_interrupted_download_leaves_only_a_temporary_file(self):
        storage = self.blob_storage('one')
        db = ZODB.DB(storage)
        with db.transaction() as conn:
            conn.root()['b'] = Blob(b'x' * (3 * MB))
        with db.transaction() as conn:
            blob = conn.root()['b']
            blob._p_activate()
            oid, serial = blob._p_oid, blob._p_serial
        db.close()
        other = self.blob_storage('two', blob_chunk_size=MB)
        calls = []

        def failing_read(oid_int, tid_int, write, original=other._read_blob_chunks):
            def write_then_fail(data):
                write(data)
                calls.append(len(data))
                if len(calls) == 2:
                    raise IOError('connection lost mid-download')
            return original(oid_int, tid_int, write_then_fail)
        other._read_blob_chunks = failing_read
        with self.assertRaises(IOError):
            other.loadBlob(oid, serial)
        del other._read_blob_chunks
        final = other._blobs.filename(int.from_bytes(oid, 'big'), int.from_bytes(serial, 'big'))
        self.assertFalse(os.path.exists(final))
        with open(other.loadBlob(oid, serial), 'rb') as f:
            self.assertEqual(f.read(), b'x' * (3 * MB))


KILLED_COMMIT = r'''
import os, sys, transaction, ZODB
from ZODB.blob import Blob
from relstorage.options import Options
from relstorage.storage import RelStorage
sys.path.insert(0, sys.argv[1])
import factory_for_subprocess as f
options = Options(keep_history=f.KEEP_HISTORY, blob_dir=sys.argv[2], shared_blob_dir=False)
db = ZODB.DB(RelStorage(f.make_adapter(options), options=options))
# RS_FAULT_POINT=finish.before_commit: everything is uploaded and voted;
# the process dies before the database COMMIT.
with db.transaction() as conn:
    conn.root()['big'] = Blob(b'y' * (5 << 20))
'''


class BlobCrashTests(BlobCase):

    def test_sigkill_during_blob_commit(self):
        storage = self.blob_storage('main')
        db = ZODB.DB(storage)
        with db.transaction() as conn:
            conn.root()['kept'] = Blob(b'kept')
        db.close()
        helper_dir = self.factory.write_subprocess_factory(self.tmp, self.keep_history)
        proc = subprocess.run([sys.executable, '-c', KILLED_COMMIT, helper_dir,
                               os.path.join(self.tmp, 'dying')],
                              capture_output=True, timeout=120,
                              env=dict(os.environ, RS_FAULT_POINT='finish.before_commit'))
        self.assertEqual(proc.returncode, faults.EXIT_CODE, proc.stderr.decode())
        # Nothing of the killed transaction is visible, nothing is locked,
        # and no final-named blob file points at a missing commit.
        storage = self.blob_storage('after')
        db = ZODB.DB(storage)
        with db.transaction() as conn:
            self.assertNotIn('big', conn.root())
            with conn.root()['kept'].open() as f:
                self.assertEqual(f.read(), b'kept')
            conn.root()['big'] = Blob(b'z')          # and we can commit
        with db.transaction() as conn:
            with conn.root()['big'].open() as f:
                self.assertEqual(f.read(), b'z')
        db.close()
        for dirpath, _, files in os.walk(os.path.join(self.tmp, 'dying')):
            for name in files:
                self.assertFalse(name.endswith('.blob'), os.path.join(dirpath, name))


BIG_BLOB = r'''
import hashlib, os, sys, time, transaction, ZODB
from ZODB.blob import Blob
from relstorage.options import Options
from relstorage.storage import RelStorage
sys.path.insert(0, sys.argv[1])
import factory_for_subprocess as f
blob_dir, size = sys.argv[2], int(sys.argv[3])
source = os.path.join(blob_dir + '-src')
block = os.urandom(1 << 20)
digest = hashlib.sha256()
with open(source, 'wb') as out:
    for i in range(size >> 20):
        chunk = i.to_bytes(8, 'big') + block[8:]
        out.write(chunk)
        digest.update(chunk)
options = Options(keep_history=f.KEEP_HISTORY, blob_dir=blob_dir, shared_blob_dir=False)
db = ZODB.DB(RelStorage(f.make_adapter(options), options=options))
t0 = time.time()
with db.transaction() as conn:
    blob = Blob()
    blob.consumeFile(source)
    conn.root()['big'] = blob
written = time.time() - t0
db.close()
# A second storage with an empty cache downloads it again.
options = Options(keep_history=f.KEEP_HISTORY, blob_dir=blob_dir + '-reader',
                  shared_blob_dir=False)
db = ZODB.DB(RelStorage(f.make_adapter(options), options=options))
t0 = time.time()
check = hashlib.sha256()
with db.transaction() as conn:
    with conn.root()['big'].open() as fh:
        while True:
            data = fh.read(1 << 20)
            if not data:
                break
            check.update(data)
read = time.time() - t0
db.close()
assert check.hexdigest() == digest.hexdigest(), 'content differs'
# The peak of this process's own memory (VmHWM): ru_maxrss keeps, across
# exec, the peak of the process that forked it (a test runner that had
# just pushed 512 MB blobs through a driver: 1.3 GB "peak" here).
with open('/proc/self/status') as status:
    peak_mb = next(int(line.split()[1]) for line in status
                   if line.startswith('VmHWM:')) // 1024
print('size_mb=%d peak_rss_mb=%d write_s=%.1f read_s=%.1f' % (size >> 20, peak_mb, written, read))
'''


class BigBlobTests(BlobCase):
    """A blob of several GB streams with bounded client memory (RS_BIG_BLOB_MB,
    default 3072)."""

    def test_big_blob_streams(self):
        if not getattr(self.factory, 'big_blob_test', False):
            self.skipTest('the multi-GB blob test runs on SQLite always, on PostgreSQL '
                          'with RS_PG_BIG_BLOB=1 or RS_BIG_BLOB_MB set')
        size = int(os.environ.get('RS_BIG_BLOB_MB', '3072')) << 20
        helper_dir = self.factory.write_subprocess_factory(self.tmp, self.keep_history)
        proc = subprocess.run([sys.executable, '-c', BIG_BLOB, helper_dir,
                               os.path.join(self.tmp, 'big'), str(size)],
                              capture_output=True, timeout=1200)
        self.assertEqual(proc.returncode, 0, proc.stderr.decode()[-3000:])
        line = proc.stdout.decode().strip().splitlines()[-1]
        sys.stderr.write('\n  big blob on %s: %s\n' % (self.factory.name, line))
        fields = dict(part.split('=') for part in line.split())
        # Streaming, not buffering: far less memory than the blob's size.
        self.assertLess(int(fields['peak_rss_mb']), 512, line)


class SharedBlobDirTests(BlobCase):

    def shared_storage(self, factory=None, **kw):
        """A storage of ``factory``'s database (the test's by default) with
        blob-dir ``shared`` as its shared blob directory."""
        kw.setdefault('keep_history', self.keep_history)
        kw.update(blob_dir=os.path.join(self.tmp, 'shared'), shared_blob_dir=True)
        options = Options(**kw)
        storage = RelStorage((factory or self.factory).make_adapter(options), options=options)
        self._open.append(storage)
        return storage

    def test_the_directory_s_files_follow_the_umask(self):
        # A helper agent's check: the file naming the directory's database
        # was readable by its owner only (whatever the umask), and a second
        # system user sharing the directory could not open the storage.
        from relstorage.blobs.shared import DATABASE_MARKER
        old = os.umask(0o002)
        try:
            db = ZODB.DB(self.shared_storage())
            self.addCleanup(db.close)
            with db.transaction() as conn:
                conn.root()['x'] = Blob(b'data')
        finally:
            os.umask(old)
        marker = os.path.join(self.tmp, 'shared', DATABASE_MARKER)
        self.assertEqual(os.stat(marker).st_mode & 0o777, 0o664)

    def test_a_directory_belongs_to_one_database(self):
        # A helper agent's check: databases A and B given the same shared
        # blob-dir (a staging copy pointed at production's directory) both
        # opened, and B's pack removed A's current blob file, the only copy
        # (B's sweep took it for one of its own replaced revisions).
        from relstorage.blobs.shared import DATABASE_MARKER
        db_a = ZODB.DB(self.shared_storage())
        self.addCleanup(db_a.close)
        with db_a.transaction() as conn:
            conn.root()['x'] = Blob(b'A data')
        marker = os.path.join(self.tmp, 'shared', DATABASE_MARKER)
        self.assertTrue(os.path.exists(marker))
        other = self.factory.named('shared_blobs_b')
        other.fresh(self.keep_history)
        # (A SQLite one makes a directory of its own: one was left in /tmp
        # by each run of the suite.)
        self.addCleanup(other.cleanup)
        for read_only in (False, True):
            with self.assertRaises(RelStorageError) as raised:
                self.shared_storage(other, read_only=read_only)
            self.assertIn('holds the blobs of another database', str(raised.exception))
        # Another storage of A is welcome; a directory without the file (an
        # earlier release's) is bound to the first database that opens it.
        self.shared_storage().close()
        os.remove(marker)
        self.shared_storage().close()
        with self.assertRaises(RelStorageError):
            self.shared_storage(other)
        with db_a.transaction() as conn:
            with conn.root()['x'].open('r') as f:
                self.assertEqual(f.read(), b'A data')


ALL = (BlobCacheTests, BlobCrashTests, BigBlobTests, SharedBlobDirTests)
CASES = ALL + tuple(type(c.__name__ + 'HF', (c,), {'keep_history': False})
                    for c in (BlobCacheTests, BlobCrashTests))
