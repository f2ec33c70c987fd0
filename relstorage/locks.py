"""Locks made again once gevent has patched the process.

A storage opened before ``gevent.monkey.patch_all()`` holds locks of the
operating system: gunicorn's ``--preload`` opens it in the master, and each
gevent worker patches the process after it forks.  In such a worker a
greenlet waiting for one of those locks stops every greenlet of the
process, the one holding it included when it waits for the server through
a driver that lets others run meanwhile (psycopg2 with psycogreen's wait
callback, PyMySQL, psycopg): the process hangs for good (a helper agent's
check: a worker hung in ``new_oid`` as soon as two requests created objects
at once).  An operating-system RLock, for its part, lets every greenlet of
the thread in at once.

So each part that shares locks between the greenlets or threads using a
storage remembers what made them (``threading.Lock`` as it was then, which
gevent's patching replaces), and makes them again (``renew_locks``) when
the storage sees, on its way in and before it takes any of them, that the
process makes locks otherwise now.  At that moment nobody holds them: the
process has just been patched, and nothing used the storage since.
"""
import os
import threading
import weakref

#: Every part that made locks (made_now), for the fork hook below.
_OWNERS = weakref.WeakSet()


def made_now(owner=None):
    """What the parts remember: what makes a lock in this process now.
    ``owner``, the part asking, is remembered for a fork."""
    if owner is not None:
        _OWNERS.add(owner)
    return threading.Lock


def stale(owner):
    """Whether ``owner``'s locks were made before gevent patched the
    process (its ``_locks_made_with`` is not what makes them now); if so,
    it is taken to make them again: the next call says False."""
    if owner._locks_made_with is threading.Lock:
        return False
    owner._locks_made_with = threading.Lock
    return True


def _after_fork_in_child():
    """In a child process just forked: any of the locks may have been held
    by another thread of the parent, which does not exist here and would
    never let go (a helper agent's check: a child hung in ``db.open()`` on
    the server chooser's lock, or on the root storage's, taken by a thread
    of the parent for a query as it forked).  Every part makes its locks
    again on its next way in, as once gevent patched the process."""
    for owner in list(_OWNERS):
        owner._locks_made_with = None


os.register_at_fork(after_in_child=_after_fork_in_child)
