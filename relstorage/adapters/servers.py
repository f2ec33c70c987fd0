"""Which database server a connection goes to.

Every adapter that has a host shares this: the adapter knows how to
connect to one given server (``Adapter.connect_to(server, purpose)``);
``ServerChooser`` knows the lists and picks the server for each purpose:

- ``replica-conf`` lists the servers to use, in order of preference (the
  configured host is then not used).  Connections go to the first that
  answers; when the current one stops answering, to the next.  After
  ``replica-timeout`` seconds on a fallback the first is tried again.
- ``ro-replica-conf`` lists servers for load (read-only snapshot)
  connections only; store, OID and pack connections always go to the
  server chosen above.  When no replica answers, loads use that server.

Both files are re-read when they change, checked when a transaction
begins (``current``), so an operator can edit them while clients run.
A connection made before a change of server (another connection failed
over, the file changed, the timeout elapsed) is replaced when its next
transaction begins, so every connection of a process follows the switch.
"""
import ipaddress
import logging
import os
import re
import threading
import time

from .. import locks
from ..interfaces import DisconnectedError
from ..interfaces import RelStorageError
from ..messages import one_line
from ..options import redact_secrets

log = logging.getLogger(__name__)


#: A host name or an IPv4 address, as a line of a server list gives it.
_HOST_NAME = re.compile(r'^[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?$')


def parse_host_port(text):
    """``(host, port or None)`` of ``host[:port]`` (``[v6 address]:port``
    for IPv6); ValueError saying what is wrong with anything else (a port
    that is no number or out of range, a URL, an unclosed bracket: each
    was taken for a host name that never answered)."""
    if '@' in text or '://' in text:
        # (Credentials and the database come from the adapter's section.)
        raise ValueError("a line names a host and port only, not a URL, user or password")
    if text.startswith('['):                        # [::1]:5432
        end = text.find(']')
        if end < 0:
            raise ValueError("no ']' closes the IPv6 address")
        host, rest = text[1:end], text[end + 1:]
        _check_ipv6(host, 'the address in brackets is not an IPv6 address')
        if not rest:
            return host, None
        if not rest.startswith(':'):
            raise ValueError("only ':port' may follow ']'")
        return host, _port(rest[1:])
    if text.count(':') > 1:
        # A bare IPv6 address, without port.
        _check_ipv6(text, 'with more than one colon it must be an IPv6 address, '
                    'and it is not one')
        return text, None
    host, colon, number = text.partition(':')
    if not _HOST_NAME.match(host):
        raise ValueError('the host is not a host name or address')
    return host, (_port(number) if colon else None)


# The reasons name what is wrong, not the text: a line that is not
# host[:port] may hold a password (a helper agent's check: a .pgpass line,
# host:port:db:user:password, was quoted back in the reason).

def _port(number):
    if not number.isdigit() or not 0 < int(number) < 65536:
        raise ValueError('the port is not a number from 1 to 65535')
    return int(number)


def _check_ipv6(text, problem):
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        raise ValueError(problem) from None


def shown_line(text):
    """What a message may quote of ``text``, a line of a server list that
    may hold a password: its host, when it starts with a valid one
    (``db1:...``), the text after its last ``@`` (``...@db1:5432``),
    else nothing (None)."""
    if '@' in text:
        text = text.rsplit('@', 1)[1]
        prefix = '...@'
    else:
        prefix = ''
    if text.startswith('['):
        host, bracket, rest = text.partition(']')
        if not bracket:
            return None
        return prefix + host + bracket + ('...' if rest else '')
    host, colon, _ = text.partition(':')
    if not _HOST_NAME.match(host):
        return None
    return prefix + host + (':...' if colon else '')


class Server:
    """One line of a replica file: ``host[:port]`` (or a vendor's own text,
    such as an Oracle DSN, kept whole in ``text``)."""

    __slots__ = ('text', 'host', 'port')

    def __init__(self, text, host_port=True):
        self.text = text
        self.host, self.port = parse_host_port(text) if host_port else (text, None)

    def __eq__(self, other):
        return isinstance(other, Server) and other.text == self.text

    def __hash__(self):
        return hash(self.text)

    def __str__(self):
        # Logged (which server is in use, the list re-read): an Oracle
        # line, kept whole, may begin with user/password@.
        if '@' in self.text:
            return redact_secrets('...@' + self.text.rsplit('@', 1)[1])
        return self.text

    __repr__ = __str__


def with_server(params, server, drop=(), port_type=int):
    """Connection parameters ``params`` (a dict) pointed at ``server``
    instead (None: unchanged); the keys in ``drop`` (another way to name
    a host) removed."""
    if server is None:
        return params
    params = dict(params, host=server.host)
    for key in drop:
        params.pop(key, None)
    if server.port:
        params['port'] = port_type(server.port)
    return params


