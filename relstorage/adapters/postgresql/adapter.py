"""PostgreSQL adapter.

Connections, by purpose:

- ``load``: every transaction is one ``REPEATABLE READ READ ONLY``
  snapshot (so a hot standby could serve it), begun by the first query after
  the storage's previous rollback;
- ``store``: ``READ COMMITTED``, autocommit off.  Each statement sees what
  was committed before it started, which is what the commit steps need
  once they hold their row locks.  Waiting for a lock is bounded by
  ``commit-lock-timeout`` through the session's ``lock_timeout`` (set once
  when the connection opens, so that locking costs no extra round trip);
- ``oid``: autocommit; OIDs come from the sequence ``zoid_seq`` (nextval is
  never rolled back, so two clients can never get the same OID).

Locks: committers lock the current rows of the objects they change
``FOR UPDATE`` (and of the objects read with ``readCurrent`` ``FOR SHARE``)
during vote, in OID order, so commits touching disjoint objects vote in
parallel.  The single row of ``commit_lock`` is updated last in vote, to
choose the transaction id and publish it, and stays locked until the
COMMIT in finish.  A lost client
(killed process, dropped link) loses its server session, and PostgreSQL
releases its locks and discards its uncommitted work with it.
"""
import configparser
import getpass
import os
import re

from ...interfaces import DisconnectedError
from ...interfaces import RelStorageError
from ...options import PASSWORD_NOT_ENCODED
from ...options import password_not_encoded
from ...options import redact_password
from ...options import redact_secrets
from ..base import Adapter
from ..base import _one_line
from ..servers import with_server
from . import drivers
from . import sql

DEFAULT_CONNECT_TIMEOUT = 10

#: libpq's TCP keepalive settings and its limit on data the server leaves
#: unacknowledged, where the DSN sets none of them: a session whose network
#: went silently dead (a firewall or NAT that drops idle connections) ends
#: within about two minutes instead of when the operating system gives up
#: on it (many minutes; for an idle session, never: a helper agent's check
#: saw a process wait on such a session without limit).  A server that
#: answers acknowledges at once however long its query runs.  (Unix
#: sockets ignore them.)
DEFAULT_TCP_LIMITS = (('keepalives_idle', '60'), ('keepalives_interval', '10'),
                      ('keepalives_count', '6'), ('tcp_user_timeout', '60000'))

#: The keywords of libpq's connection strings, which its parse errors
#: quote and which are no secret (anything else they quote may be).
DSN_KEYWORDS = frozenset('''
    host hostaddr port dbname user password passfile require_auth channel_binding
    connect_timeout client_encoding options application_name
    fallback_application_name keepalives keepalives_idle keepalives_interval
    keepalives_count tcp_user_timeout replication gssencmode sslmode requiressl
    sslcompression sslcert sslkey sslpassword sslcertmode sslrootcert sslcrl
    sslcrldir sslsni requirepeer ssl_min_protocol_version ssl_max_protocol_version
    krbsrvname gsslib gssdelegation service target_session_attrs load_balance_hosts
    = postgres postgresql'''.split())


def unparsable_dsn_message(dsn, exc):
    """The error for a DSN the driver cannot parse, without the password.

    A helper agent's check: libpq quotes the token it stumbled on, and in
    a DSN with a password that is often part of it (an unquoted password
    with a space, a stray ``%`` in a URI's).  Where the DSN may hold a
    password, only keywords are quoted back."""
    text = redact_secrets(_one_line(exc))
    if 'password' in dsn.lower() or '@' in dsn:
        text = re.sub(r'"([^"]*)"',
                      lambda m: m.group(0) if m.group(1).lower() in DSN_KEYWORDS else '"..."',
                      text)
    return "Invalid PostgreSQL DSN: %s" % text


#: The largest lock_timeout PostgreSQL takes (milliseconds, an int4).
PG_MAX_LOCK_TIMEOUT_MS = 2 ** 31 - 1


class PostgreSQLConnectError(DisconnectedError):
    """The server could not be reached (down, restarting, network).

    A DisconnectedError, hence a TransientError: retrying later may work.
    """


#: Where libpq's system-wide service file is, when PGSYSCONFDIR does not
#: say (its build's sysconfdir: Debian's and Ubuntu's packages).
SYSCONFDIR = '/etc/postgresql-common'


