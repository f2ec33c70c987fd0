"""Directories named by options (blob-dir, cache-local-dir): made on first
use, with errors that say which key and what is wrong."""
import os

from .interfaces import RelStorageError


def file_in_the_way(path):
    """The regular file at ``path`` or above it that keeps ``path`` from
    being a directory, or None."""
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None if os.path.isdir(path) else path


def not_a_directory(path):
    """'X is a file, not a directory' when a file is in the way, else None."""
    blocker = file_in_the_way(path)
    return None if blocker is None else '%s is a file, not a directory' % blocker


def ensure_directory(key, path):
    """Create ``path`` (and missing parents); the absolute path.

    Raises RelStorageError naming ``key`` when that cannot be done."""
    path = os.path.abspath(os.path.expanduser(path))
    problem = error_number = None
    if '\0' in path:
        problem = 'is not a usable path: it holds a NUL byte'
    if problem is None:
        problem = not_a_directory(path)
    if problem is None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            problem = 'cannot be created: %s' % (exc.strerror or exc)
            error_number = exc.errno
            if os.path.islink(path) and not os.path.exists(path):
                # (A helper agent's check: "File exists", of a path that
                # does not.)
                problem = ('is a symbolic link to %s, which does not exist'
                           % os.readlink(path))
    if problem is not None:
        error = RelStorageError('%s %s: %s' % (key, path.replace('\0', '\\0'), problem))
        #: The OS's reason (an errno value), when creating it failed.
        error.errno = error_number
        raise error
    return path