def read_server_file(path, option, host_port=True):
    """The servers listed in ``path`` (``#`` comments and blank lines
    skipped); a RelStorageError naming the option and the file when it
    cannot be read, lists none, or (``host_port``) has a line that is not
    one ``host[:port]``.  Without ``host_port`` a line is kept whole (an
    Oracle DSN)."""
    try:
        with open(path, encoding='utf-8') as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise RelStorageError("%s: cannot read the server list %s: %s"
                              % (option, path, exc.strerror or exc)) from None
    except UnicodeDecodeError as exc:
        # (A helper agent's check: a Latin-1 comment gave a bare
        # UnicodeDecodeError, naming neither the option nor the file.)
        raise RelStorageError("%s: the server list %s is not UTF-8 text (byte %d)"
                              % (option, path, exc.start)) from None
    servers = []
    for number, line in enumerate(lines, 1):
        text = line.split('#', 1)[0].strip()
        if not text:
            continue
        # A helper agent's check: a line written user:password@host:port
        # was quoted whole in the error (and later a .pgpass line, or
        # password=...): only what shown_line allows is.
        shown = shown_line(text.split()[0])
        shown = (' (%r)' % shown) if shown else ' (not shown: it may hold a password)'
        if len(text.split()) > 1 and not text.startswith('('):
            # (Only an Oracle descriptor, in parentheses, holds spaces.)
            raise RelStorageError("%s: line %d of the server list %s is not one "
                                  "host[:port]%s: it holds more than one word"
                                  % (option, number, path, shown))
        try:
            servers.append(Server(text, host_port))
        except ValueError as exc:
            reason = str(exc)
        else:
            continue
        # (Raised here, not in the except clause: the ValueError would stay
        # attached to it as its __context__.)
        raise RelStorageError("%s: line %d of the server list %s is not one "
                              "host[:port]%s: %s" % (option, number, path, shown, reason))
    if not servers:
        raise RelStorageError("%s: the server list %s names no server" % (option, path))
    return servers


