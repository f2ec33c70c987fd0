"""Check that the bench environment is sane (run by ``make bench-deps``).

The one thing that must never happen is that installing zodbshootout (whose
extras name the PyPI distribution called ``relstorage``) replaces this
checkout with a downloaded RelStorage. This exits non-zero if the imported
``relstorage`` package is not the one in this working tree, or if a bench
dependency is missing.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def problems():
    found = []
    try:
        import relstorage
    except ImportError as e:
        return ['relstorage is not importable: %s' % e]
    location = os.path.dirname(os.path.dirname(os.path.abspath(
        relstorage.__file__)))
    if os.path.realpath(location) != os.path.realpath(ROOT):
        found.append('relstorage is imported from %s, not from this '
                     'checkout (%s); reinstall with "pip install -e ."'
                     % (location, ROOT))
    for name in ('zodbshootout', 'pyperf', 'six', 'ZEO', 'matplotlib',
                 'rs_bench_whoami'):
        try:
            __import__(name)
        except ImportError as e:
            found.append('%s is missing (%s); run "make bench-deps"'
                         % (name, e))
    try:
        import pyperf
        if pyperf.__version__ != '2.3.1':
            found.append('pyperf %s is installed; zodbshootout needs 2.3.1'
                         % pyperf.__version__)
    except ImportError:
        pass
    return found


def main():
    found = problems()
    for problem in found:
        print('bench environment: ' + problem, file=sys.stderr)
    if not found:
        print('bench environment: ok (relstorage from %s)' % ROOT)
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
