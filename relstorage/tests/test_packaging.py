"""The source distribution builds a working wheel (a helper agent's check:
the sdist lacked CHANGES.txt, which setup.py reads, so no wheel could be
built from it)."""
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest
import zipfile

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@unittest.skipUnless(os.path.exists(os.path.join(HERE, 'setup.py')),
                     'not run from a source tree')
class SdistTests(unittest.TestCase):

    def test_sdist_holds_what_a_build_needs(self):
        tmp = tempfile.mkdtemp(prefix='relstoragetest_sdist_')
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        tree = os.path.join(tmp, 'tree')
        # A copy, so that the build leaves nothing in the checkout.
        shutil.copytree(HERE, tree, ignore=shutil.ignore_patterns(
            '.venv*', '.git', '__pycache__', '*.egg-info', 'build', 'dist'))
        subprocess.run([sys.executable, 'setup.py', '-q', 'sdist', '-d', os.path.join(tmp, 'dist')],
                       cwd=tree, check=True, capture_output=True)
        (sdist,) = glob.glob(os.path.join(tmp, 'dist', '*.tar.gz'))
        with tarfile.open(sdist) as tar:
            names = {name.split('/', 1)[1] for name in tar.getnames() if '/' in name}
        for needed in ('setup.py', 'README.txt', 'CHANGES.txt', 'MANIFEST.in',
                       'relstorage/component.xml', 'docs/configuration.rst', 'docs/pack.rst'):
            self.assertIn(needed, names)
        result = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps',
                                 '--no-build-isolation', '-w', os.path.join(tmp, 'wheel'),
                                 sdist], capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        (wheel,) = glob.glob(os.path.join(tmp, 'wheel', '*.whl'))
        with zipfile.ZipFile(wheel) as zf:
            self.assertIn('relstorage/component.xml', zf.namelist())


@unittest.skipUnless(os.path.exists(os.path.join(HERE, 'Makefile')),
                     'not run from a source tree')
class TestCommandTests(unittest.TestCase):

    def test_a_build_directory_in_the_checkout_is_not_collected(self):
        # A helper agent's check: after "pip install ." in the checkout,
        # setuptools leaves build/lib/relstorage, and the suite's runner
        # reported "ModuleNotFoundError: No module named 'build'" for every
        # test module there.  The Makefile's runner arguments, on a tree
        # of one package and its copy under build/lib:
        with open(os.path.join(HERE, 'Makefile')) as f:
            (line,) = [line for line in f if line.startswith('TESTRUNNER_ARGS =')]
        args = line.split('=', 1)[1].split()
        tmp = tempfile.mkdtemp(prefix='relstoragetest_build_')
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        for top in (tmp, os.path.join(tmp, 'build', 'lib')):
            tests = os.path.join(top, 'rstestpkg', 'tests')
            os.makedirs(tests)
            for path, text in ((os.path.join(top, 'rstestpkg', '__init__.py'), ''),
                               (os.path.join(tests, '__init__.py'), ''),
                               (os.path.join(tests, 'test_one.py'),
                                'import unittest\n'
                                'class T(unittest.TestCase):\n'
                                '    def test_it(self):\n'
                                '        pass\n')):
                with open(path, 'w') as f:
                    f.write(text)
        runner = os.path.join(os.path.dirname(sys.executable), 'zope-testrunner')
        # (--test-path does not put the tree on sys.path; relstorage is
        # installed in the venv, this package is not.)
        result = subprocess.run([runner] + args + ['--list-tests'], cwd=tmp,
                                capture_output=True, text=True,
                                env=dict(os.environ, PYTHONPATH=tmp))
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertNotIn('import', (result.stdout + result.stderr).lower())
        self.assertEqual(result.stdout.count('test_it ('), 1, result.stdout)


def test_suite():
    return unittest.defaultTestLoader.loadTestsFromName(__name__)