def service_params(params):
    """The connection parameters that libpq takes from the service file
    for the service the DSN (``params``) or PGSERVICE names: {} without a
    service, or when its file cannot be read (then libpq says why).

    libpq gives the DSN's own values, then the service's, then the
    environment's, then its defaults: the ones we add where the DSN sets
    none (connect_timeout, the keepalives) must not hide the service's (a
    helper agent's check: a service's connect_timeout of 2 s waited 10),
    and the description names the service's server, not the local socket.
    """
    name = params.get('service') or os.environ.get('PGSERVICE')
    if not name:
        return {}
    user_file = os.environ.get('PGSERVICEFILE') or os.path.expanduser('~/.pg_service.conf')
    system_file = os.path.join(os.environ.get('PGSYSCONFDIR') or SYSCONFDIR,
                               'pg_service.conf')
    for path in (user_file, system_file):
        parser = configparser.ConfigParser(interpolation=None, strict=False,
                                           comment_prefixes=('#',), delimiters=('=',))
        try:
            with open(path, encoding='utf-8') as f:
                parser.read_file(f)
        except (OSError, UnicodeError, configparser.Error):
            continue
        if parser.has_section(name):
            return {key: value.strip() for key, value in parser.items(name)}
    return {}


def _at_in_password(dsn):
    """Whether the URI ``dsn`` has two @ before its path: libpq ends the
    user and password at the first (redis-py and zodburi at the last), and
    quoted the rest of the password as the host name in its error (a
    helper agent's check)."""
    scheme, sep, rest = dsn.strip().partition('://')
    if not sep or scheme not in ('postgresql', 'postgres'):
        return False
    return re.split(r'[/?#]', rest, maxsplit=1)[0].count('@') > 1


