"""The shared test suite: ZODB's conformance mixins plus our own cases.

Each database module (test_sqlite.py, test_postgresql.py, ...) supplies only
a *database factory* and calls ``make_suite(factory)``.  A factory has:

- ``name``: short label ('sqlite', 'postgresql-psycopg', ...);
- ``fresh(keep_history)``: make an empty database for one test;
- ``make_adapter(options)``: an adapter on that database;
- ``cleanup()``: remove what ``fresh`` made.

The conformance tests are counted per variant and compared with
``EXPECTED_CONFORMANCE``; a test that goes missing upstream, or that we
skip without a reason listed in ``KNOWN_EXCLUSIONS``, fails the run.
"""
import os
import re
import sys
import unittest

import transaction
import ZODB
import ZODB.tests.testZODB
from ZODB.tests import BasicStorage
from ZODB.tests import ConflictResolution
from ZODB.tests import HistoryStorage
from ZODB.tests import IteratorStorage
from ZODB.tests import MTStorage
from ZODB.tests import PackableStorage
from ZODB.tests import PersistentStorage
from ZODB.tests import ReadOnlyStorage
from ZODB.tests import RecoveryStorage
from ZODB.tests import RevisionStorage
from ZODB.tests import StorageTestBase
from ZODB.tests import Synchronization
from ZODB.tests import TransactionalUndoStorage

from relstorage.options import Options
from relstorage.storage import RelStorage

# Conformance tests collected per history mode.  Raise these only when
# ZODB adds tests; a drop means something went missing.
EXPECTED_CONFORMANCE = {
    'history-free': 49,
    'history-preserving': 93,
}

# ZODBTests that exercise undo, which history-free storages do not offer.
HP_ONLY_ZODB_TESTS = {
    'testMultipleUndoInOneTransaction': 'undo needs a history-preserving storage',
}

# Upstream tests we deliberately do not run, with the reason.
KNOWN_EXCLUSIONS = {
    'testTransactionalUndoIterator':
        "expects undo records to be FileStorage back pointers (data_txn); we "
        "store the restored state itself, which IStorageRecordInformation allows",
}


class NamedDatabases:
    """For server factories: the extra databases ZODB's blob doctests open
    by name.  A subclass provides ``_named`` (a dict), ``_fresh_in`` and
    ``make_named(key)`` returning a factory for the database of that key."""

    def named(self, name):
        key = re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')[:20]
        if key not in self._named:
            self._named[key] = self.make_named(key)
        return self._named[key]

    def fresh_if_new(self, keep_history):
        # ZODB's doctest set-up gives every test its own working directory:
        # a database is new to a test when it has not been emptied there.
        here = os.getcwd()
        if self._fresh_in != here:
            self.fresh(keep_history)
            self._fresh_in = here


class RelStorageTestCase(StorageTestBase.StorageTestBase):
    """Base of every storage test: a fresh database per test."""

    keep_history = True
    factory = None          # set by make_suite

    def setUp(self):
        if self._testMethodName in KNOWN_EXCLUSIONS:
            self.skipTest(KNOWN_EXCLUSIONS[self._testMethodName])
        super().setUp()
        self.factory.fresh(self.keep_history)
        self._storage = self.make_storage()

    def tearDown(self):
        transaction.abort()
        super().tearDown()
        self.factory.cleanup()

    def make_options(self, **kw):
        kw.setdefault('keep_history', self.keep_history)
        kw.setdefault('commit_lock_timeout', 10)
        return Options(**kw)

    def make_storage(self, **kw):
        options = self.make_options(**kw)
        return RelStorage(self.factory.make_adapter(options), options=options)

    # PersistentStorage / ReadOnlyStorage reopen the same database.
    def open(self, read_only=False, **kw):
        if self._storage is not None:
            self._storage.close()
        self._storage = self.make_storage(read_only=read_only, **kw)

    # racetest: another client of the same database.
    def _new_storage_client(self):
        return self.make_storage()


class HistoryFreeConformance(
        RelStorageTestCase,
        BasicStorage.BasicStorage,
        Synchronization.SynchronizedStorage,
        ConflictResolution.ConflictResolvingStorage,
        PackableStorage.PackableStorageWithOptionalGC,
        PersistentStorage.PersistentStorage,
        MTStorage.MTStorage,
        ReadOnlyStorage.ReadOnlyStorage):
    keep_history = False

    def test_checkResolve_resolvable(self):
        # checkResolve(True) is not collected by name; call it explicitly.
        self.checkResolve()