class ServerList:
    """The servers of one file and which of them is in use."""

    def __init__(self, option, path, timeout, host_port=True):
        self.option = option
        self.path = path
        self.timeout = timeout
        self.host_port = host_port
        self._mtime = self._stat()
        self.servers = read_server_file(path, option, host_port)
        self.index = 0
        self.since = None           # when we left the first server
        #: Back on the first server because replica-timeout passed, not
        #: because the one in use failed (see ServerChooser.returned_to).
        self.returned = False

    def _stat(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def reread(self):
        """Re-read the file if it changed; True when the list changed."""
        mtime = self._stat()
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        try:
            servers = read_server_file(self.path, self.option, self.host_port)
        except RelStorageError as exc:
            log.error("%s; keeping the servers read before (%s)", exc,
                      ', '.join(map(str, self.servers)))
            return False
        if servers == self.servers:
            return False
        log.info("%s: %s changed; servers now %s", self.option, self.path,
                 ', '.join(map(str, servers)))
        self.servers = servers
        self.index = 0
        self.since = None
        self.returned = False
        return True

    def timed_out(self, now):
        """On a fallback for longer than the timeout: go back to the first."""
        if self.since is not None and now - self.since >= self.timeout:
            log.info("%s: %ss on %s; trying %s again", self.option, self.timeout,
                     self.servers[self.index], self.servers[0])
            self.index = 0
            self.since = None
            self.returned = True
            return True
        return False

    def order(self):
        """Indexes to try: the current server, then the others in order."""
        n = len(self.servers)
        return [(self.index + i) % n for i in range(n)]


class ServerChooser:
    """Picks the server for each connection; one per adapter, shared by
    every storage instance (thread-safe)."""

    def __init__(self, options, describe_default, clock=time.monotonic, host_port=True):
        self._clock = clock
        self._lock = threading.Lock()
        self._locks_made_with = locks.made_now(self)
        self._describe_default = describe_default
        timeout = float(getattr(options, 'replica_timeout', 600.0) or 0)
        path = getattr(options, 'replica_conf', None)
        self.rw = ServerList('replica-conf', path, timeout, host_port) if path else None
        path = getattr(options, 'ro_replica_conf', None)
        self.ro = (ServerList('ro-replica-conf', path, timeout, host_port)
                   if path else None)
        #: Loads go to the primary because no read-only replica answered
        #: (since when, or None).
        self._ro_down_since = None
        #: Bumped on every switch: connections made before are replaced.
        self.generation = 0

    @property
    def configured(self):
        return self.rw is not None or self.ro is not None

    # ------------------------------------------------------------------

    def connect(self, purpose, connect_to, replicas=True):
        """``(raw, server, replica, generation)`` for a new connection.

        ``connect_to(server, purpose)`` opens a raw connection to one
        server (None: the adapter's configured one) and raises a
        DisconnectedError when that server does not answer.  A load
        connection goes to a read-only replica unless ``replicas`` is
        false.
        """
        with self._lock:
            generation = self.generation
        if (replicas and purpose == 'load' and self.ro is not None
                and self._ro_wanted()):
            found = self._try_list(self.ro, purpose, connect_to, last_resort=False)
            if found is not None:
                raw, server = found
                return raw, server, True, generation
            with self._lock:
                if self._ro_down_since is None:
                    self._ro_down_since = self._clock()
                    log.info("ro-replica-conf: no read-only replica answers; loading "
                             "from %s", self._describe_rw())
        if self.rw is None:
            return connect_to(None, purpose), None, False, generation
        raw, server = self._try_list(self.rw, purpose, connect_to, last_resort=True)
        return raw, server, False, generation

    def _ro_wanted(self):
        # (current() ends the fall-back when replica-timeout has passed.)
        with self._lock:
            return self._ro_down_since is None

    def renew_locks(self):
        """(relstorage/locks.py)"""
        if locks.stale(self):
            self._lock = threading.Lock()

    def replicas_unusable(self, reason):
        """Loads go to the primary for replica-timeout seconds, as when no
        read-only replica answers (``reason`` is logged)."""
        with self._lock:
            if self._ro_down_since is None:
                self._ro_down_since = self._clock()
                self.generation += 1
                log.info("ro-replica-conf: %s; loading from %s", reason, self._describe_rw())

    def step_off(self, server, reason):
        """Leave ``server``, the replica-conf server in use, for the next
        one of the list until replica-timeout passes (``reason`` is
        logged); False when there is no other to go to."""
        with self._lock:
            servers = self.rw
            if servers is None or len(servers.servers) < 2 or \
                    servers.servers[servers.index] != server:
                return False
            new = (servers.index + 1) % len(servers.servers)
            log.warning("%s: %s; leaving it for %s", servers.option, reason,
                        servers.servers[new])
            self._move(servers, new)
            return True

    def returned_to(self, server):
        """Whether ``server`` is the replica-conf server in use because
        replica-timeout brought us back to it (not because the server in
        use before failed)."""
        with self._lock:
            servers = self.rw
            return (servers is not None and servers.returned
                    and servers.servers[servers.index] == server)

    def current_rw(self):
        """The replica-conf server in use, or None without replica-conf.
        Without the lock: messages made under it describe the server (a
        review finding: the lock, not reentrant, hung every connection)."""
        if self.rw is None:
            return None
        servers, index = self.rw.servers, self.rw.index
        # (A file re-read meanwhile may have shortened the list.)
        return servers[index] if index < len(servers) else servers[0]

    def _describe_rw(self):
        if self.rw is None:
            return self._describe_default()
        return str(self.rw.servers[self.rw.index])

    def _try_list(self, servers, purpose, connect_to, last_resort):
        """Connect to the first server of ``servers`` that answers, from the
        current one on; note a switch.  None (or, when ``last_resort``, the
        last error) when none answers."""
        with self._lock:
            order = servers.order()
            listed = list(servers.servers)
            start = servers.index
        failures = []
        for index in order:
            server = listed[index]
            try:
                raw = connect_to(server, purpose)
            except DisconnectedError as exc:
                log.info("%s: %s does not answer (%s connection): %s", servers.option,
                         server, purpose, exc)
                failures.append(exc)
                continue
            if index != start:
                self._switched(servers, listed, start, index)
            return raw, server
        if not last_resort:
            return None
        error = failures[-1]
        if len(failures) > 1:
            # Each server's own reason (a helper agent's check: the error
            # named the last server tried only, as if it were the only one).
            # (Of the last one's class: a vendor's connect error stays one.)
            error = type(error)("%s: none of the %d servers of %s answers: %s" % (
                servers.option, len(failures), servers.path,
                '; '.join(one_line(exc) for exc in failures)))
            error.__cause__ = failures[-1]
        raise error

    def _switched(self, servers, listed, old, new):
        with self._lock:
            if servers.servers != listed:
                return          # the file changed meanwhile; it wins
            log.info("%s: switching from %s to %s", servers.option, listed[old], listed[new])
            self._move(servers, new)

    def _move(self, servers, new):
        """(Under the lock.)  Use server ``new`` of ``servers`` from now on;
        every connection made before is replaced."""
        servers.index = new
        servers.since = self._clock() if new != 0 else None
        servers.returned = False
        self.generation += 1

    # ------------------------------------------------------------------

    def current(self, conn):
        """Whether ``conn`` may begin a transaction on its server: False
        when it should be replaced (re-reads changed files first)."""
        with self._lock:
            now = self._clock()
            changed = False
            for servers in (self.rw, self.ro):
                if servers is None:
                    continue
                if servers.reread():
                    changed = True
                    if servers is self.ro:
                        self._ro_down_since = None      # new replicas to try
                changed = servers.timed_out(now) | changed
            if (self.ro is not None and self._ro_down_since is not None
                    and now - self._ro_down_since >= self.ro.timeout):
                # Loads fell back to the primary long enough ago: the
                # replicas may answer again.
                log.info("ro-replica-conf: %ss on %s; trying the read-only replicas again",
                         self.ro.timeout, self._describe_rw())
                self._ro_down_since = None
                changed = True
            if changed:
                self.generation += 1
            return conn.server_generation == self.generation
