"""What the vendor driver modules share: reading a configured driver name."""
import logging
import sys

from ..interfaces import RelStorageError

log = logging.getLogger(__name__)


class DriverUnusable(ImportError):
    """A driver that imports but cannot serve this process (see
    Psycopg2Driver: a wait callback installed).  An ImportError, so that
    'auto' goes on to the next driver."""


def gevent_patched():
    """Whether gevent has patched this process's sockets (monkey.patch_all):
    a driver that waits for the server inside its C library (psycopg2,
    mysqlclient) then stops every greenlet of the process while it waits,
    a commit waiting for the commit lock included, so that a greenlet
    holding that lock in the same process never gets to release it (a
    helper agent's check: the waiting commit failed after
    commit-lock-timeout).  gevent is not imported to find out."""
    monkey = sys.modules.get('gevent.monkey')
    if monkey is None:
        return False
    try:
        return bool(monkey.is_module_patched('socket'))
    except Exception:  # pylint:disable=broad-except
        return False


def canonical_name(names, name, database):
    """The canonical spelling of driver ``name`` among ``names`` (canonical
    name -> other accepted spellings; case is ignored)."""
    name = (name or 'auto').strip()
    for canonical, aliases in names.items():
        if name.lower() in [n.lower() for n in (canonical,) + aliases]:
            return canonical
    raise RelStorageError(
        "Unknown %s driver %r; choose one of: %s" % (database, name, ', '.join(names)))


def warn_if_blocking(driver, database, instead):
    """A warning when ``driver`` waits for the server without letting
    gevent run other greenlets (its class says ``blocks_gevent``) in a
    process gevent has patched; ``instead`` names the driver that would."""
    # (Kept for the storage's first use after gevent patched the process,
    # if that happens after the open: Adapter.renew_locks says it again.)
    driver.gevent_label = (database, instead)
    # (gevent first: a driver may have to look before it can say.)
    if gevent_patched() and getattr(driver, 'blocks_gevent', False):
        advice = getattr(driver, 'gevent_advice', None) or 'install and use driver ' + instead
        log.warning(
            "gevent has patched this process, but the %s driver %s waits for the "
            "server without letting other greenlets run: a commit waiting for the "
            "commit lock stops the whole process, and fails if a greenlet of it holds "
            "that lock; %s." % (database, driver.name, advice))
    return driver


def first_importable(classes, label='package'):
    """(an instance of the first of ``classes`` whose module imports, the
    failures before it); (None, failures) when none does.  A failure reads
    ``<cls.label> (<ImportError>)``, for the caller's message."""
    problems = []
    for cls in classes:
        try:
            return cls(), problems
        except ImportError as exc:
            problems.append('%s (%s)' % (getattr(cls, label), exc))
    return None, problems
