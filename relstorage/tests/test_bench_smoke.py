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
        with open(os.path.join(out_dir, 'benchmarks.md')) as f:
            self.assertIn('SQLite', f.read())


def test_suite():
    return unittest.defaultTestLoader.loadTestsFromName(__name__)
