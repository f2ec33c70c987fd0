"""The shared state cache's guarantees, run against memcached and Redis.

``SharedCacheTests`` is the base of one test class per backend
(test_cache_memcache.py, test_cache_redis.py), which provides:

- ``servers``: the ``cache-servers`` value the storages use;
- ``prefix``: a ``cache-prefix`` no other test uses on that server;
- ``private_server()``: a server of its own, started for the test and
  stopped by it (``.address``, ``.stop()``), for the tests that stop one;
- ``dead_servers()``: a ``cache-servers`` value where nothing listens.
"""
import logging
import os
import shutil
import socket
import time

from ZODB.POSException import POSKeyError
from ZODB.tests.StorageTestBase import zodb_unpickle
from ZODB.utils import u64
from ZODB.utils import z64

from relstorage.cache.shared import open_shared_cache
from relstorage.tests.core_cases import ForkedChild
from relstorage.tests.test_cache import SqliteCacheCase


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def wait_for_port(port, proc, what):
    """Until something accepts connections on 127.0.0.1:port; RuntimeError
    with the server's stderr if ``proc`` exits first or after 10 s."""
    deadline = time.time() + 10
    while True:
        try:
            socket.create_connection(('127.0.0.1', port), timeout=0.5).close()
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                err = proc.stderr.read().decode(errors='replace')
                raise RuntimeError('%s did not start: %s' % (what, err))
            time.sleep(0.05)