class PostgreSQLAdapter(Adapter):
    vendor = 'postgresql'
    # idle_in_transaction_session_timeout, set in store sessions.
    ends_idle_store_transactions = True
    has_host = True
    # See sql.TEMP_STORE.  TRUNCATE makes new files for the table (and
    # its TOAST table and indexes), about what ON COMMIT DELETE ROWS cost
    # every commit; deleted rows cost every later statement over the
    # table (bench/write_ab.py, 1000-object commits: with 5,000 rows
    # between truncations, update 6 % and conflicting updates 11 % slower
    # than with ON COMMIT DELETE ROWS; with 1,000, the same time).  Small
    # commits, the usual ones, truncate once in hundreds.
    temp_garbage_rows = 1000
    temp_garbage_bytes = 16 * 1024 * 1024
    # A state goes to and from the server as text, in hexadecimal (twice
    # its size), and the server allocates nothing past 1 GB: a helper
    # agent's check committed a 530 MB state that no load or pack could
    # read again.  (1 GB less 1 byte is PostgreSQL's MaxAllocSize; the
    # margin is the rest of a COPY line.)
    max_state_bytes = ((1 << 30) - 1 - 1024) // 2
    max_state_reason = ("psycopg2, pg_dump and COPY carry a state as hexadecimal "
                        "text, twice its size, and PostgreSQL handles no value past 1 GB")
    placeholder = '%s'
    max_in_list = 1000
    upload_batch = 1000
    statements_class = sql.PostgreSQLStatements
    earlier_release_reads = sql.PostgreSQLEarlierReleaseReads
    temp_table_statements = (sql.TEMP_STORE, sql.TEMP_BLOB_CHUNK)
    # idle_in_transaction_session_timeout ends a held transaction.
    holds_locks_for_retry = True
    # A chunk goes up as one value, which psycopg2 sends as a text literal
    # (hex: twice its size, and the server's parse of it needs more), and
    # nothing of PostgreSQL's may pass 1 GB (a helper agent's check: 512 MB
    # chunks lost the connection at commit, "invalid message length" in
    # the server's log; 256 MB failed with "invalid memory alloc request
    # size 1073741824").
    blob_chunk_max = 128 << 20

    def __init__(self, dsn='', options=None, driver=None):
        self._params = {}
        super().__init__(options)
        self.driver = drivers.select_driver(driver or getattr(self.options, 'driver', 'auto'))
        self._password = None
        if password_not_encoded(dsn or '') or _at_in_password(dsn or ''):
            # (libpq reads the rest of such a password as the port, the
            # database name...: a helper agent's check saw it quoted.)
            raise RelStorageError("Invalid PostgreSQL DSN: " + PASSWORD_NOT_ENCODED)
        try:
            params = dict(self.driver.parse_dsn(dsn or ''))
        except Exception as exc:  # pylint:disable=broad-except
            message = unparsable_dsn_message(dsn or '', exc)
        else:
            message = None
        if message is not None:
            # Raised out of the except clause: the driver's error, which
            # quotes the DSN, is not kept as its __context__ (a helper
            # agent's check).
            raise RelStorageError(message)
        self._password = params.get('password') or None
        #: What the service file gives (see service_params).
        self._service = service = service_params(params)
        if not params.get('connect_timeout'):
            # Written into the DSN even when the service or the environment
            # gives it: psycopg 3 times the connection itself, from the DSN
            # or PGCONNECT_TIMEOUT only, and waited its own 130 s for a
            # service's 2 (a helper agent's check).
            params['connect_timeout'] = str(
                service.get('connect_timeout') or os.environ.get('PGCONNECT_TIMEOUT')
                or DEFAULT_CONNECT_TIMEOUT)
        #: Whether the server's keepalives are set too (connect_to).
        self._server_keepalives = not any(
            key in params or key in service
            for key, _ in DEFAULT_TCP_LIMITS + (('keepalives', ''),))
        if self._server_keepalives:
            params.update(DEFAULT_TCP_LIMITS)
        self._params = params
        self._dsn = self.driver.make_dsn(params)
        self._server_dsns = {}       # servers.Server -> DSN naming that host
        self._oid_floor_seen = 0
        self._oid_draws = sql.OID_DRAWS_FIRST   # sequence values per allocation

    # --- description and errors ------------------------------------------

    def describe(self, server=None):
        params = dict(self._service)
        params.update(self._server_params(self.described_server(server)))
        host = params.get('host') or params.get('hostaddr') or os.environ.get('PGHOST')
        port = params.get('port') or os.environ.get('PGPORT')
        user = params.get('user') or os.environ.get('PGUSER') or _os_user()
        dbname = params.get('dbname') or os.environ.get('PGDATABASE') or user
        where = ('host %s' % host) if host else 'the local socket'
        if port:
            where += ' port %s' % port
        # (Two schemas of one database are two storages: their cache
        # files, named after this, must differ; a helper agent's check.)
        schema = re.search(r'search_path\s*=\s*([^\s]+)',
                           params.get('options') or os.environ.get('PGOPTIONS') or '')
        name = repr(dbname)
        if schema:
            name += ' (search_path %s)' % schema.group(1)
        return "PostgreSQL database %s on %s as user %r" % (name, where, user)

    def classify_error(self, exc):
        return self.driver.classify_error(exc)

    def foreign_triggers(self, conn):
        # (This release makes none: RelStorage 4.3 puts one on blob_chunk,
        # which then fails every replacement of a blob, a helper agent's
        # check.)
        return [tuple(row) for row in conn.query_all(
            "SELECT t.tgname, c.relname FROM pg_trigger t "
            "JOIN pg_class c ON c.oid = t.tgrelid "
            "WHERE NOT t.tgisinternal AND c.relnamespace = " + sql.CURRENT_SCHEMA_OID +
            " "
            "AND c.relname IN ('object_state', 'current_object', 'transaction_log', "
            "'blob_chunk', 'commit_lock') ORDER BY 1")]

    #: The functions of RelStorage 3.x and 4.x (seen in a database of
    #: this release that a process of 4.3 opened).
    EARLIER_FUNCTIONS = (
        'blob_chunk_delete_trigger', 'lock_and_choose_tid', 'lock_and_choose_tid_and_move',
        'lock_objects_and_detect_conflicts', 'make_current_tid', 'make_tid_for_epoch',
        'merge_blob_chunks', 'temp_blob_chunk_delete_trigger')

    def earlier_leftovers(self, conn):
        found = [('view %s' % name, 'DROP VIEW "%s";' % name) for (name,) in conn.query_all(
            "SELECT table_name FROM information_schema.views "
            "WHERE table_schema = current_schema() AND table_name = ANY(%s) ORDER BY 1",
            (list(self.EARLIER_VIEWS),))]
        found += [('function %s' % name, 'DROP FUNCTION %s(%s);' % (name, args))
                  for name, args in conn.query_all(
                      "SELECT proname, pg_get_function_identity_arguments(oid) FROM pg_proc "
                      "WHERE pronamespace = " + sql.CURRENT_SCHEMA_OID + " "
                      "AND proname = ANY(%s) ORDER BY 1, 2", (list(self.EARLIER_FUNCTIONS),))]
        return found

    def link_lost(self, conn, exc):
        # A helper agent's check through pgbouncer: after the server
        # session behind it ended, psycopg 3 failed the next BEGIN with
        # "received 2 results from command ..." (an InternalError without
        # SQLSTATE, not retried), its connection closed.
        return isinstance(exc, self.driver.Error) and bool(getattr(conn.raw, 'closed', False))

    def _connect_error(self, exc, server=None):
        where = self.describe(server)
        message = "Cannot connect to %s (driver %s): %s" % (
            where, self.driver.name, redact_password(_one_line(exc), self._password, where))
        if drivers.connect_error_is_transient(self.driver, exc):
            # Unreachable, refused, timed out, starting up, shutting down,
            # too many clients: worth retrying later.
            return PostgreSQLConnectError(message)
        # Authentication, unknown database or role, bad parameters.
        return RelStorageError(message)

    # --- connections ------------------------------------------------------

    def _server_params(self, server):
        return with_server(self._params, server, drop=('hostaddr',), port_type=str)

    def connect_to(self, server, purpose):
        if server is None:
            dsn = self._dsn
        else:
            dsn = self._server_dsns.get(server)
            if dsn is None:
                dsn = self._server_dsns[server] = self.driver.make_dsn(
                    self._server_params(server))
        try:
            raw = self.driver.connect(dsn, purpose, writes=not self.options.read_only)
        except self.driver.Error as exc:
            # Not chained: the driver's own text is already summarised (and
            # redacted) in ours.
            raise self._connect_error(exc, server) from None
        settings = []
        if self._server_keepalives:
            # The server's side of the same limits (its defaults follow
            # the OS: probes after 2 hours): a session whose client's
            # network died ends within minutes, and with it what it held
            # (a commit's locks: a helper agent's check saw every writer
            # of the database fail meanwhile).  A live client answers the
            # probes, however long it is busy elsewhere.
            settings += [('tcp_keepalives_idle', 60), ('tcp_keepalives_interval', 10),
                         ('tcp_keepalives_count', 6)]
        if purpose == 'store':
            settings += [('lock_timeout', self._lock_timeout_ms()),
                         ('idle_in_transaction_session_timeout', self._store_idle_ms())]
        calls = ["set_config('%s', '%d', false)" % item for item in settings]
        if purpose != 'load' and not self.options.read_only:
            # A database or role set default_transaction_read_only (a helper
            # agent's check: the OID session's nextval failed every commit
            # of a new object, where RelStorage 4.3 committed).
            calls.append("set_config('default_transaction_read_only', 'off', false)")
        if purpose == 'store':
            # A statement_timeout set for the user (by a DBA) shorter than
            # the lock waits cut commits waiting for the commit lock off
            # there, with an error nothing retries (a helper agent's
            # check: 0.2 s): raised to outlast them, in store sessions.
            least = self._lock_timeout_ms() + 1000
            calls.append(
                "set_config('statement_timeout', CASE WHEN "
                "current_setting('statement_timeout')::interval > interval '0' AND "
                "current_setting('statement_timeout')::interval < interval '%d ms' "
                "THEN '%d' ELSE current_setting('statement_timeout') END, false)"
                % (least, least))
        # A server session a pooler hands on (pgbouncer without
        # server_reset_query) may hold another client's prepared statements:
        # psycopg2's PREPARE of load_current then failed every load (a
        # helper agent's check).  (Its temporary tables are emptied by the
        # first commit: Adapter.prepare_temp_tables.)
        calls.append('(SELECT count(*) FROM pg_prepared_statements)')
        cur = raw.cursor()
        try:
            # (One round trip for them all.)
            cur.execute('SELECT ' + ', '.join(calls))
            if cur.fetchone()[-1]:
                cur.execute('DEALLOCATE ALL')
            raw.commit()
        except self.driver.Error as exc:
            raw.close()
            raise self._connect_error(exc, server) from None
        finally:
            cur.close()
        return raw

    def load_current(self, conn, oid):
        if conn.purpose == 'load' and self.driver.prepares_explicitly:
            if not conn.session_settings.get('load_prepared'):
                # Saves the server parsing and planning the statement run
                # once per object read (a cold read is one of these per
                # object).  At the first load, not as the session opens:
                # a replica that has not replayed the schema yet failed
                # the connection with "relation current_object does not
                # exist", where a load's error has the replica left for a
                # while (translate_error).  (PREPARE outlives a rollback.)
                conn.execute("PREPARE rs_load_current(bigint) AS "
                             + self.sql.LOAD_CURRENT.replace('%s', '$1'))
                conn.session_settings['load_prepared'] = True
            return conn.query_one('EXECUTE rs_load_current(%s)', (oid,))
        return super().load_current(conn, oid)

    def _lock_timeout_ms(self):
        # 0 would mean "wait forever" to PostgreSQL: never pass it.  Nor
        # more than it takes (an int of milliseconds, 24.8 days: a helper
        # agent's check found 30 days, a plausible "forever", failed every
        # connection as "Cannot connect").
        return min(PG_MAX_LOCK_TIMEOUT_MS,
                   max(1, int(float(self.options.commit_lock_timeout) * 1000)))

    def list_tables(self, conn):
        return {row[0].lower() for row in conn.query_all(self.sql.LIST_TABLES)}

    def begin_schema_creation(self, conn):
        # (A helper agent's check: processes opening a new database at once
        # failed on a duplicate zoid_seq.)  DDL is transactional here: the
        # creation is one transaction, which they take in turn under this
        # lock (released at its end); the tables are listed again under it
        # (store sessions read committed: what the one before made).
        conn.rollback()
        conn.execute(self.sql.SCHEMA_LOCK)
        return True

    def schema_statements(self):
        return sql.HISTORY_PRESERVING_SCHEMA if self.keep_history else sql.HISTORY_FREE_SCHEMA

    # --- OIDs -------------------------------------------------------------

    def allocate_oid_block(self, conn):
        draws = self._oid_draws
        values = [row[0] for row in conn.query_all(self.sql.NEXT_OID_BLOCK, (draws,))]
        # The next allocation draws twice as many: a process allocating
        # many OIDs (ZODB asks for one per new object, during the commit)
        # soon needs a round trip per thousands, and one allocating a few
        # leaves a small gap when it exits.
        self._oid_draws = min(draws * 2, sql.OID_DRAWS_MAX)
        self._oid_floor_seen = max([self._oid_floor_seen] + values)
        return [oid for last in values for oid in range(last - sql.OID_BLOCK + 1, last + 1)]

    def forget_oid_floor(self):
        self._oid_floor_seen = 0

    def raise_oid_floor(self, conn, max_oid):
        # Every OID we handed out is <= a sequence value we saw: the usual
        # commit needs no query at all.
        if max_oid <= self._oid_floor_seen:
            return
        last, is_called = conn.query_one(self.sql.OID_SEQUENCE_STATE)
        reserved = last if is_called else last - sql.OID_BLOCK
        if reserved < max_oid:
            # (Only restore/copy store OIDs nobody allocated.  A nextval by
            # another client between the read above and this setval could
            # still be overtaken; copying into a database that is in use
            # is not supported.)
            conn.query_value(self.sql.SET_OID_FLOOR, (max_oid,))
            reserved = max_oid
        self._oid_floor_seen = max(self._oid_floor_seen, reserved)

    # --- commit -----------------------------------------------------------

    def upload(self, conn, rows):
        conn.call(self.driver.copy_in, conn.cursor, self.sql.COPY_TEMP, rows)

    def insert_new_objects(self, conn, tid, rows):
        # One COPY straight into object_state (columns: see COPY_NEW_OBJECTS).
        copy = self.driver.copy_new_objects
        if self.keep_history:
            conn.call(copy, conn.cursor, self.sql.COPY_NEW_OBJECTS, 4,
                      ((oid, tid, 0, len(state), state) for oid, state in rows))
            conn.execute(self.sql.NEW_OBJECTS_CURRENT,
                         (self.oid_array([oid for oid, _ in rows]), tid))
        else:
            conn.call(copy, conn.cursor, self.sql.COPY_NEW_OBJECTS, 3,
                      ((oid, tid, len(state), state) for oid, state in rows))

    def oid_array(self, oids):
        # The text form of a bigint[]: both drivers pass a str through
        # as it is, where a list is converted element by element (psycopg2
        # spells out ARRAY[...] in Python, about 2 us an element).
        return '{%s}' % ','.join(map(str, oids))

    def lock_objects(self, conn, oids, read_current_oids):
        current = {}
        oids = list(oids)
        if oids:
            current.update(conn.query_all(self.sql.LOCK_OBJECTS, (self.oid_array(oids),)))
        read_current_oids = list(read_current_oids)
        if read_current_oids:
            current.update(conn.query_all(self.sql.LOCK_READ_CURRENT,
                                          (self.oid_array(read_current_oids),)))
        return current

    def lock_commit(self, conn):
        return conn.query_value(self.sql.LOCK_COMMIT)

    def query_script(self, conn, script):
        # (No parameters: the drivers send it as one simple query.)
        conn.execute(script, None)
        conn.call(self.driver.to_last_result, conn.cursor)
        return conn.fetchone()

    def socket_fd(self, raw):
        return raw.fileno()

    def hold_locks(self, conn, seconds):
        # SET LOCAL lasts until the transaction ends: a rollback, or the
        # server ending the session, undoes it with the locks.
        conn.execute('SET LOCAL idle_in_transaction_session_timeout = %d'
                     % max(1, int(seconds * 1000)))

    def end_hold(self, conn):
        # (Not TO DEFAULT: that is the server's setting, not the session's.)
        conn.execute('SET LOCAL idle_in_transaction_session_timeout = %d'
                     % self._store_idle_ms())

    def _store_idle_ms(self):
        return min(PG_MAX_LOCK_TIMEOUT_MS, int(self.store_idle_seconds() * 1000))

    # --- pack -----------------------------------------------------------

    def stream_query(self, conn, sql, params, batch=1000):
        """Rows streamed through a server-side cursor: a client-side one
        would hold the whole result in memory."""
        cursor = conn.call(conn.raw.cursor, 'relstorage_stream')
        return self.stream_rows(conn, cursor, sql, batch, params)

    def forget_refs_of(self, conn, oids):
        # One array each: statements with thousands of placeholders cost
        # more to convert in the driver than to run (psycopg caches the
        # conversion of short statements only).  In their text form (see
        # oid_array): psycopg 3 dumps a list with a regular expression
        # per element, a third of the analysis's time.
        if oids:
            conn.execute(self.sql.PACK_REFS_FORGET_ARRAY, (self.oid_array(oids),))

    def refs_of(self, conn, oids):
        if not oids:
            return []
        return conn.query_all(self.sql.PACK_REFS_OF_ARRAY, (self.oid_array(sorted(oids)),))

    def insert_refs(self, conn, rows):
        if rows:
            array = self.oid_array
            conn.execute(self.sql.PACK_REFS_INSERT_ARRAYS,
                         (array([r[0] for r in rows]), array([r[1] for r in rows]),
                          array([r[2] for r in rows])))

    def pack_schema(self):
        return sql.PACK_SCHEMA

    def pack_temp_tables(self):
        return sql.PACK_TEMP_TABLES

    def clear_pack_temp(self, conn, name):
        # A DELETE leaves the rows dead in the table's pages, and
        # autovacuum never visits temporary tables: a hundred deletion
        # batches made temp_pack_batch a hundred times its size, and
        # every statement joining it twice as slow (7.1 s against 3.8 s
        # at a million objects).  After TRUNCATE the table starts from
        # empty pages (the old ones go at commit; the table is this
        # session's, so nobody waits for its lock).
        conn.execute('TRUNCATE %s' % name)

    # --- maintenance ------------------------------------------------------

    def drop_all(self):
        self.close()
        self._oid_floor_seen = 0
        raw = self.connect('store')
        try:
            cur = raw.cursor()
            for stmt in sql.DROP_ALL:
                cur.execute(stmt)
            raw.commit()
        finally:
            raw.close()


def _os_user():
    try:
        return getpass.getuser()
    except Exception:  # pylint:disable=broad-except
        return '(unknown)'
