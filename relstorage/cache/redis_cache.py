"""Redis servers for the shared state cache (shared.py).

``cache-servers`` lists URLs ``redis://[[user]:password@]host[:port][/db]``
(``rediss://`` for TLS; query arguments such as ``ssl_ca_certs`` or
``ssl_cert_reqs`` go to the `redis` client).  Several URLs spread the keys
over several servers, as with memcached.  The password is taken from the
URL and never shown: servers are named in messages and statistics by
scheme, host, port and database only.

Uses the ``redis`` package from PyPI, which parses replies with
``hiredis`` when that is installed (``pip install relstorage[redis]``
installs both).  A batch of gets is one MGET; a batch of sets is one
pipeline of SETs (one write, then the replies).  Redis always replies and
the replies are always read, so ``wait`` changes nothing here.  Every key
expires after ``EXPIRE`` seconds, so that a Redis shared with other uses
and without an eviction policy does not keep what nobody asks for any more
(memcached evicts by itself).
"""
import os
from urllib.parse import urlsplit

from ..options import PASSWORD_NOT_ENCODED
from ..options import password_not_encoded
from ..options import redact_secrets
from .shared import CONNECT_TIMEOUT
from .shared import TIMEOUT
from .shared import Server

#: Seconds a key lives after it was last written.
EXPIRE = 24 * 3600


def parse_url(url):
    """The loggable name of a Redis URL (scheme://host:port/db, no
    credentials); ValueError naming what is wrong, without the password."""
    shown = redact_secrets(url)
    if password_not_encoded(url):
        raise ValueError('cache-servers: %s: %s' % (shown, PASSWORD_NOT_ENCODED))
    try:
        parts = urlsplit(url)
        port = parts.port or 6379
        host = parts.hostname
    except ValueError as exc:
        reason = str(exc)
    else:
        reason = None
    if reason is not None:
        # (Raised out of the except clause: urllib's error, which may quote
        # part of the password, is not kept as its __context__.  Nor is its
        # text shown where the password is not a URL's user:password@.)
        if '@' in url:
            reason = PASSWORD_NOT_ENCODED
        raise ValueError('cache-servers: %s is not a valid Redis URL (%s)'
                         % (shown, redact_secrets(reason)))
    if not host:
        raise ValueError('cache-servers: %s names no host' % (shown,))
    db = parts.path.strip('/') or '0'
    if not db.isdigit():
        raise ValueError('cache-servers: %s: the path must be a database number%s'
                         % (shown, ', not %r' % db if db.isalnum() else ''))
    if ':' in host:
        host = '[%s]' % host
    return '%s://%s:%d/%s' % (parts.scheme.lower(), host, port, db)


def redis_servers(urls):
    return [RedisServer(url) for url in urls]


class RedisServer(Server):
    """One Redis server.

    Commands go straight to connections of the ``redis`` package (which
    does the handshake: TLS, AUTH, SELECT, and the parsing, with hiredis
    when installed), kept in a free list: one per thread at a time, made
    when none is free.  Going through ``redis.Redis`` instead costs about
    twice as much per request (its pool, retry and event layers), which
    matters for the single gets of a fresh process.
    """

    kind = 'Redis'

    def __init__(self, url):
        Server.__init__(self, parse_url(url))
        try:
            import redis
        except ImportError:
            raise ValueError('cache-servers names Redis, but the redis package is not '
                             'installed (pip install relstorage[redis])') from None
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError, EOFError)
        self._stale = redis.ConnectionError
        self._reply_error = redis.ResponseError
        try:
            # Only parses the URL and makes connections; never holds one.
            self._factory = redis.ConnectionPool.from_url(
                url, socket_timeout=TIMEOUT, socket_connect_timeout=CONNECT_TIMEOUT,
                retry=Retry(NoBackoff(), 0))
            # The first connection (not connected yet) checks the URL's
            # query arguments now rather than at every request.
            self._idle = [self._factory.make_connection()]
        except (ValueError, TypeError) as exc:
            message = 'cache-servers: %s: %s' % (redact_secrets(url), redact_secrets(str(exc)))
        else:
            message = None
        if message is not None:
            # (Out of the except clause: see parse_url.)
            raise ValueError(message)
        self._pid = os.getpid()

    def is_connection_error(self, exc):
        return isinstance(exc, self._errors)

    def _exchange(self, conn, commands):
        """The replies to ``commands``, sent in one write (a pipeline)."""
        try:
            conn.connect()          # (returns at once when connected)
        except self._reply_error as exc:
            # A helper agent's check: a database number the server does
            # not have ("DB index is out of range", the reply to the
            # handshake's SELECT) failed every request, logged at DEBUG
            # only.  A refused handshake is a server we cannot use: warned
            # about, and asked again only after a while.
            conn.disconnect()
            raise self._stale('the server refused the connection: %s' % exc) from None
        conn.send_packed_command(conn.pack_commands(commands))
        replies = []
        error = None
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except self._reply_error as exc:
                # An error reply: the others must still be read.
                error = error or exc
                replies.append(None)
        if error is not None:
            raise error
        return replies

    def _run(self, commands):
        if self._pid != os.getpid():
            # Forked: the parent's sockets are not ours to use.
            self._idle = []
            self._pid = os.getpid()
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = self._factory.make_connection()
        try:
            try:
                return self._exchange(conn, commands)
            except self._stale:
                # A connection the server closed (restart, idle timeout)
                # fails once; a fresh one tells whether the server is down.
                conn.disconnect()
                return self._exchange(conn, commands)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._idle.append(conn)

    def get_many(self, keys):
        if len(keys) == 1:
            return {keys[0]: self._run([('GET', keys[0])])[0]}
        return dict(zip(keys, self._run([('MGET',) + tuple(keys)])[0]))

    def set_many(self, values, wait):
        self._run([('SET', key, value, 'EX', EXPIRE) for key, value in values.items()])

    def close(self):
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()
