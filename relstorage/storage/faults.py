"""Named fault points for the crash-point tests.

A test starts a committing process with ``RS_FAULT_POINT=<name>`` (and
optionally ``RS_FAULT_AFTER=<n>``: let the point pass n times first); when
the commit path reaches that point the process ends at once with
``os._exit(RS_FAULT_EXIT_CODE)``, as a kill -9 would leave it: no rollback,
no finally blocks, no atexit.  Without the variable a fault point costs one
comparison.  The names are listed in commit.py.
"""
import os

EXIT_CODE = 86

_point = os.environ.get('RS_FAULT_POINT') or None
_after = int(os.environ.get('RS_FAULT_AFTER') or 0)


def arm(name, after=0):
    """Set the point from Python (a test's forked child) instead of the
    environment."""
    global _point, _after
    _point, _after = name, int(after)


def fault_point(name):
    global _after
    if _point is None or name != _point:
        return
    if _after > 0:
        _after -= 1
        return
    os._exit(EXIT_CODE)