class HistoryPreservingConformance(
        RelStorageTestCase,
        BasicStorage.BasicStorage,
        Synchronization.SynchronizedStorage,
        ConflictResolution.ConflictResolvingStorage,
        ConflictResolution.ConflictResolvingTransUndoStorage,
        PackableStorage.PackableStorageWithOptionalGC,
        PackableStorage.PackableUndoStorage,
        PersistentStorage.PersistentStorage,
        MTStorage.MTStorage,
        ReadOnlyStorage.ReadOnlyStorage,
        TransactionalUndoStorage.TransactionalUndoStorage,
        IteratorStorage.IteratorStorage,
        IteratorStorage.ExtendedIteratorStorage,
        RevisionStorage.RevisionStorage,
        HistoryStorage.HistoryStorage,
        RecoveryStorage.RecoveryStorage):
    keep_history = True

    # We keep the extension bytes exactly as ZODB wrote them.
    use_extension_bytes = True

    def setUp(self):
        super().setUp()
        # RecoveryStorage copies into a second, independent database.
        self._dst_factory = self.factory.sibling()
        self._dst_factory.fresh(self.keep_history)
        self._dst = self.new_dest()

    def tearDown(self):
        self._dst.close()
        super().tearDown()
        self._dst_factory.cleanup()

    def new_dest(self):
        # Reopens the same destination database (RecoveryStorage calls this
        # after closing self._dst).
        options = self.make_options()
        return RelStorage(self._dst_factory.make_adapter(options), options=options)

    def test_checkResolve_resolvable(self):
        self.checkResolve()


class ZODBTestsOnRelStorage(RelStorageTestCase, ZODB.tests.testZODB.ZODBTests):
    """ZODB's own database-level tests, run on our storage."""

    def setUp(self):
        # Skipped before anything is set up: a skip raised from setUp is
        # not followed by tearDown, and ZODB's set-up had moved into a
        # temporary directory that then stayed (the current directory of
        # every later test; one left in /tmp by each run of the suite).
        if not self.keep_history and self._testMethodName in HP_ONLY_ZODB_TESTS:
            self.skipTest(HP_ONLY_ZODB_TESTS[self._testMethodName])
        RelStorageTestCase.setUp(self)
        # ZODBTests.setUp (reached through the chain above) opened a
        # FileStorage and its DB, which ours replaces: close them.
        self._db.close()
        self._db = ZODB.DB(self._storage)

    def tearDown(self):
        self._db.close()
        RelStorageTestCase.tearDown(self)


def conformance_names(cls):
    """Names of the upstream conformance tests a class collects."""
    loader = unittest.TestLoader()
    names = []
    for name in loader.getTestCaseNames(cls):
        owner = next(k for k in cls.__mro__ if name in vars(k))
        if owner.__module__.startswith('ZODB.tests'):
            names.append(name)
    return names


class ConformanceCount(unittest.TestCase):
    """Fails when the conformance suite shrinks or grows unnoticed."""

    variant_class = None
    mode = None
    label = None

    def test_conformance_count(self):
        names = [n for n in conformance_names(self.variant_class)
                 if n not in KNOWN_EXCLUSIONS]
        self.assertEqual(
            len(names), EXPECTED_CONFORMANCE[self.mode],
            "%s %s collected %d conformance tests: %s"
            % (self.label, self.mode, len(names), sorted(names)))


def _variant(base, factory, mode_label):
    name = '%s_%s' % (base.__name__, factory.name.replace('-', '_'))
    cls = type(name, (base,), {'factory': factory, '__module__': base.__module__})
    return cls


def cannot_run(module, class_name, test_name, reason):
    """A suite of one test, ``module.class_name.test_name``, that fails with
    ``reason``: it stands in, loudly, for tests that cannot run here (a
    server or a driver missing)."""
    def test(self):
        self.fail(reason)
    cls = type(class_name, (unittest.TestCase,), {test_name: test, '__module__': module})
    return unittest.defaultTestLoader.loadTestsFromTestCase(cls)


