"""Pools of idle database sessions, shared by the storage instances of one
adapter (one per root storage, so one per process and database).

Why: ZODB.DB keeps up to pool-size connections, each with a storage
instance, most of them idle at any moment; if every instance kept a load
and a store session, a process would hold two database sessions per ZODB
connection, and a site with a few worker processes runs into the
server's connection limit (PostgreSQL's ``max_connections``) with most of
those sessions doing nothing.

Two pools, one per purpose (see storage.py for who takes and gives back):

- *store* sessions are taken when a commit first needs the database (vote)
  and given back after ``tpc_finish`` / ``tpc_abort``.  The pool is
  *bounded*: at most ``size`` store sessions exist at once.  When all are
  in use, ``take`` waits for one to come back, up to ``timeout`` seconds
  (commit-lock-timeout: the commit waits for the other committers either
  way, since they hold the commit lock in turn), then raises
  ``SessionPoolExhaustedError`` (a ConflictError: the transaction is
  retried) naming the option.  A bound the operator chose is a promise to
  the database server; opening sessions past it would only move the
  failure to ``max_connections``, where it hits every process at once.
- *load* sessions are taken when an instance begins a snapshot and given
  back at ``afterCompletion`` (end of transaction, ZODB connection closed).
  MVCC needs one per ZODB connection while its transaction runs, so
  ``take`` never waits (an extra one is opened); idle ones beyond
  ``size`` are closed when given back.

Idle sessions are handed out last in, first out, so under a steady load
the same few are reused and the others stay idle; one idle for
``IDLE_CLOSE_AFTER`` seconds is closed the next time one is given back.  The
pool thus follows the concurrency the process had lately, not its peak
(a process that stops using the database altogether keeps what it had
until the next use or ``close``).

A store session that sat idle for ``check_after`` seconds or more is checked
(``check``, one round trip) before it is handed out; a dead one (server
restarted, session killed) is closed and replaced, so that a commit does
not start on it.  Recently used sessions are not checked: the commit steps
retry on a new session when the first statement finds the link gone
(``RelStorage._vote``), so the check only saves that retry.  Load sessions
are never checked: a snapshot that finds its session dead begins again on
a new one (``RelStorage._ensure_snapshot``), before anything was read.  A
session found dead either way makes the pool close its idle sessions
(``drop_idle``): a server restart ends them all.
"""
import collections
import threading
import time

from .. import locks
from ..interfaces import SessionPoolExhaustedError

#: Sessions idle for less than this (seconds) are handed out unchecked.
CHECK_AFTER = 1.0
#: Idle sessions unused for this long (seconds) are closed.
IDLE_CLOSE_AFTER = 60.0


