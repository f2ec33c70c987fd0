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


def test_suite():
    return unittest.defaultTestLoader.loadTestsFromName(__name__)
