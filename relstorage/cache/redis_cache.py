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
pipeline of SETs, whose replies are always read (Redis cannot leave them
unread), so ``wait`` changes nothing here.  Every key expires after
``EXPIRE`` seconds, so that a Redis shared with other uses and without an
eviction policy does not keep what nobody asks for any more (memcached
evicts by itself).
"""
from urllib.parse import urlsplit

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
    try:
        parts = urlsplit(url)
        port = parts.port or 6379
        host = parts.hostname
    except ValueError as exc:
        raise ValueError('cache-servers: %s is not a valid Redis URL (%s)'
                         % (shown, redact_secrets(str(exc)))) from None
    if not host:
        raise ValueError('cache-servers: %s names no host' % (shown,))
    db = parts.path.strip('/') or '0'
    if not db.isdigit():
        raise ValueError('cache-servers: %s: the path must be a database number, not %r'
                         % (shown, db))
    if ':' in host:
        host = '[%s]' % host
    return '%s://%s:%d/%s' % (parts.scheme.lower(), host, port, db)


def redis_servers(urls):
    return [RedisServer(url) for url in urls]


class RedisServer(Server):

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
        # One immediate retry: a pooled connection the server closed
        # (restart, idle timeout) is replaced without counting as a failure.
        self.client = redis.Redis.from_url(
            url, socket_timeout=TIMEOUT, socket_connect_timeout=CONNECT_TIMEOUT,
            retry=Retry(NoBackoff(), 1))

    def is_connection_error(self, exc):
        return isinstance(exc, self._errors)

    def get_many(self, keys):
        if len(keys) == 1:
            return {keys[0]: self.client.get(keys[0])}
        return dict(zip(keys, self.client.mget(keys)))

    def set_many(self, values, wait):
        if len(values) == 1:
            (key, value), = values.items()
            self.client.set(key, value, ex=EXPIRE)
            return
        pipe = self.client.pipeline(transaction=False)
        for key, value in values.items():
            pipe.set(key, value, ex=EXPIRE)
        pipe.execute()

    def close(self):
        self.client.close()