def make_suite(factory, extra_cases=()):
    """The whole shared suite for one database factory."""
    suite = unittest.TestSuite()
    loader = unittest.TestLoader()
    for base, mode in ((HistoryFreeConformance, 'history-free'),
                       (HistoryPreservingConformance, 'history-preserving')):
        cls = _variant(base, factory, mode)
        collected = loader.loadTestsFromTestCase(cls)
        count = len([n for n in conformance_names(cls) if n not in KNOWN_EXCLUSIONS])
        sys.stderr.write('conformance: %s %s: %d ZODB tests collected (expected %d)\n'
                         % (factory.name, mode, count, EXPECTED_CONFORMANCE[mode]))
        suite.addTest(collected)
        counter = type('ConformanceCount_%s_%s' % (factory.name.replace('-', '_'),
                                                   mode.replace('-', '_')),
                       (ConformanceCount,),
                       {'variant_class': cls, 'mode': mode, 'label': factory.name})
        suite.addTest(loader.loadTestsFromTestCase(counter))
    for keep_history in (True, False):
        zodb_cls = type('ZODBTests_%s_%s' % (factory.name.replace('-', '_'),
                                             'hp' if keep_history else 'hf'),
                        (ZODBTestsOnRelStorage,),
                        {'factory': factory, 'keep_history': keep_history})
        suite.addTest(loader.loadTestsFromTestCase(zodb_cls))
    suite.addTest(PackableStorage.IExternalGC_suite(
        lambda name=None, blob_dir=None: _gc_storage(factory, blob_dir)))
    if hasattr(factory, 'named'):
        suite.addTest(blob_suites(factory))
    from . import blob_cases
    from . import core_cases
    from . import crash_cases
    from . import pack_cases
    from . import session_cases
    from . import zap_cases
    for case in (tuple(core_cases.CASES) + tuple(blob_cases.CASES) + tuple(crash_cases.CASES)
                 + tuple(zap_cases.CASES) + tuple(pack_cases.CASES)
                 + tuple(session_cases.CASES)
                 + tuple(extra_cases)):
        suite.addTest(loader.loadTestsFromTestCase(
            type(case.__name__ + '_' + factory.name.replace('-', '_'), (case,),
                 {'factory': factory})))
    return suite


# Tests collected from ZODB's reusable blob suite per variant: doctest files
# and test classes.  See blob_suites().
EXPECTED_BLOB_TESTS = {
    'history-preserving': 22,
    'history-free': 15,
}


def blob_suites(factory):
    """ZODB's reusable blob suite for each history mode x blob mode."""
    from ZODB.tests.testblob import storage_reusable_suite
    result = unittest.TestSuite()
    for keep_history in (True, False):
        mode = 'history-preserving' if keep_history else 'history-free'
        for shared in (False, True):
            def make(name, blob_dir, keep_history=keep_history, shared=shared):
                named = factory.named(name)
                named.fresh_if_new(keep_history)
                options = Options(keep_history=keep_history, blob_dir=blob_dir,
                                  shared_blob_dir=shared, commit_lock_timeout=10)
                return RelStorage(named.make_adapter(options), options=options)
            prefix = 'Blobs_%s_%s_%s' % (factory.name.replace('-', '_'),
                                          'hp' if keep_history else 'hf',
                                          'shared' if shared else 'cached')
            blob_suite = storage_reusable_suite(
                prefix, make,
                test_blob_storage_recovery=keep_history,
                test_packing=keep_history,
                test_undo=keep_history)
            drop_root_only_examples(blob_suite)
            count = blob_suite.countTestCases()
            sys.stderr.write('conformance: %s %s blobs %s: %d ZODB blob tests (expected %d)\n'
                             % (factory.name, mode, 'shared' if shared else 'cached',
                                count, EXPECTED_BLOB_TESTS[mode]))
            result.addTest(blob_suite)

            result.addTest(unittest.FunctionTestCase(
                lambda count=count, mode=mode, prefix=prefix: _assert_equal(
                    count, EXPECTED_BLOB_TESTS[mode], prefix),
                description='%s blob test count' % prefix))
    return result


# Doctest examples that cannot pass when the suite runs as root (CI does):
# they expect PermissionError from writing a read-only file, and root may.
ROOT_ONLY_EXAMPLES = (
    "open(blob.committed(), 'w')",
)


def drop_root_only_examples(test):
    if os.geteuid() != 0:
        return
    if isinstance(test, unittest.TestSuite):
        for sub in test:
            drop_root_only_examples(sub)
        return
    dt = getattr(test, '_dt_test', None)
    if dt is not None:
        dt.examples = [ex for ex in dt.examples
                       if not any(snippet in ex.source for snippet in ROOT_ONLY_EXAMPLES)]


def _assert_equal(actual, expected, label):
    if actual != expected:
        raise AssertionError('%s collected %d blob tests, expected %d'
                             % (label, actual, expected))


def _gc_storage(factory, blob_dir):
    factory.fresh(True)
    blob_dir = blob_dir or os.path.abspath('blobs')     # the doctest's own temp dir
    options = Options(keep_history=True, pack_gc=False, blob_dir=blob_dir,
                      shared_blob_dir=False)
    return RelStorage(factory.make_adapter(options), options=options)


def env(name, default):
    return os.environ.get(name, default)