class SessionPool:
    """Idle ``DBConnection`` objects of one purpose."""

    def __init__(self, open_session, check, size, purpose, timeout=None,
                 describe=None, check_after=CHECK_AFTER):
        #: ``open_session()``: a new DBConnection; ``check(conn)``: alive?
        #: (None: never checked)
        self._open = open_session
        self._check = check
        self.size = size
        self.purpose = purpose
        #: None: unbounded (never waits); else the most seconds to wait.
        self.timeout = timeout
        self._describe = describe
        self.check_after = check_after
        # (A plain lock: a ZODB connection gives its load session back and
        # takes one again at every transaction boundary.)
        self._cond = threading.Condition(threading.Lock())
        self._locks_made_with = locks.made_now(self)
        self._idle = collections.deque()       # (conn, given back at), newest last
        self._out = 0                           # handed out, not given back
        self._closed = False
        #: Counters for tests and benchmarks.
        self.opened = self.replaced = 0

    @property
    def bounded(self):
        return self.timeout is not None

    def take(self):
        """An idle session, else a new one (waiting for one to be given
        back first when the pool is bounded and full)."""
        with self._cond:
            now = time.monotonic()
            deadline = None
            while True:
                if self._idle:
                    conn, since = self._idle.pop()     # the most recently used
                    break
                if not self.bounded or self._out < self.size:
                    conn = since = None
                    break
                if deadline is None:
                    deadline = time.monotonic() + self.timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SessionPoolExhaustedError(
                        "All %d %s sessions to %s were in use for %ss "
                        "(commit-lock-timeout); raise session-pool-size if this "
                        "process commits from more threads at once"
                        % (self.size, self.purpose, self._where(), self.timeout))
                self._cond.wait(left)
            self._out += 1
        try:
            if (conn is not None and self._check is not None
                    and now - since >= self.check_after):
                if not self._check(conn):
                    conn.close()
                    conn = None
                    self.replaced += 1
            if conn is None:
                conn = self._open()
                self.opened += 1
        except BaseException:
            self._returned()
            raise
        return conn

    def give_back(self, conn):
        """Return ``conn`` (taken from this pool); a broken one, or one
        beyond what the pool keeps, is closed."""
        try:
            if conn.in_transaction:
                conn.rollback()
        except BaseException:
            # Interrupted (gevent.Timeout in the ROLLBACK, Ctrl-C): closed,
            # and still counted back below (a helper agent's check: each
            # such session stayed counted as in use, and after seven the
            # process could not commit any more).
            conn.broken = True
            raise
        finally:
            self._settle(conn)

    def _settle(self, conn):
        """(give_back) Keep ``conn`` or close it, and count it back."""
        with self._cond:
            now = time.monotonic()
            expired = self._expired(now)
            keep = (not conn.broken and not self._closed
                    and len(self._idle) < self.size)
            if keep:
                self._idle.append((conn, now))
            # (Not below 0: a session handed out before a fork, given
            # back in the child, which counts from 0: after_fork_in_child.)
            self._out = max(0, self._out - 1)
            if self.bounded:
                self._cond.notify()
        for old in expired:
            old.close()
        if not keep:
            conn.close()

    def _expired(self, now):
        """(Lock held) Remove and return the sessions idle too long: the
        oldest are at the left."""
        idle = self._idle
        if not idle or idle[0][1] >= now - IDLE_CLOSE_AFTER:
            return ()
        expired = []
        while idle and idle[0][1] < now - IDLE_CLOSE_AFTER:
            expired.append(idle.popleft()[0])
        return expired

    def detach(self):
        """A session taken from this pool stays with its user without
        counting against the bound (it is closed, or attached again, by
        that user)."""
        self._returned()

    def attach(self):
        """A detached session is in use again: it counts (it may exceed
        the bound for a moment rather than wait, since it holds locks)."""
        with self._cond:
            self._out += 1

    def _returned(self):
        with self._cond:
            self._out = max(0, self._out - 1)
            self._cond.notify()

    def renew_locks(self):
        """(relstorage/locks.py)"""
        if locks.stale(self):
            self._cond = threading.Condition(threading.Lock())

    def after_fork_in_child(self):
        """(In a child process just forked, its connections already set
        aside: connections.py.)  The parent's sessions are not the
        child's: none is idle here, none out (those the parent's other
        threads had would never come back, and the bound would shrink by
        them), and the lock is new (another thread of the parent may have
        held it: a review finding)."""
        self._cond = threading.Condition(threading.Lock())
        idle = [conn for conn, _ in self._idle]
        self._idle.clear()
        self._out = 0
        for conn in idle:
            conn.close()

    def drop_idle(self):
        """Close the idle sessions: one found dead (the server restarted,
        or ended the sessions) says those idle beside it most likely are
        too, and each would fail the first statement of a transaction in
        turn (a helper agent's check: after a restart of PostgreSQL, with
        20 idle load sessions, three transactions in a row failed where
        one retry was meant to be enough)."""
        with self._cond:
            idle = [conn for conn, _ in self._idle]
            self._idle.clear()
        for conn in idle:
            conn.close()

    def idle_count(self):
        with self._cond:
            return len(self._idle)

    def out_count(self):
        with self._cond:
            return self._out

    def close(self):
        """Close the idle sessions; sessions given back later are closed."""
        with self._cond:
            self._closed = True
        self.drop_idle()

    def _where(self):
        return self._describe() if self._describe is not None else 'the database'
