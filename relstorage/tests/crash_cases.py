"""Crash-point sweep: a committing process dies at every step of commit.

For each fault point of commit.py (``FAULT_POINTS``), a *victim* process
commits in a loop with ``RS_FAULT_POINT`` set, so that it ends with
``os._exit`` (no rollback, no cleanup: what kill -9 leaves) the n-th time it
reaches the point.  Three *writers* keep committing meanwhile.  Every
transaction, the victim's included, keeps an invariant: objects ``a`` and
``b`` hold the same value, and ``counter`` counts the commits.  Then:

- the victim's last transaction is committed if and only if its database
  COMMIT returned (points from ``finish.committed`` on);
- no writer ever saw ``a != b``, and neither does the test;
- the victim's locks are gone: a commit of the same objects succeeds;
- the OIDs the victim was given are never handed out again;
- the blob the victim stored in its killed transaction is not loadable,
  and no final-named file of it was left in its blob directory.

Three runs per point here; ``CrashPointSweepDeep`` (zope.testrunner level 2,
which ``make test`` runs on SQLite) does ten.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import transaction
import ZODB
from BTrees.Length import Length
from ZODB.POSException import ConflictError
from ZODB.POSException import POSKeyError
from ZODB.tests.MinPO import MinPO

from relstorage.storage import faults
from relstorage.storage.commit import FAULT_POINTS
from relstorage.storage.commit import FIRST_COMMITTED_POINT

from .core_cases import FactoryCase

#: One transaction of the invariant, shared by the writers and the victims.
#: A victim also stores a new blob and records, before and after each
#: commit, what it is about to commit.  Role ``forker`` reads one JSON line
#: per victim on stdin and forks it (imports done once: a victim costs a
#: fork, not an interpreter start), answering with its exit status.
CHILD = r'''
import json, os, sys, time, transaction, ZODB
from ZODB.blob import Blob
from ZODB.POSException import ConflictError
from relstorage.options import Options
from relstorage.storage import RelStorage
from relstorage.storage import faults
sys.path.insert(0, sys.argv[1])
import factory_for_subprocess as f


def run(role, blob_dir, journal, stop_file):
    options = Options(keep_history=f.KEEP_HISTORY, blob_dir=blob_dir,
                      shared_blob_dir=False, commit_lock_timeout=20)
    db = ZODB.DB(RelStorage(f.make_adapter(options), options=options))
    tm = transaction.TransactionManager()
    conn = db.open(tm)
    log = open(journal, 'a')

    def note(**kw):
        log.write(json.dumps(kw) + '\n')
        log.flush()
        os.fsync(log.fileno())

    n = 0
    while not os.path.exists(stop_file):
        n += 1
        for attempt in range(200):
            try:
                tm.begin()
                root = conn.root()
                a, b = root['a'], root['b']
                if a.value != b.value:
                    note(broken=[a.value, b.value])
                    return 3
                a.value += 1
                b.value = a.value
                root['counter'].change(1)
                if role == 'victim':
                    blob = Blob(b'victim %d' % n)
                    root['victim_blob'] = blob
                    root['victim'] = '%s:%d' % (journal, n)
                    conn.add(blob)
                    note(trying=n, blob=blob._p_oid.hex())
                tm.commit()
                if role == 'victim':
                    note(done=n)
                break
            except ConflictError:
                tm.abort()
                time.sleep(0.01)
        else:
            note(gave_up=n)
            return 4
        if role == 'writer':
            time.sleep(0.02)
        elif n >= 50:
            break
    conn.close()
    db.close()
    note(finished=n)
    return 0


role = sys.argv[2]
if role != 'forker':
    sys.exit(run(*sys.argv[2:6]))
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        faults.arm(job['point'], job['after'])
        os._exit(run('victim', job['blob_dir'], job['journal'], job['stop_file']))
    status = os.waitpid(pid, 0)[1]
    print(json.dumps({'exit': os.waitstatus_to_exitcode(status)}), flush=True)
'''


class WritersCase(FactoryCase):
    """Three writer processes keep committing the invariant while a test
    does something to the database."""

    def setUp(self):
        super().setUp()
        self.tmp = tempfile.mkdtemp(prefix='relstoragetest_crash_')
        self.addCleanup(shutil.rmtree, self.tmp, True)
        db = self._db('setup')
        try:
            with db.transaction() as conn:
                root = conn.root()
                root['a'], root['b'] = MinPO(0), MinPO(0)
                root['counter'] = Length()
                root['victim'] = 0
        finally:
            db.close()
        self.helper = self.factory.write_subprocess_factory(self.tmp, self.keep_history)
        self.stop_file = os.path.join(self.tmp, 'stop')

    def _db(self, name):
        return ZODB.DB(self.storage(blob_dir=os.path.join(self.tmp, name),
                                    shared_blob_dir=False))

    def with_writers(self, func):
        """``func()`` while three writers commit; then check they all kept
        the invariant and finished cleanly."""
        writers = [self._spawn(self.helper, 'writer', 'w%d' % i, self.stop_file)
                   for i in range(3)]
        try:
            return func()
        finally:
            with open(self.stop_file, 'w'):
                pass
            for proc, journal in writers:
                try:
                    out, err = proc.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, err = proc.communicate()
                self.assertEqual(proc.returncode, 0, (journal, _lines(journal),
                                                      err.decode()[-2000:]))
            self._check_invariant()

    def _spawn(self, helper, role, name, stop_file, stdin=None):
        journal = os.path.join(self.tmp, name + '.journal')
        # (A victim dies holding a new Blob's file, which ZODB makes in
        # the temporary directory: in the test's, not the machine's /tmp.)
        env = dict(os.environ, TMPDIR=self.tmp)
        proc = subprocess.Popen(
            [sys.executable, '-c', CHILD, helper, role, os.path.join(self.tmp, name),
             journal, stop_file],
            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        return proc, journal

    def _check_invariant(self):
        storage = self.storage(blob_dir=os.path.join(self.tmp, 'final'), shared_blob_dir=False)
        db = ZODB.DB(storage)
        try:
            with db.transaction() as conn:
                root = conn.root()
                self.assertEqual(root['a'].value, root['b'].value)
                self.assertEqual(root['a'].value, root['counter']())
            # OIDs given to the victims are never handed out again.
            fresh = {storage.new_oid() for _ in range(300)}
            self.assertFalse(fresh & getattr(self, '_victim_oids', set()))
        finally:
            db.close()


class CrashPointSweep(WritersCase):

    runs_per_point = 3
    points = FAULT_POINTS

    def test_every_crash_point(self):
        forker, _ = self._spawn(self.helper, 'forker', 'forker', self.stop_file,
                                stdin=subprocess.PIPE)
        try:
            def sweep():
                for point in self.points:
                    for run in range(self.runs_per_point):
                        self._kill_at(forker, point, run)
            self.with_writers(sweep)
        finally:
            forker.stdin.close()
            forker.wait(60)
            forker.stdout.close()
            forker.stderr.close()

    def _kill_at(self, forker, point, run):
        name = 'victim-%s-%d' % (point.replace('.', '-'), run)
        after = random.randint(0, 2)
        journal = os.path.join(self.tmp, name + '.journal')
        forker.stdin.write((json.dumps({
            'point': point, 'after': after, 'blob_dir': os.path.join(self.tmp, name),
            'journal': journal, 'stop_file': os.path.join(self.tmp, 'never')}) + '\n'
        ).encode())
        forker.stdin.flush()
        answer = forker.stdout.readline()
        label = '%s (run %d, after %d)' % (point, run, after)
        if not answer:
            self.fail('%s: the forker died: %s' % (label, forker.stderr.read().decode()[-3000:]))
        self.assertEqual(json.loads(answer)['exit'], faults.EXIT_CODE, label)
        entries = _lines(journal)
        tried = [e for e in entries if 'trying' in e]
        done = {e['done'] for e in entries if 'done' in e}
        last = tried[-1] if tried else None
        committed = FAULT_POINTS.index(point) >= FAULT_POINTS.index(FIRST_COMMITTED_POINT)
        # The victim's locks are gone: this commit touches the same objects
        # (and waits at most commit-lock-timeout).
        db = self._db('check')
        try:
            _retry(db, lambda root: self._bump(root, label))
            with db.transaction() as conn:
                victim = conn.root()['victim']
            if last is None:
                # Died in tpc_begin of its first transaction... or before
                # storing anything: nothing of it may exist.
                self.assertEqual(point, 'begin', label)
                return
            n = last['trying']
            token = '%s:%d' % (journal, n)
            if committed:
                self.assertEqual(victim, token, label)
            else:
                self.assertNotIn(n, done, label)
                self.assertNotEqual(victim, token, label)
                self._assert_blob_gone(db, bytes.fromhex(last['blob']), label)
            self._assert_no_orphan_files(name, n if not committed else None, label)
        finally:
            db.close()
        self._victim_oids = getattr(self, '_victim_oids', set())
        self._victim_oids.update(bytes.fromhex(e['blob']) for e in tried)

    def _bump(self, root, label):
        self.assertEqual(root['a'].value, root['b'].value, label)
        root['a'].value += 1
        root['b'].value = root['a'].value
        root['counter'].change(1)

    def _assert_blob_gone(self, db, oid, label):
        storage = db.storage
        with self.assertRaises(POSKeyError, msg=label):
            storage.load(oid)

    def _assert_no_orphan_files(self, name, killed_n, label):
        # The victim's own blob directory: no final-named file of the
        # killed transaction's blob (its tid was never committed).
        root = os.path.join(self.tmp, name)
        for dirpath, _, files in os.walk(root):
            for fname in files:
                if fname.endswith('.blob') and killed_n is not None:
                    with open(os.path.join(dirpath, fname), 'rb') as f:
                        self.assertNotEqual(f.read(), b'victim %d' % killed_n, label)

class CrashPointSweepDeep(CrashPointSweep):
    level = 2
    runs_per_point = 10


BIG_TRANSACTION = r'''
import json, resource, sys, time
from ZODB.Connection import TransactionMetaData
from ZODB.tests.MinPO import MinPO
from ZODB.tests.StorageTestBase import zodb_pickle
from ZODB.utils import z64
from relstorage.options import Options
from relstorage.storage import RelStorage
sys.path.insert(0, sys.argv[1])
import factory_for_subprocess as f
count, size = int(sys.argv[2]), int(sys.argv[3])
options = Options(keep_history=f.KEEP_HISTORY, commit_lock_timeout=60)
storage = RelStorage(f.make_adapter(options), options=options)
started = time.time()
txn = TransactionMetaData()
storage.tpc_begin(txn)
first = last = None
for i in range(count):
    oid = storage.new_oid()
    first = first or oid
    last = oid
    storage.store(oid, z64, zodb_pickle(MinPO(b'%08d' % i + b'x' * (size - 8))), '', txn)
storage.tpc_vote(txn)
tid = storage.tpc_finish(txn)
elapsed = time.time() - started
print(json.dumps({'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                  'seconds': elapsed, 'first': first.hex(), 'last': last.hex(),
                  'tid': tid.hex()}))
storage.close()
'''


class BigTransactionTests(WritersCase):
    """200,000 new objects of 1 KB in one transaction, with bounded client
    memory, while three other processes keep committing."""

    level = 2
    objects = 200000
    size = 1024
    #: The interpreter with ZODB loaded is about 40 MB; the 200 MB of
    #: states must not be held in memory.
    max_rss_mb = 200

    def test_big_transaction(self):
        def big():
            proc = subprocess.run([sys.executable, '-c', BIG_TRANSACTION, self.helper,
                                   str(self.objects), str(self.size)],
                                  capture_output=True, timeout=1200)
            self.assertEqual(proc.returncode, 0, proc.stderr.decode()[-3000:])
            return json.loads(proc.stdout)
        result = self.with_writers(big)
        sys.stderr.write('\n  big transaction on %s: %d objects x %d B, peak RSS %.0f MB, '
                         '%.1f s\n' % (self.factory.name, self.objects, self.size,
                                        result['peak_rss_mb'], result['seconds']))
        self.assertLess(result['peak_rss_mb'], self.max_rss_mb)
        storage = self.storage()
        for oid in (result['first'], result['last']):
            serial = storage.load(bytes.fromhex(oid))[1]
            self.assertEqual(serial, bytes.fromhex(result['tid']))


def _retry(db, change, attempts=100):
    tm = transaction.TransactionManager()
    conn = db.open(tm)
    try:
        for _ in range(attempts):
            try:
                tm.begin()
                change(conn.root())
                tm.commit()
                return
            except ConflictError:
                tm.abort()
                time.sleep(0.01)
        raise AssertionError('no commit after %d conflicts' % attempts)
    finally:
        conn.close()


def _lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


CASES = (CrashPointSweep, type('CrashPointSweepHF', (CrashPointSweep,), {'keep_history': False}),
         CrashPointSweepDeep, BigTransactionTests)
