"""The upkeep of main.sqlite3's write-ahead log, off the application's
threads.

Emptying a log grown past its bound starts with a checkpoint: it copies
the log's pages into the database file and syncs it.  Run by the thread
whose snapshot had just ended, as it was, that sync was a commit's to
wait for: 15-17 ms on a disk another process keeps busy, where the commit
itself takes 2 (measured: a writer committing every 20 ms beside a pack of
a million objects, whose p99 went from 2.7 to 20 ms, nearly all of it
there).  So the copy runs here, in a thread of its own with a connection
of its own, which snapshot_ended (adapter.py) wakes.
"""

import logging
import threading

log = logging.getLogger(__name__)


class WalKeeper:
    """A daemon thread that, each time it is woken, copies the log into
    the database file (PASSIVE: it takes no lock a reader or writer
    waits for), then, if it copied everything, empties the log if nobody
    reads it (TRUNCATE, waiting for nobody).

    A snapshot that starts once every page is copied reads the database
    file alone, and the next write transaction then starts the log again
    from its beginning (SQLite does that itself): so a writer that pauses
    between its commits keeps a bounded log this way.  One that commits
    without pause always has a snapshot reading the log; snapshot_ended
    empties it then.

    ``connect`` opens a connection to the database (called in the
    thread); ``describe`` names the database in log messages.  Both may
    raise ReferenceError once the adapter is gone: the thread then ends
    (it holds no reference to the adapter, so that an adapter dropped
    unclosed is still collected, and its files closed).
    """

    def __init__(self, connect, describe):
        self._connect = connect
        self._describe = describe
        self._wake = threading.Event()
        self._closed = False
        #: Whether a checkpoint runs now (snapshot_ended's own try would
        #: only meet it: SQLite runs one at a time).
        self.working = False
        self._thread = threading.Thread(target=self._run, name='relstorage-sqlite-wal',
                                        daemon=True)
        self._thread.start()

    def alive(self):
        """False once stopped.  (A child process forked after the thread
        started has no such thread: the adapter forgets its keeper then,
        Sqlite3Adapter.after_fork_in_child.)"""
        return not self._closed

    def wake(self):
        self._wake.set()

    def stop(self):
        """End the thread once its current checkpoint is done."""
        self._closed = True
        self._wake.set()

    def close(self):
        self.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(10)

    def _run(self):
        conn = None
        failing = False
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._closed:
                    return
                self.working = True
                try:
                    if conn is None:
                        conn = self._connect()
                        conn.execute('PRAGMA busy_timeout = 0')
                    self._checkpoint(conn)
                    failing = False
                except ReferenceError:
                    return
                except Exception:  # pylint:disable=broad-except
                    # The next wake-up tries again, with a new connection;
                    # meanwhile the log grows.  Said once per run of
                    # failures (a disk error, a permission), not at every
                    # wake-up.
                    try:
                        log.log(logging.DEBUG if failing else logging.WARNING,
                                "Could not copy the write-ahead log of %s into its "
                                "database file", self._describe(), exc_info=True)
                    except ReferenceError:
                        return
                    failing = True
                    if conn is not None:
                        _close_quietly(conn)
                        conn = None
                finally:
                    self.working = False
        finally:
            if conn is not None:
                _close_quietly(conn)

    def _checkpoint(self, conn):
        busy, frames, copied = conn.execute('PRAGMA wal_checkpoint(PASSIVE)').fetchone()
        if busy or frames != copied:
            # Another checkpoint runs, or a snapshot still reads pages
            # not copied: the next wake-up goes on.
            return
        # Nothing left to copy (unless a commit came in between: then it
        # copies that commit's pages), so it holds the write lock only to
        # empty the file, and gives up at once when someone reads the log.
        busy, _, _ = conn.execute('PRAGMA wal_checkpoint(TRUNCATE)').fetchone()
        log.debug("%s the write-ahead log of %s",
                  'Could not empty (busy)' if busy else 'Emptied', self._describe())


def _close_quietly(conn):
    try:
        conn.close()
    except Exception:  # pylint:disable=broad-except
        pass
