"""Smoke test of the benchmark harness (bench/, ``make bench-smoke``).

Runs ``python -m bench --smoke`` (SQLite only, 100 objects, one process
per benchmark) into a temporary directory and checks only that it ran and
wrote its report. It never looks at a timing: benchmarks are not tests.

Skipped when the harness's own dependencies are not installed (``make
bench-deps``) or when this package is not used from a checkout that has
``bench/`` beside it.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, 'bench')


def _missing_bench_deps():
    if not os.path.exists(os.path.join(BENCH, '__main__.py')):
        return 'no bench/ directory beside this relstorage package'
    for name in ('zodbshootout', 'pyperf', 'six', 'matplotlib'):
        try:
            __import__(name)
        except ImportError:
            return '%s not installed; run "make bench-deps"' % name
    return None


# "make test" installs the bench dependencies, so in CI a missing one is a
# failure, never a skip; elsewhere (a bare "zope-testrunner") it skips.
@unittest.skipIf(_missing_bench_deps() and not os.environ.get('CI'), _missing_bench_deps())
class TestBenchSmoke(unittest.TestCase):

    def setUp(self):
        missing = _missing_bench_deps()
        if missing:
            self.fail('bench smoke cannot run: %s' % missing)
        self.scratch = tempfile.mkdtemp(prefix='relstoragebench_smoke_')

    def tearDown(self):
        shutil.rmtree(self.scratch, ignore_errors=True)

    def test_smoke_run_writes_report(self):
        out_dir = os.path.join(self.scratch, 'report')
        proc = subprocess.run(
            [sys.executable, '-m', 'bench', '--smoke',
             '--scratch', self.scratch, '--output-dir', out_dir],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
        self.assertEqual(proc.returncode, 0,
                         proc.stdout[-3000:] + proc.stderr[-3000:])
        for name in ('benchmarks.md', 'benchmarks.png', 'benchmarks.json'):
            path = os.path.join(out_dir, name)
            self.assertTrue(os.path.exists(path), name)
            self.assertGreater(os.path.getsize(path), 0, name)
        with open(os.path.join(out_dir, 'benchmarks.json')) as f:
            results = json.load(f)
        sqlite = results['targets']['sqlite']
        self.assertEqual(sqlite['status'], 'ok', sqlite.get('reason'))
        # It ran: each zodbshootout phase produced values or a stated
        # reason, and the bare-driver baseline produced values.
        phases = sqlite['shootout']['1']
        self.assertTrue(phases)
        for phase, result in phases.items():
            self.assertTrue(result.get('values') or result.get('error'),
                            phase)
        self.assertTrue(sqlite['baseline']['add']['values'])
        # Round trips of one commit were counted on the client.
        counts = results['roundtrips']['sqlite']
        self.assertGreater(counts['add']['total'], 0, counts)
        self.assertGreater(counts['empty']['total'], 0, counts)
        with open(os.path.join(out_dir, 'benchmarks.md')) as f:
            text = f.read()
        self.assertIn('SQLite', text)
        self.assertIn('## Round trips per commit', text)
        # No figures of another day: without --peer-python, no comparison.
        self.assertIn('## Side by side with RelStorage 4.3\n\nNot in the run', text)

    def test_side_by_side_refuses_a_run_of_the_wrong_implementation(self):
        # The guard of the side-by-side comparison (bench/peer.py): every
        # benchmark process reports which relstorage it imported, and a
        # run whose processes did not run the expected side is not
        # counted.  Here the "peer" is our own interpreter, so its workers
        # import this checkout instead of RelStorage 4.3.
        import argparse
        import importlib.util
        sys.path.insert(0, ROOT)
        try:
            from bench import peer
            from bench.targets import TARGETS
        finally:
            sys.path.remove(ROOT)
        impostor = peer.Side('peer', 'RelStorage 4.3', sys.executable,
                             os.path.join(self.scratch, 'no-such-venv'), '4.3.')
        args = argparse.Namespace(scratch=self.scratch, objects=10, object_size=16,
                                  peer_processes=1, peer_values=1, warmups=0,
                                  peer_concurrency=1)
        os.makedirs(os.path.join(self.scratch, 'peer'))
        result = peer.run_one(impostor, TARGETS['sqlite'], 'tpc', 'impostor', args,
                              peer.neutral_dir(self.scratch))
        self.assertEqual(result['provenance'], 'failed', result)
        self.assertEqual(result['status'], 'failed', result)
        if importlib.util.find_spec('rs_bench_whoami') is not None:
            self.assertIn('imported relstorage from %s' % ROOT,
                          result['provenance_error'])
        ours = peer.Side('ours', 'this checkout', sys.executable,
                         os.path.join(ROOT, 'relstorage'), '')
        self.assertIsNone(ours.check_record(
            {'relstorage_file': os.path.join(ROOT, 'relstorage', '__init__.py'),
             'relstorage_version': '5'}))


class TestBenchMeta(unittest.TestCase):

    def test_a_comparison_only_run_keeps_the_earlier_runs_meta(self):
        # Regression: --peer-only kept the earlier run's figures but wrote
        # its own end load over theirs (8.2 became 0.95, and the report
        # dropped its "other work was running" warning).
        sys.path.insert(0, ROOT)
        try:
            from bench.__main__ import finish_meta
        finally:
            sys.path.remove(ROOT)
        earlier = {'load_end': 8.21, 'seconds': 821}
        finish_meta(earlier, 0, peer_only=True)
        self.assertEqual(earlier, {'load_end': 8.21, 'seconds': 821})
        fresh = {}
        finish_meta(fresh, 0, peer_only=False)
        self.assertEqual(sorted(fresh), ['load_end', 'seconds'])

    def test_peer_concurrency(self):
        # --peer-concurrency: zodbshootout's --concurrency for both sides;
        # the report says how many processes ran each phase.
        import contextlib
        import io
        sys.path.insert(0, ROOT)
        try:
            from bench.__main__ import parse_args
            from bench.report import _concurrency_text
        finally:
            sys.path.remove(ROOT)
        self.assertEqual(parse_args(['--targets', 'sqlite']).peer_concurrency, 1)
        self.assertEqual(parse_args(['--peer-concurrency', '2']).peer_concurrency, 2)
        with contextlib.redirect_stderr(io.StringIO()) as err, \
                self.assertRaises(SystemExit):
            parse_args(['--peer-concurrency', '0'])
        self.assertIn('--peer-concurrency must be at least 1', err.getvalue())
        self.assertEqual(_concurrency_text(1), 'one process (concurrency 1)')
        self.assertIn("zodbshootout's default", _concurrency_text(2))
        self.assertNotIn("default", _concurrency_text(3))


def _test_suite():
    return unittest.defaultTestLoader.loadTestsFromName(__name__)


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