class SharedCacheTests(SqliteCacheCase):

    servers = None
    prefix = 'test'

    def private_server(self):
        raise NotImplementedError

    def dead_servers(self):
        raise NotImplementedError

    def client(self, prefix=None, servers=None):
        client = open_shared_cache(servers or self.servers, None, prefix or self.prefix)
        self._closables.append(client)
        return client

    def storage(self, **kw):
        kw.setdefault('cache_servers', self.servers)
        kw.setdefault('cache_prefix', self.prefix)
        return super().storage(**kw)

    def test_client_round_trip_and_keys(self):
        client = self.client()
        self.assertEqual(client.key(0x1f, 0xabc), '%s:s:1f:abc' % self.prefix)
        client.set_many({(1, 10): b'one', (2, 10): b'two'})
        self.assertEqual(client.get(1, 10), b'one')
        self.assertIsNone(client.get(1, 11))               # another revision
        self.assertEqual(client.get_many([(1, 10), (2, 10), (3, 10)]),
                         {(1, 10): b'one', (2, 10): b'two'})
        other = self.client(prefix=self.prefix + '-other')
        self.assertIsNone(other.get(1, 10))                # another prefix
        client.set_many({(3, 10): b'x' * 1000})            # one key, no pipeline
        self.assertEqual(client.get_many([(3, 10)]), {(3, 10): b'x' * 1000})
        self.assertEqual(client.set_hot(7, [(1, 10), (2, 10)]), 2)
        self.assertEqual(client.get_hot(), (7, [(1, 10), (2, 10)]))
        stats = client.stats()
        self.assertEqual((stats['hits'], stats['misses'], stats['errors']), (4, 2, 0))

    def test_a_forked_child_talks_to_the_server_on_sockets_of_its_own(self):
        # A web server forking its workers after the application opened
        # the database (gunicorn --preload): with the parent's sockets,
        # two processes asking at once read each other's replies.
        client = self.client()
        client.set_many({(1, 1): b'warm'})
        self.assertEqual(client.get(1, 1), b'warm')

        def hammer(oid):
            wrong = 0
            for i in range(400):
                value = b'%d-%d' % (oid, i)
                client.set_many({(oid, i): value, (oid, i + 100000): value}, wait=True)
                got = client.get_many([(oid, i), (oid, i + 100000)])
                wrong += got != {(oid, i): value, (oid, i + 100000): value}
            return wrong, client.stats()['errors']

        child = ForkedChild(lambda: b'%d %d' % hammer(2))
        mine = hammer(3)
        status, said = child.result()
        self.assertEqual(status, 0, said)
        theirs = tuple(int(n) for n in said.split())
        self.assertEqual((mine, theirs), ((0, 0), (0, 0)))

    def test_other_process_reads_what_one_committed(self):
        writer, reader = self.storage(), self.storage()
        # More than one batch (SHARED_BATCH) of states.
        oids = [writer.new_oid() for _ in range(250)]
        inst = reader.new_instance()
        inst.poll_invalidations()
        tid = self.commit(writer, {oid: i for i, oid in enumerate(oids)})
        # The reader learns the new tids from its poll; the states come from
        # the shared cache (the writer put them there when it committed).
        self.assertEqual(sorted(inst.poll_invalidations()), sorted(oids))
        for i, oid in enumerate(oids):
            state, serial = inst.load(oid)
            self.assertEqual((zodb_unpickle(state).value, serial), (i, tid))
        stats = reader.cache_stats()
        self.assertEqual(stats['db_loads'], 0)
        self.assertEqual(stats['shared']['hits'], 250)
        inst.release()

    def test_committed_states_are_shared_when_commit_returns(self):
        # Regression: committed states used to be sent without waiting for
        # memcached's reply, so a process that polled right after the commit
        # could ask memcached before the set had been processed, and read
        # from the database (seen once in CI).
        writer, reader = self.storage(), self.storage()
        oids = [writer.new_oid() for _ in range(10)]
        inst = reader.new_instance()
        inst.poll_invalidations()
        for rnd in range(40):
            tid = self.commit(writer, {oid: rnd for oid in oids},
                              serials=None if rnd == 0 else {oid: last for oid in oids})
            last = tid
            self.assertEqual(sorted(inst.poll_invalidations()), sorted(oids))
            for oid in oids:
                self.assertEqual(inst.load(oid)[1], tid)
        self.assertEqual(reader.cache_stats()['db_loads'], 0)
        inst.release()

    def test_states_read_from_the_database_are_shared(self):
        plain = self.storage(cache_servers=None)     # commits without the shared cache
        first, second = self.storage(), self.storage()
        oids = [plain.new_oid() for _ in range(5)]
        inst2 = second.new_instance()
        inst2.poll_invalidations()
        tid = self.commit(plain, {oid: 'v' for oid in oids})
        inst1 = first.new_instance()
        inst1.poll_invalidations()
        for oid in oids:
            self.assertEqual(inst1.load(oid)[1], tid)
        self.assertEqual(first.cache_stats()['db_loads'], 5)
        inst1.poll_invalidations()                         # sends the batch
        # Sets do not wait for replies: let the server catch up.
        client = first._cache.shared
        deadline = time.time() + 5
        while client.get(u64(oids[-1]), u64(tid)) is None and time.time() < deadline:
            time.sleep(0.01)
        inst2.poll_invalidations()                         # learns the tids
        for oid in oids:
            self.assertEqual(inst2.load(oid)[1], tid)
        self.assertEqual(second.cache_stats()['db_loads'], 0)
        self.assertEqual(second.cache_stats()['shared']['hits'], 5)
        inst1.release()
        inst2.release()

    def wait_for_hint(self, storage, oid):
        # Hints of database loads are sent without waiting for replies.
        client = storage._cache.shared
        deadline = time.time() + 5
        while not client.get_hints([u64(oid)]) and time.time() < deadline:
            time.sleep(0.01)

    def read_all(self, storage, oids):
        inst = storage.new_instance()
        inst.poll_invalidations()
        result = []
        for oid in oids:
            state, serial = inst.load(oid)
            result.append((zodb_unpickle(state).value, serial))
        inst.release()
        return result

    def test_fresh_process_reads_what_another_process_loaded(self):
        # A fresh process knows no tids.  Its change log starts with the
        # newest changes (here at most 200: cache-delta-size-limit 400, and
        # the newest transaction alone changed 250 objects, so none), which
        # do not include the 30 objects; what another process left
        # in the shared cache tells it which revisions are current, so the
        # states come from there without asking the database.
        plain = self.storage(cache_servers=None)
        oids = [plain.new_oid() for _ in range(30)]
        others = [plain.new_oid() for _ in range(250)]
        tid = self.commit(plain, {oid: i for i, oid in enumerate(oids)})
        self.commit(plain, {other: 'x' for other in others})
        first = self.storage()
        expected = [(i, tid) for i in range(len(oids))]
        self.assertEqual(self.read_all(first, oids), expected)
        self.assertGreaterEqual(first.cache_stats()['db_loads'], 30)
        first.close()              # sends what it read, and its hot list
        self.wait_for_hint(self.storage(), oids[-1])

        # 1. The hot list: the fresh process warms its local cache at its
        #    first poll, in a few requests.
        fresh = self.storage(cache_delta_size_limit=400)
        self.assertEqual(self.read_all(fresh, list(reversed(oids))), expected[::-1])
        stats = fresh.cache_stats()
        self.assertEqual(stats['db_loads'], 0)
        self.assertGreaterEqual(stats['warmed_from_shared'], 30)
        self.assertEqual(stats['index_mismatches'], 0)
        self.assertEqual(stats['log_entries'], 0)

        # 2. Without a hot list, read-ahead in OID order asks the shared cache for
        #    the hints and states of the next objects, two requests per
        #    batch.
        fresh._cache.shared.set_hot(0, [])
        fresh = self.storage(cache_delta_size_limit=400)
        self.assertEqual(self.read_all(fresh, oids), expected)
        stats = fresh.cache_stats()
        self.assertEqual(stats['warmed_from_shared'], 0)
        # The three loads before read-ahead starts ask the database: for a
        # single load a hint would cost a round trip more than the query.
        self.assertEqual(stats['db_loads'], 3)
        self.assertGreaterEqual(stats['tids_from_hints'], 27)
        self.assertEqual(stats['index_mismatches'], 0)

    def test_two_databases_with_one_prefix_never_meet(self):
        # A helper agent's check: two databases given the same
        # cache-prefix on one server (a Plone recipe writes cache-prefix
        # plone for every site).  A fresh process of one, whose change log
        # did not reach back to its objects, took the other's hot list
        # for its own and served the other's objects.
        tids = {}
        for name in ('a', 'b'):
            plain = self.storage(data=name, cache_servers=None)
            oids = [plain.new_oid() for _ in range(30)]     # the same in both
            others = [plain.new_oid() for _ in range(250)]
            tids[name] = self.commit(plain, {oid: '%s%d' % (name, i)
                                             for i, oid in enumerate(oids)})
            self.commit(plain, {other: 'x' for other in others})
        reader = self.storage(data='b')
        self.assertEqual([value for value, _ in self.read_all(reader, oids)],
                         ['b%d' % i for i in range(30)])
        reader.close()              # sends what it read, and its hot list
        self.wait_for_hint(self.storage(data='b'), oids[-1])
        # A commits again: its snapshots are newer than b's tids.
        plain = self.storage(data='a', cache_servers=None)
        self.commit(plain, {plain.new_oid(): 'later'})
        fresh = self.storage(data='a', cache_delta_size_limit=400)
        self.assertEqual(self.read_all(fresh, oids),
                         [('a%d' % i, tids['a']) for i in range(30)])
        self.assertNotEqual(fresh._cache.shared.prefix,
                            self.storage(data='b')._cache.shared.prefix)

    def test_namespace_is_the_database_s_own(self):
        # Every process of one database shares the namespace; a database
        # made again at the same place (its file may even get the same
        # inode) has another, as the key it keeps is new.
        import shutil
        first = self.storage(data='c')
        self.assertEqual(self.storage(data='c')._cache.shared.prefix,
                         first._cache.shared.prefix)
        self.assertTrue(first._cache.shared.prefix.startswith(self.prefix + ':'))
        old = first._cache.shared.prefix
        for storage in list(self._closables):
            storage.close()
        shutil.rmtree(os.path.join(self.tmp, 'c'))
        self.assertNotEqual(self.storage(data='c')._cache.shared.prefix, old)

    def test_fresh_process_after_pack_ignores_what_the_shared_cache_knew(self):
        # Objects removed by a pack leave no change for the change log to
        # see; a fresh process must not take them from the shared cache (hot list,
        # hints, states).  After a pack, processes use a new namespace.
        writer = self.storage()
        # (A root referring to nothing: a pack refuses a database without.)
        self.commit(writer, {z64: 'root'})
        oids = [writer.new_oid() for _ in range(3)]
        tid = self.commit(writer, {oid: 'v' for oid in oids})
        first = self.storage()
        self.read_all(first, oids)
        first.close()                             # publishes its hot list
        self.wait_for_hint(self.storage(), oids[-1])
        # Nothing references these objects: a pack with GC removes them.
        from ZODB.serialize import referencesf
        packer = self.storage()
        packer.pack(time.time() + 1, referencesf)
        fresh = self.storage()
        inst = fresh.new_instance()
        inst.poll_invalidations()
        for oid in oids:
            self.assertRaises(POSKeyError, inst.load, oid)
        inst.release()
        self.assertEqual(fresh.cache_stats()['warmed_from_shared'], 0)
        # (States are immutable per revision: only hints and the hot list,
        # which say what is current, move to a namespace of the mark.)
        self.assertEqual(fresh._cache.shared.prefix, writer._cache.shared.prefix)
        self.assertTrue(fresh._cache.shared.hint_prefix.endswith(':h1'))
        self.assertTrue(tid)

    def test_a_fresh_process_after_a_restore_takes_nothing_of_the_lost_history(self):
        # A helper agent's check: a backup restored, then committed to past
        # the lost transactions, and a process started afterwards served an
        # object's state of the lost history, from the hot list or from the
        # hints another process had left (the docs ask for a flush after a
        # restore; this one was not flushed).  The change log of a fresh
        # process (cache-delta-size-limit 10: the 5 newest changes, after
        # the objects' own) covers the lost transaction's tid and shows no
        # change of the objects there: the hints are refuted.
        plain = self.storage(cache_servers=None)
        oids = [plain.new_oid() for _ in range(3)]
        original = self.commit(plain, {oid: 'original' for oid in oids})
        for _ in range(6):
            self.commit(plain, {plain.new_oid(): 'other'})
        plain.close()
        data, backup = os.path.join(self.tmp, 'data'), os.path.join(self.tmp, 'backup')
        shutil.copytree(data, backup)
        doomed = self.storage()                 # its commits will be lost
        # (Its commit leaves hints of the lost revisions, its close the
        # hot list.)
        lost = self.commit(doomed, {oid: 'lost' for oid in oids},
                           {oid: original for oid in oids})
        self.assertEqual([value for value, _ in self.read_all(doomed, oids)], ['lost'] * 3)
        doomed.close()
        self.wait_for_hint(self.storage(), oids[-1])
        for storage in self._closables:
            storage.close()
        shutil.rmtree(data)
        shutil.copytree(backup, data)           # the restore
        plain = self.storage(cache_servers=None)
        other = plain.new_oid()
        later = self.commit(plain, {other: 'after the restore'})
        self.assertGreater(later, lost)
        for hot in (False, True):
            fresh = self.storage(cache_delta_size_limit=10)
            if not hot:
                # Without the hot list: the hints, which prefetch asks for.
                fresh._cache.shared.set_hot(0, [])
                fresh.close()
                fresh = self.storage(cache_delta_size_limit=10)
                inst = fresh.new_instance()
                inst.poll_invalidations()
                inst.prefetch(oids)
                self.assertEqual([self.value(inst, oid) for oid in oids],
                                 [('original', original)] * 3)
                inst.release()
            self.assertEqual(self.read_all(fresh, oids), [('original', original)] * 3)
            self.assertEqual(fresh.cache_stats()['index_mismatches'], 0)

    def test_processes_started_before_and_after_a_pack_share_states(self):
        # A helper agent's check (a soak with packs from cron): a process
        # started after a pack used a namespace of that pack's mark for
        # everything, the processes running since before it kept theirs:
        # none found what the other group stored (two copies of every
        # state in the shared cache, and loads from the database).
        from ZODB.serialize import referencesf
        writer = self.storage()
        # (A root referring to nothing: a pack refuses a database without.)
        self.commit(writer, {z64: 'root'})
        self.commit(writer, {writer.new_oid(): 'garbage' for _ in range(3)})
        running = self.storage()
        inst = running.new_instance()
        inst.poll_invalidations()
        inst.release()
        self.storage().pack(time.time() + 1, referencesf)
        inst = running.new_instance()
        inst.poll_invalidations()                   # learns of the pack
        oid = inst.new_oid()
        tid = self.commit(inst, {oid: 'after'})
        inst.release()
        fresh = self.storage()
        inst = fresh.new_instance()
        inst.poll_invalidations()
        state, serial = inst.load(oid)
        self.assertEqual((zodb_unpickle(state).value, serial), ('after', tid))
        inst.release()
        self.assertEqual(fresh.cache_stats()['db_loads'], 0)
        self.assertEqual((fresh._cache.shared.prefix, fresh._cache.shared.hint_prefix),
                         (running._cache.shared.prefix, running._cache.shared.hint_prefix))

    def test_running_process_takes_no_hint_of_what_a_pack_removed(self):
        # A helper agent's check: a process running across a pack (which it
        # learns from the pack's removal lists, keeping the shared cache's
        # namespace) took the hints another process had written before the
        # pack for objects the pack removed, loaded them in new
        # transactions, and let a reference to one be committed.
        from ZODB.serialize import referencesf
        writer = self.storage()
        # (A root referring to nothing: a pack refuses a database without.)
        self.commit(writer, {z64: 'root'})
        oids = [writer.new_oid() for _ in range(30)]
        self.commit(writer, {oid: 'v' for oid in oids})
        running = self.storage()
        inst = running.new_instance()
        inst.poll_invalidations()           # its change log starts
        inst.release()
        other = self.storage()
        self.read_all(other, oids)
        other._cache.flush()
        self.wait_for_hint(self.storage(), oids[-1])
        prefix = running._cache.shared.prefix
        self.storage().pack(time.time() + 1, referencesf)   # removes them all
        inst = running.new_instance()
        inst.poll_invalidations()
        self.assertEqual(running._cache.shared.prefix, prefix)     # (the lists)
        inst.prefetch(oids)
        for oid in oids:
            self.assertRaises(POSKeyError, inst.load, oid)
        inst.release()
        self.assertEqual(running.cache_stats()['tids_from_hints'], 0)

    def test_removed_object_reread_in_an_old_snapshot_goes_nowhere(self):
        # A review finding: an instance still in a snapshot from before the
        # pack read a removed object again; its process's index then said
        # the object was current for new transactions too, and the hot
        # list it published carried it to another running process.
        r1, r2 = self.storage(), self.storage()

        def publish():
            r1._cache.publish_hot()
            r2._cache.publish_hot()
        self.reread_removed_across_a_pack([r1, r2], publish)

    def test_after_zap_all_no_process_takes_objects_from_the_shared_cache(self):
        # zap_all moves the pack mark on like a pack: a process that read
        # the objects before, and a fresh one, must not find them again in
        # the shared cache (hot list, hints, states) although the last tid
        # went back and new commits follow.
        writer = self.storage()
        oids = [writer.new_oid() for _ in range(3)]
        self.commit(writer, {oid: 'v' for oid in oids})
        first = self.storage()
        self.read_all(first, oids)
        first.close()                             # publishes its hot list
        self.wait_for_hint(self.storage(), oids[-1])
        reader = self.storage()
        self.read_all(reader, oids)
        zapper = self.storage()
        zapper.zap_all()
        self.assertEqual(zapper.lastTransaction(), z64)
        self.commit(zapper, {zapper.new_oid(): 'after'})
        for storage in (reader, self.storage()):
            inst = storage.new_instance()
            inst.poll_invalidations()
            for oid in oids:
                self.assertRaises(POSKeyError, inst.load, oid)
            inst.release()
            self.assertIn(':p1', storage._cache.shared.prefix)

    def test_hot_list_of_a_short_lived_process_keeps_the_busy_ones(self):
        writer = self.storage()
        oids = [writer.new_oid() for _ in range(40)]
        self.commit(writer, {oid: 'v' for oid in oids})
        busy = self.storage()
        self.read_all(busy, oids)
        self.assertEqual(busy._cache.publish_hot(), 40)
        brief = self.storage()
        self.read_all(brief, oids[:2])
        brief.close()
        _, pairs = self.storage()._cache.shared.get_hot()
        self.assertEqual(len(pairs), 40)
        self.assertEqual([u64(o) for o in oids[:2]], sorted(p[0] for p in pairs[:2]))

    def test_fresh_process_knows_the_newest_changes(self):
        # Objects changed recently are in the change log a fresh process
        # starts with: their tids are known without hints or queries.
        writer = self.storage()
        oids = [writer.new_oid() for _ in range(20)]
        tid = self.commit(writer, {oid: i for i, oid in enumerate(oids)})
        fresh = self.storage()
        self.assertEqual(self.read_all(fresh, oids), [(i, tid) for i in range(20)])
        stats = fresh.cache_stats()
        self.assertEqual((stats['db_loads'], stats['tids_from_hints']), (0, 0))
        self.assertEqual(stats['shared']['hits'], 20)

    def object_hinted_by_another_process(self):
        """(storage without the shared cache, oid, tid): an object committed
        without it, then read by another process, which left its state and
        a hint in the shared cache."""
        plain = self.storage(cache_servers=None)       # writes leave no hints
        oid = plain.new_oid()
        tid = self.commit(plain, {oid: 'old'})
        first = self.storage()
        self.assertEqual(self.read_all(first, [oid]), [('old', tid)])
        first.close()
        self.wait_for_hint(self.storage(), oid)
        return plain, oid, tid

    def test_hint_of_an_object_changed_since_is_not_served(self):
        plain, oid, tid1 = self.object_hinted_by_another_process()
        tid2 = self.commit(plain, {oid: 'new'}, {oid: tid1})
        fresh = self.storage()
        self.assertEqual(self.read_all(fresh, [oid]), [('new', tid2)])
        self.assertEqual(fresh.cache_stats()['index_mismatches'], 0)

    def test_hint_older_than_the_change_log_is_not_used(self):
        # cache-delta-size-limit 10: a fresh process's log holds the 5
        # newest changes, so the change of ``oid`` after its hint was
        # written falls outside the log; the hint must then be ignored.
        plain, oid, tid1 = self.object_hinted_by_another_process()
        others = [plain.new_oid() for _ in range(8)]
        tid2 = self.commit(plain, {oid: 'new'}, {oid: tid1})
        for other in others:
            self.commit(plain, {other: 'x'})
        fresh = self.storage(cache_delta_size_limit=10)
        self.assertEqual(self.read_all(fresh, [oid]), [('new', tid2)])
        stats = fresh.cache_stats()
        self.assertEqual((stats['db_loads'], stats['tids_from_hints']), (1, 0))
        self.assertEqual(stats['index_mismatches'], 0)
        # With a log long enough, the same hint is refuted by the log.
        roomy = self.storage()
        self.assertEqual(self.read_all(roomy, [oid]), [('new', tid2)])

    def test_small_blobs_are_shared(self):
        # Processes with blob-dir caches of their own: the first to read a
        # small blob from the database puts it in the shared cache, where
        # the next one finds it; a blob over the limit is not sent.
        import ZODB
        from ZODB.blob import Blob
        from relstorage.cache.shared import MAX_VALUE
        dbs = []
        for name in ('writer', 'first', 'second'):
            blob_dir = os.path.join(self.tmp, 'blobs-' + name)
            os.mkdir(blob_dir)
            dbs.append(ZODB.DB(self.storage(blob_dir=blob_dir, shared_blob_dir=False)))
        writer, first, second = dbs
        small, big = b'small blob ' * 100, b'B' * (MAX_VALUE + 1)
        with writer.transaction() as conn:
            for name, data in (('small', small), ('big', big)):
                conn.root()[name] = blob = Blob()
                with blob.open('w') as f:
                    f.write(data)
        for db in (first, second):
            with db.transaction() as conn:
                for name, data in (('small', small), ('big', big)):
                    with conn.root()[name].open() as f:
                        self.assertEqual(f.read(), data)
        first_stats = first.storage.cache_stats()['shared']
        second_stats = second.storage.cache_stats()['shared']
        self.assertEqual((first_stats['blob_hits'], first_stats['blob_misses']), (0, 2))
        self.assertEqual((second_stats['blob_hits'], second_stats['blob_misses']), (1, 1))
        for db in dbs:
            db.close()

    def test_server_stopped_mid_run(self):
        # Reads go on from the database, with one WARNING for the outage.
        server = self.private_server()
        writer = self.storage(cache_servers=server.address)
        reader = self.storage(cache_servers=server.address)
        oids = [writer.new_oid() for _ in range(10)]
        inst = reader.new_instance()
        inst.poll_invalidations()
        tid = self.commit(writer, {oid: 'a' for oid in oids})
        inst.poll_invalidations()
        self.assertEqual(inst.load(oids[0])[1], tid)
        self.assertEqual(reader.cache_stats()['shared']['hits'], 1)
        server.stop()
        with self.assertLogs('relstorage.cache', logging.WARNING) as logs:
            tid2 = self.commit(writer, {oid: 'b' for oid in oids},
                               {oid: tid for oid in oids})
            inst.poll_invalidations()
            for oid in oids:
                state, serial = inst.load(oid)
                self.assertEqual((zodb_unpickle(state).value, serial), ('b', tid2))
            reader._cache.local.clear()
            for oid in oids:
                self.assertEqual(zodb_unpickle(inst.load(oid)[0]).value, 'b')
        # One per process (each storage here stands for one).
        warnings = [r.getMessage() for r in logs.records if r.levelno >= logging.WARNING]
        self.assertEqual(len(warnings), 2, logs.output)
        for warning in warnings:
            self.assertIn('is unavailable', warning)
            # (A helper agent saw "unavailable ()" from pymemcache.)
            self.assertNotIn('()', warning)
        self.assertGreaterEqual(reader.cache_stats()['shared']['errors'], 1)
        self.assertEqual(reader.cache_stats()['shared']['down'],
                         reader.cache_stats()['shared']['servers'])
        inst.release()

    def test_server_never_running(self):
        storage = self.storage(cache_servers=self.dead_servers())
        oid = storage.new_oid()
        tid = self.commit(storage, {oid: 1})
        storage._cache.local.clear()
        self.assertEqual(storage.load(oid)[1], tid)
        self.assertGreaterEqual(storage.cache_stats()['shared']['errors'], 1)
