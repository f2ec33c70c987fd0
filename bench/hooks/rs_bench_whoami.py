"""Which RelStorage did this process run?  (Installed by ``make bench``
into the site-packages of both benchmarked virtualenvs, with
``rs_bench_whoami.pth``; part of the harness, not of either side.)

With ``RS_BENCH_WHOAMI=PATH`` in the environment (zodbshootout forwards
``RS*`` variables to its pyperf workers), every Python process appends one
JSON line to PATH when it exits: its pid, command line, interpreter and, if
it imported ``relstorage``, that package's file and the version of the
``relstorage`` distribution installed beside it.  The harness checks these
lines to prove which implementation each side really ran.  Without the
variable nothing happens.
"""
import os

_PATH = os.environ.get('RS_BENCH_WHOAMI')


def _report():
    import json
    import sys
    record = {'pid': os.getpid(), 'argv': sys.argv[:4],
              'executable': sys.executable, 'cwd': os.getcwd()}
    module = sys.modules.get('relstorage')
    if module is not None:
        record['relstorage_file'] = getattr(module, '__file__', None)
        try:
            from importlib.metadata import distribution
            dist = distribution('relstorage')
            record['relstorage_version'] = dist.version
            record['relstorage_dist'] = str(dist.locate_file(''))
        except Exception as exc:  # pylint:disable=broad-except
            record['relstorage_version'] = 'unknown (%s)' % (exc,)
    try:
        with open(_PATH, 'a') as f:
            f.write(json.dumps(record) + '\n')
    except OSError:
        pass


if _PATH:
    import atexit
    atexit.register(_report)
