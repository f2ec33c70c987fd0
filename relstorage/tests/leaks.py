"""ResourceWarning as an error for our own objects.

An unclosed database session or file is a leak: in a server process it
holds a slot of the database's connection limit, a file descriptor, or a
temporary file, until the garbage collector happens to run.  Python
reports these from finalizers as ResourceWarning, which a test run prints
and forgets.  ``install`` (relstorage/tests/__init__.py calls it) catches
every ResourceWarning, whether shown as a warning (zope.testrunner shows
warnings with filters of its own, so the hook sits where warnings are
shown, ``warnings._showwarnmsg``) or raised as an error (``-W
error::ResourceWarning``: finalizers report errors through
``sys.unraisablehook``):

- ours (a driver connection, a socket to the database or cache servers,
  a file opened by relstorage or its tests) is recorded, and the check
  test each test module ends with (``checked``) fails, listing them;
  whatever is still recorded when a test run ends makes its exit status
  1, so that no leak goes unseen whatever ran last;
- others (ZODB's own tests leave their FileStorage files to the garbage
  collector) are printed as a warning and left alone.

With ``PYTHONTRACEMALLOC=25`` the report shows where each object was
allocated, and a file counts as ours only when relstorage code is on that
stack; without it, files count as ours unless they are FileStorage files.
psycopg 3's warning ("deleted while still open") does not name its object,
so it comes without that stack: to find where such a connection was made,
record ``traceback.format_stack()`` by ``id`` in a wrapper of
``psycopg._connection_base.BaseConnection.__init__`` and print it from one
of ``__del__`` (a ``sitecustomize`` on ``PYTHONPATH`` will do), and run
with ``-vv`` to see the test.
"""
import atexit
import contextlib
import gc
import os
import re
import sys
import tracemalloc
import unittest
import warnings

_OUR_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The ports of the servers the tests use (PostgreSQL, MariaDB, Redis, memcached).
_SERVER_PORTS = re.compile(r"raddr=\('[^']*', (5432|3306|6379|11211|1521)\)")
#: A driver's object as Python prints it (``<psycopg.Connection object ...``),
#: looked for outside file names: the tests' temporary directories carry
#: driver names (``ZODBTests_mysql_MySQLdb_...``), and a FileStorage file
#: in one of them is not a driver's object.
_DRIVER_OBJECTS = re.compile(r'<(psycopg|pymysql|MySQLdb|oracledb)\b|sqlite3\.Connection')
_FILE_NAMES = re.compile(r"name='[^']*'")
_FILESTORAGE_FILES = re.compile(r"name='[^']*\.fs(\.lock|\.tmp|\.index)?'")

_leaks = []
_previous_hook = sys.unraisablehook
_previous_show = warnings._showwarnmsg


def _allocated_by_us(obj):
    if obj is None or not tracemalloc.is_tracing():
        return None
    trace = tracemalloc.get_object_traceback(obj)
    if trace is None:
        return None
    return any(frame.filename.startswith(_OUR_CODE) for frame in trace)


def is_ours(message, obj=None):
    """Whether the ResourceWarning ``message`` (about ``obj``) is about
    an object of ours."""
    if _DRIVER_OBJECTS.search(_FILE_NAMES.sub('', message)) or _SERVER_PORTS.search(message):
        return True
    if message.startswith('unclosed file'):
        ours = _allocated_by_us(obj)
        if ours is not None:
            return ours
        return not _FILESTORAGE_FILES.search(message)
    return _allocated_by_us(obj) or False


def _describe(message, obj):
    lines = [message]
    if obj is not None and tracemalloc.is_tracing():
        trace = tracemalloc.get_object_traceback(obj)
        if trace is not None:
            lines.extend('    ' + line for line in trace.format())
    return '\n'.join(lines)


def _report(message, obj):
    """Record a leak of ours; return False for others."""
    if not is_ours(message, obj):
        return False
    _leaks.append(_describe(message, obj))
    return True


def _unraisable(unraisable):
    exc = unraisable.exc_value
    if not (isinstance(exc, ResourceWarning) and _report(str(exc), unraisable.object)):
        _previous_hook(unraisable)


def _show(msg):
    if not (issubclass(msg.category, ResourceWarning)
            and _report(str(msg.message), msg.source)):
        _previous_show(msg)


def install():
    # Every one, not the first per place (Python ignores them by default).
    warnings.filterwarnings('always', category=ResourceWarning)
    warnings._showwarnmsg = _show
    sys.unraisablehook = _unraisable


def collect():
    """Run the garbage collector; return and forget the leaks recorded."""
    gc.collect()
    found = list(_leaks)
    del _leaks[:]
    return found


@contextlib.contextmanager
def recorded():
    """``with recorded() as found:`` after the block, ``found`` lists the
    leaks recorded in it (after a collection).  They stay recorded: the
    module's check test fails on them too."""
    gc.collect()
    start = len(_leaks)
    found = []
    yield found
    gc.collect()
    found.extend(_leaks[start:])


class LeakCheck(unittest.TestCase):
    """Fails when the tests before it left objects of ours unclosed."""

    module = None

    def test_nothing_of_ours_left_unclosed(self):
        found = collect()
        if found:
            self.fail('%d unclosed object(s) of ours (ResourceWarning) in or before %s '
                      '(PYTHONTRACEMALLOC=25 shows where each was made):\n%s'
                      % (len(found), self.module, '\n'.join(found)))


def checked(suite, module):
    """``suite`` followed by the leak check for ``module`` (a name)."""
    check = type('LeakCheck_' + module.rsplit('.', 1)[-1], (LeakCheck,),
                 {'module': module, '__module__': module})
    result = unittest.TestSuite([suite])
    result.addTest(unittest.defaultTestLoader.loadTestsFromTestCase(check))
    return result


@atexit.register
def _at_exit():
    found = collect()
    if found:
        sys.stderr.write('\n%d unclosed object(s) of ours (ResourceWarning) not reported '
                         'by a leak check test:\n%s\n' % (len(found), '\n'.join(found)))
        sys.stderr.flush()
        if 'zope.testrunner' in sys.modules:
            # (Not for scripts that merely import a test helper, such as
            # bench/replicas.py.)
            os._exit(1)
