"""MySQL / MariaDB adapter (InnoDB).

MariaDB 10.6+ and MySQL 8.0+ are supported; which one we talk to is read
from the server version at the first connection, and decides the few
statements that differ (``MariaDBStatements`` / ``MySQL8Statements``) and
how lock waits are bounded (``SET STATEMENT ... FOR`` on MariaDB, a session
``innodb_lock_wait_timeout`` set and restored around the lock on MySQL).

Connections, by purpose:

``load``   REPEATABLE READ; every transaction is one
           ``START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY``.
``store``  READ COMMITTED, autocommit off, with a ``temp_store`` TEMPORARY
           table.  Vote locks the current rows it changes (``FOR UPDATE``)
           and the rows read with readCurrent (shared), in OID order,
           then, last, ``commit_lock``'s rows 0 (the commit lock) and 1
           (the pack mark, read with it), held until the COMMIT in finish.
``oid``    READ COMMITTED, autocommit on: OIDs come from an AUTO_INCREMENT
           table, whose values are never rolled back.

Every session runs in UTC.  Uploads (states, blob chunks) and row-lock
IN lists are written into the statement text (states as hex literals)
rather than bound through the driver, which is much slower per value (see
``upload``); other statements bind parameters, bytes as ``_binary`` literals.
The server's ``max_allowed_packet`` is read at connect: uploads are split
into multi-row INSERTs below it, and a state larger than it fails at vote
with StateTooLargeError.
"""
import logging
import os
import math
import re
from binascii import hexlify
from contextlib import contextmanager

from ...interfaces import DisconnectedError
from ...interfaces import RelStorageError
from ...interfaces import SchemaMismatchError
from ...interfaces import StateTooLargeError
from ...options import blob_chunk_bytes
from ..base import Adapter
from ..base import _one_line
from ..base import earlier_release_schema
from ..servers import with_server
from . import drivers
from . import sql

log = logging.getLogger(__name__)

#: Keys accepted by the constructor (those of the <mysql> config section).
CONNECT_KEYS = drivers.CONNECT_KEYS
DEFAULT_CONNECT_TIMEOUT = 10
#: The most seconds MariaDB's idle_write_transaction_timeout takes (a year).
MAX_IDLE_SECONDS = 31536000
#: Bytes kept free in every statement for its text and the packet header.
PACKET_MARGIN = 1024
#: Bytes of one temp_store row in an upload besides its state's hex digits:
#: two 20-digit numbers, the X'' quotes, parentheses and commas.
ROW_OVERHEAD = 50
#: Bytes of a statement of insert_new_objects besides its states' hex
#: digits, for one row: the INSERT's text (73 at most) and the row's three
#: 20-digit numbers, the X'' quotes, parentheses and commas (70), rounded up.
NEW_ROW_OVERHEAD = 160

#: The sql_mode of every session: the statements are written for it (a
#: server's default may hold modes that change what they do).
SQL_MODE = 'STRICT_TRANS_TABLES,NO_ENGINE_SUBSTITUTION'


class ServerInfo:
    """What the server told us about itself at the first connection."""

    def __init__(self, version_string):
        text = version_string or ''
        # Old replication handshakes prefix MariaDB versions with "5.5.5-".
        if text.startswith('5.5.5-'):
            text = text[6:]
        self.version_string = text
        self.is_mariadb = 'mariadb' in text.lower()
        match = re.match(r'(\d+)\.(\d+)(?:\.(\d+))?', text)
        self.version = tuple(int(g or 0) for g in match.groups()) if match else (0, 0, 0)
        self.flavor = 'MariaDB' if self.is_mariadb else 'MySQL'
        #: MariaDB scopes a variable to one statement with SET STATEMENT.
        self.supports_set_statement = self.is_mariadb
        #: MariaDB (10.3+) ends a session idle in a transaction that wrote
        #: (idle_write_transaction_timeout).
        self.ends_idle_writers = self.is_mariadb
        #: Name of the session isolation variable.
        if self.is_mariadb and self.version < (11, 1):
            self.isolation_variable = 'tx_isolation'
            self.read_only_variable = 'tx_read_only'
        else:
            self.isolation_variable = 'transaction_isolation'
            self.read_only_variable = 'transaction_read_only'

    @property
    def statements_class(self):
        return sql.MariaDBStatements if self.is_mariadb else sql.MySQL8Statements

    def check_supported(self):
        minimum = (10, 6) if self.is_mariadb else (8, 0)
        if self.version[:2] < minimum:
            log.warning("%s %s is older than the oldest supported release (%s); "
                        "RelStorage may not work with it.", self.flavor,
                        self.version_string, '.'.join(map(str, minimum)))

    def __repr__(self):
        return '<%s %s>' % (self.flavor, self.version_string)


class MySQLAdapter(Adapter):
    vendor = 'mysql'
    identifier_quote = '`'
    has_host = True
    max_in_list = 1000
    # Binding costs a Python call per value in either driver (with
    # mysqlclient, 100 lists of 1000: 0.10 s bound, 0.03 s as text).
    oid_lists_as_text = True
    #: Most rows in one multi-row INSERT (the byte size is bounded by
    #: max_allowed_packet as well).
    upload_batch = 1000
    statements_class = sql.MySQLStatements
    earlier_release_reads = sql.MySQLEarlierReleaseReads
    temp_table_statements = (sql.TEMP_STORE, sql.TEMP_BLOB_CHUNK)
    # InnoDB never purges the rows deleted from a TEMPORARY table while its
    # session lives: every later DELETE or INSERT ... SELECT over the table
    # scans them all, so clearing temp_store got slower with each
    # transaction a connection had committed (MariaDB 10.11: 0.2 ms per
    # clear after 1,000 transactions of 10 rows, 2.5 ms after 10,000).
    temp_garbage_rows = 5000
    # wait_timeout ends a held transaction's idle session.
    holds_locks_for_retry = True

    @property
    def ends_idle_store_transactions(self):
        # (Known once connected.)
        return self.server is not None and self.server.ends_idle_writers

    def __init__(self, options=None, driver=None, **connect_kwargs):
        self._params = {}
        self.server = None
        super().__init__(options)
        unknown = set(connect_kwargs) - set(CONNECT_KEYS)
        if unknown:
            raise RelStorageError("Unknown MySQL connection parameter(s): %s"
                                  % ', '.join(sorted(unknown)))
        self.driver = drivers.select_driver(driver or getattr(self.options, 'driver', 'auto'))
        self._params = {k: v for k, v in connect_kwargs.items() if v is not None}
        self._params.setdefault('connect_timeout', DEFAULT_CONNECT_TIMEOUT)
        # (A helper agent's checks: a missing db was the server's "No
        # database selected" from deep in the driver; a misspelt option
        # file was ignored, and the connection made without what it says,
        # TLS included.)
        option_file = self._params.get('read_default_file')
        if option_file and not os.path.isfile(os.path.expanduser(option_file)):
            raise RelStorageError("read_default_file: %s is not a file (the MySQL option "
                                  "file it names must exist)" % option_file)
        if not self._params.get('db') and not option_file \
                and not self._params.get('read_default_group'):
            # (With read_default_group, the drivers read the default option
            # files, which may name it.)
            raise RelStorageError("<mysql> needs db: the name of the database to use "
                                  "(or an option file, read_default_file or "
                                  "read_default_group, that names it)")
        if self._params.get('port') and self._params.get('host', 'localhost') == 'localhost' \
                and not self._params.get('unix_socket') and self.driver.name == 'MySQLdb':
            log.warning("<mysql> host localhost with port %s: the MySQLdb driver connects "
                        "to the default Unix socket for localhost and does not use the "
                        "port; write host 127.0.0.1 to connect to that port over TCP",
                        self._params['port'])
        self.server = None
        self.max_allowed_packet = None
        self._oid_high = 0          # every OID <= this is already allocated
        # Counter values drawn per round trip (see allocate_oid_block).
        self._oid_values = 1
        self._oid_values_max = 1
        self._warned_blob_chunk = False

    # ------------------------------------------------------------------
    # Description and connections.

    def describe(self, server=None):
        params = self._server_params(self.described_server(server))
        # (Before the first connection, which server it is is not known: a
        # helper agent saw one server called MySQL, then MariaDB.)
        flavor = self.server.flavor if self.server is not None else 'MySQL/MariaDB'
        option_file = params.get('read_default_file')
        if option_file:
            # What the file sets is not known here: name only what the
            # section sets, and the file (a helper agent's check: the
            # defaults named the wrong server and user).
            parts = ['%s=%s' % (key, params[key]) for key in ('db', 'host', 'port', 'user')
                     if params.get(key) is not None]
            if params.get('unix_socket'):
                parts.append('socket %s' % params['unix_socket'])
            return "%s database (%sthe rest from %s)" % (
                flavor, ''.join(part + ', ' for part in parts), option_file)
        host = params.get('host', 'localhost')
        if params.get('unix_socket'):
            where = 'socket %s' % params['unix_socket']
        elif host == 'localhost' and self.driver.name == 'MySQLdb':
            # libmysqlclient goes to its default Unix socket for the name
            # localhost, whatever the port (a helper agent's check: one
            # section reached the shared server with MySQLdb and the
            # private one on the port with PyMySQL).
            where = 'localhost (the default Unix socket; write host 127.0.0.1 for TCP)'
        else:
            where = ('[%s]:%s' if ':' in str(host) else '%s:%s') % (
                host, params.get('port', 3306))
        return "%s database %r at %s as user %r" % (
            flavor, params.get('db', ''), where, params.get('user', ''))

    def _server_params(self, server):
        return with_server(self._params, server, drop=('unix_socket',), port_type=int)

    def connect_to(self, server, purpose):
        try:
            raw = self.driver.connect(self._server_params(server))
        except self.driver.Error as exc:
            message = "Cannot connect to %s: %s" % (self.describe(server), _one_line(exc))
            if drivers.is_config_error(self.driver.errno(exc), str(exc)):
                raise RelStorageError(message) from exc
            raise DisconnectedError(message) from exc
        try:
            read_only = self._setup_session(raw, purpose)
            if (read_only and server is not None and purpose != 'load'
                    and not self.options.read_only):
                # With replica-conf: a server that takes no writes (a
                # replica not promoted, or the old primary set read-only)
                # does not answer for writes; the next of the list is
                # tried.  (A helper agent's check: once in use after a
                # short outage of the first server, it refused every
                # commit until replica-timeout.  PostgreSQL's standby
                # refuses the store session's read-write begin.)  Not for
                # a read-only storage, which writes nothing (a review
                # finding: one whose replica-conf named a replica was
                # refused at open).
                raise DisconnectedError(
                    "%s is read-only (read_only is set: a replica not promoted yet?)"
                    % self.describe(server))
        except BaseException as exc:
            try:
                raw.close()
            except Exception:  # pylint:disable=broad-except
                pass
            if isinstance(exc, self.driver.Error):
                raise DisconnectedError("Cannot set up a %s connection to %s: %s"
                                        % (purpose, self.describe(server),
                                           _one_line(exc))) from exc
            raise
        return raw

    def _setup_session(self, raw, purpose):
        if self.server is None:
            server = ServerInfo(raw.get_server_info())
            server.check_supported()
            self.sql = server.statements_class(self.keep_history)
            self._q_cache = {}
            self.server = server
        level = 'REPEATABLE-READ' if purpose == 'load' else 'READ-COMMITTED'
        # The statements are written for this sql_mode, whatever the
        # server's default (a helper agent's check: with MariaDB's
        # EMPTY_STRING_IS_NULL in it, every history-preserving commit with
        # an empty user name failed, and the pack's writes).
        settings = "SET time_zone = '+00:00', @@session.%s = '%s', @@session.sql_mode = '%s'" % (
            self.server.isolation_variable, level, SQL_MODE)
        # So are the other session defaults a DBA may set for the server
        # (a helper agent's checks): sql_select_limit cut every statement
        # without a LIMIT short, silently (a pack's reading of references,
        # a poll, an undo, a copy: a pack removed reachable objects);
        # sql_safe_updates refused DELETE FROM temp_store;
        # completion_type RELEASE ended the session at each COMMIT; and a
        # read-only default refused every write.
        settings += (", @@session.sql_select_limit = %d, @@session.sql_safe_updates = 0, "
                     "@@session.completion_type = 0" % (2 ** 64 - 1))
        if purpose != 'load':
            settings += ', @@session.%s = 0' % self.server.read_only_variable
        if purpose == 'store' and self.server.ends_idle_writers:
            # (See Adapter.store_idle_seconds.  Only transactions that
            # wrote: a read-only one holds no lock.  MySQL has no such
            # limit, only wait_timeout, which ends idle sessions too.)
            settings += ', @@session.idle_write_transaction_timeout = %d' % int(
                math.ceil(min(self.store_idle_seconds(), MAX_IDLE_SECONDS)))
        cur = raw.cursor()
        try:
            cur.execute(settings)
            cur.execute("SELECT @@session.max_allowed_packet, @@log_bin, "
                        "@@session.binlog_format, @@global.read_only")
            packet, log_bin, binlog_format, read_only = cur.fetchone()
        finally:
            cur.close()
        self._note_max_allowed_packet(int(packet))
        if purpose != 'load':
            self.statement_binlog = (str(log_bin) in ('1', 'ON')
                                     and str(binlog_format).upper() == 'STATEMENT')
        if purpose == 'oid':
            self._oid_values_max = self._consecutive_values(raw)
        raw.autocommit(purpose == 'oid')
        raw.commit()
        # (Later MariaDB releases spell some read-only levels out.)
        if isinstance(read_only, bytes):
            read_only = read_only.decode('ascii', 'replace')
        return str(read_only).upper() not in ('0', 'OFF', 'NONE', '')

    @staticmethod
    def _consecutive_values(raw):
        """How many counter values one INSERT of several rows may draw:
        sql.OID_VALUES_MAX when the server gives such an insert consecutive
        values (InnoDB's traditional or consecutive auto-increment lock
        mode, step 1), else 1.  Interleaved mode, or a step other than 1
        (Galera sets one per node), could give values apart, and the block
        of each value we did not get would be another session's."""
        cur = raw.cursor()
        try:
            cur.execute("SELECT @@innodb_autoinc_lock_mode, @@session.auto_increment_increment")
            mode, step = cur.fetchone()
            consecutive = int(mode) in (0, 1) and int(step) == 1
        except (raw.Error, TypeError, ValueError):
            log.info("Cannot read the auto-increment lock mode; OIDs drawn one block "
                     "per round trip", exc_info=True)
            return 1
        finally:
            cur.close()
        return sql.OID_VALUES_MAX if consecutive else 1

    def _note_max_allowed_packet(self, packet):
        self.max_allowed_packet = packet
        chunk = blob_chunk_bytes(self.options, warn=False)
        if (chunk and chunk * self.driver.literal_factor > packet - PACKET_MARGIN
                and not self._warned_blob_chunk):
            self._warned_blob_chunk = True
            log.warning("blob-chunk-size (%d bytes) exceeds what the server's "
                        "max_allowed_packet (%d bytes) accepts in one statement "
                        "at %s with the %s driver; lower blob-chunk-size or "
                        "raise max_allowed_packet.",
                        chunk, packet, self.describe(), self.driver.name)

    def _reconnect(self, conn):
        """Replace the dead driver connection inside ``conn``."""
        conn.adopt(self.open_store() if conn.purpose == 'store'
                   else self.open_connection(conn.purpose))

    def start_snapshot(self, conn):
        conn.execute('START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY')

    def begin_store(self, conn, writes_data=True, durable=True):
        # Nothing of this transaction has reached the server yet, so a
        # connection that died since the last one (server restart, idle
        # timeout, KILL) is simply replaced.
        try:
            conn.execute('START TRANSACTION')
        except DisconnectedError:
            log.info("Reconnecting the store connection to %s", self.describe())
            self._reconnect(conn)
            if writes_data:
                # (A new session: the old one's temporary tables went
                # with it.)
                self.prepare_temp_tables(conn)
            conn.execute('START TRANSACTION')

    def classify_error(self, exc):
        return drivers.classify_error(self.driver, exc)

    def translate_error(self, exc, conn):
        if self.driver.errno(exc) == drivers.PACKET_TOO_LARGE:
            conn.broken = True
            return StateTooLargeError(
                "A statement sent to %s was larger than the server's "
                "max_allowed_packet (%s bytes); raise max_allowed_packet. "
                "The connection was closed by the server: %s"
                % (self.describe(), self.max_allowed_packet, _one_line(exc)))
        if self.driver.errno(exc) == drivers.OPTION_PREVENTS_STATEMENT and \
                self.classify_error(exc) == 'disconnect':
            # (Said as it is, not as a lost connection: a review finding.)
            conn.broken = True
            where = self.describe() if conn.server is None else self.describe(conn.server)
            return DisconnectedError(
                "%s refused a write: it is read-only (a replica not promoted yet?); "
                "nothing of the transaction was written (%s)" % (where, _one_line(exc)))
        return super().translate_error(exc, conn)

    # ------------------------------------------------------------------
    # Schema.

    def schema_statements(self):
        return sql.HISTORY_PRESERVING_SCHEMA if self.keep_history else sql.HISTORY_FREE_SCHEMA

    #: Whether the server logs a writing session's statements as they are
    #: (binary log on, binlog_format STATEMENT), seen as one opened.
    statement_binlog = False

    def check_can_write(self, conn):
        if self.statement_binlog:
            # A helper agent's check: the schema's creation failed half-way
            # with the driver's error 1665, and a database created before
            # the change failed at every commit's vote.
            raise RelStorageError(
                "%s writes its binary log with binlog_format STATEMENT, where InnoDB "
                "refuses the writes of a READ COMMITTED transaction, which RelStorage's "
                "commits are: set binlog_format to ROW or MIXED (or open this storage "
                "read-only). Nothing was changed." % self.describe())

    def required_tables(self):
        return super().required_tables() | {'new_oid'}

    # information_schema lists the tables a user has some privilege on.
    lists_usable_tables_only = True

    #: The stored procedures of RelStorage 3.x and 4.x (seen in a database
    #: of this release that a process of 4.3 opened).
    EARLIER_ROUTINES = (
        'clean_temp_state', 'lock_and_choose_tid', 'lock_and_choose_tid_and_move',
        'lock_and_choose_tid_p', 'lock_database_for_commit',
        'lock_objects_and_detect_conflicts', 'make_current_tid', 'make_tid_for_epoch',
        'set_min_oid')

    def earlier_leftovers(self, conn):
        found = [('view %s' % _text(name), 'DROP VIEW `%s`;' % _text(name))
                 for (name,) in conn.query_all(
                     "SELECT table_name FROM information_schema.views "
                     "WHERE table_schema = DATABASE() ORDER BY 1")
                 if _text(name).lower() in self.EARLIER_VIEWS]
        found += [('%s %s' % (_text(kind).lower(), _text(name)),
                   'DROP %s `%s`;' % (_text(kind), _text(name)))
                  for name, kind in conn.query_all(
                      "SELECT routine_name, routine_type FROM information_schema.routines "
                      "WHERE routine_schema = DATABASE() ORDER BY 1")
                  if _text(name).lower() in self.EARLIER_ROUTINES]
        return found

    def list_tables(self, conn):
        names = set()
        other_engines = []
        for name, engine in conn.query_all(self.sql.LIST_TABLES):
            name = _text(name).lower()
            names.add(name)
            engine = _text(engine) if engine is not None else None
            if name in sql.ALL_TABLES and engine and engine.lower() != 'innodb':
                other_engines.append((name, engine))
        # (An earlier release's schema is only read, and never changed:
        # prepare_schema says what it is.)
        if other_engines and earlier_release_schema(names) is None:
            name, engine = other_engines[0]
            raise SchemaMismatchError(
                "Table %s at %s uses the %s storage engine; RelStorage needs "
                "InnoDB (transactions and row locks). Convert it with "
                "ALTER TABLE %s ENGINE = InnoDB." % (name, self.describe(), engine, name))
        return names

    def drop_all(self):
        conn = self.open_connection('store')
        try:
            # Never wait forever for another session's metadata lock.
            conn.execute('SET SESSION lock_wait_timeout = %d' % self._lock_timeout_seconds())
            conn.execute('DROP TABLE IF EXISTS %s' % ', '.join(sql.ALL_TABLES))
            conn.commit()
        finally:
            conn.close()
        self.close()
        with self._oid_lock:
            self._oid_block = []
            self._oid_high = 0

    # ------------------------------------------------------------------
    # OIDs.

    def forget_oid_floor(self):
        self._oid_high = 0

    def allocate_oid_block(self, conn):
        # (The base retries once on a new connection if this one died.)
        # Each round trip is a durable commit (a log flush) of the OID
        # connection: a process that allocates many OIDs draws more values
        # per trip, 1, 2, 4... up to OID_VALUES_MAX (2048 OIDs), while one
        # that allocates a few leaves a small gap when it exits.
        count = min(self._oid_values, self._oid_values_max)
        conn.execute(self.sql.NEW_OID_BLOCKS_PREFIX + ','.join(['()'] * count))
        # The first value of the insert; the others follow it (see
        # _consecutive_values).
        n = conn.cursor.lastrowid
        last_n = n + count - 1
        self._oid_values = min(count * 2, sql.OID_VALUES_MAX)
        # Keep the newest row: an empty table could restart the counter
        # after a server restart on old servers.  Pruned when a value drawn
        # is a multiple of OID_PRUNE_EVERY only (by whichever process draws
        # it): a round trip per block doubled the cost of allocating.
        if last_n // sql.OID_PRUNE_EVERY != (n - 1) // sql.OID_PRUNE_EVERY:
            conn.execute(self.sql.PRUNE_OID_BLOCKS, (last_n,))
        first = (n - 1) * sql.OID_BLOCK + 1
        last = last_n * sql.OID_BLOCK
        self._oid_high = max(self._oid_high, last)
        return list(range(first, last + 1))

    def raise_oid_floor(self, conn, max_oid):
        if max_oid <= self._oid_high:
            return      # the counter is already past it
        # Blocks numbered above ceil(max_oid / OID_BLOCK) start after max_oid.
        block = -(-max_oid // sql.OID_BLOCK)
        conn.execute(self.sql.RAISE_OID_BLOCK, (block,))
        self._oid_high = max(self._oid_high, block * sql.OID_BLOCK)

    # ------------------------------------------------------------------
    # Locks.

    def _lock_timeout_seconds(self):
        # InnoDB counts whole seconds, at least one.
        return max(1, int(math.ceil(float(self.options.commit_lock_timeout))))

    @contextmanager
    def _bounded_lock_wait(self, conn):
        """Yield a function wrapping a locking statement so that its lock
        waits end after commit-lock-timeout; the session's own
        innodb_lock_wait_timeout is in force again afterwards."""
        seconds = self._lock_timeout_seconds()
        if self.server.supports_set_statement:
            # (And no max_statement_time, which a DBA may set for the
            # user: a helper agent's check saw commits waiting for the
            # commit lock cut off at 0.2 s, not commit-lock-timeout, with
            # an error nothing retries.  The wait is bounded anyway.)
            prefix = ('SET STATEMENT innodb_lock_wait_timeout = %d, max_statement_time = 0 FOR '
                      % seconds)
            yield lambda stmt: prefix + stmt
            return
        previous = conn.query_value('SELECT @@session.innodb_lock_wait_timeout')
        conn.execute('SET SESSION innodb_lock_wait_timeout = %d' % seconds)
        failed = False
        try:
            yield lambda stmt: stmt
        except BaseException:
            failed = True
            raise
        finally:
            try:
                conn.execute('SET SESSION innodb_lock_wait_timeout = %d' % int(previous))
            except Exception:  # pylint:disable=broad-except
                if not failed:
                    raise
                log.debug("Could not restore innodb_lock_wait_timeout", exc_info=True)

    def lock_objects(self, conn, oids, read_current_oids):
        oids = sorted(oids)
        read_current_oids = sorted(read_current_oids)
        current = {}
        if not oids and not read_current_oids:
            return current
        with self._bounded_lock_wait(conn) as bounded:
            for stmt, group in ((self.sql.LOCK_CURRENT_EXCLUSIVE, oids),
                                (self.sql.LOCK_CURRENT_SHARED, read_current_oids)):
                for text, params in self.oid_statements(stmt, group):
                    current.update(conn.query_all(bounded(text), params))
        return current

    def lock_commit(self, conn):
        with self._bounded_lock_wait(conn) as bounded:
            return conn.query_value(bounded(self.sql.LOCK_COMMIT)) or 0

    def lock_commit_marked(self, conn):
        # One locking read of both rows: it returns their newest committed
        # values, whenever the statement began (a plain read of the mark in
        # it would not).  A pack batch moves the mark on only once it holds
        # the commit lock, so the mark's row is never waited for.
        with self._bounded_lock_wait(conn) as bounded:
            rows = dict(conn.query_all(bounded(self.sql.LOCK_COMMIT_MARKED)))
        return rows.get(0) or 0, rows.get(1) or 0

    def socket_fd(self, raw):
        return self.driver.socket_fd(raw)

    def hold_locks(self, conn, seconds):
        # MySQL has no limit on an idle transaction, only on an idle
        # session: shorten it (the server closing the session rolls the
        # transaction back) and keep the session's own value for end_hold.
        conn.execute('SET @rs_wait_timeout = @@session.wait_timeout, '
                     'SESSION wait_timeout = %d' % max(1, int(math.ceil(seconds))))

    def end_hold(self, conn):
        conn.execute('SET SESSION wait_timeout = @rs_wait_timeout')

    # ------------------------------------------------------------------
    # Pack.

    def stream_query(self, conn, sql, params, batch=1000):
        """Rows streamed with an unbuffered cursor (the default cursors of
        both drivers read the whole result into memory first)."""
        cursor = conn.raw.cursor(self.driver.streaming_cursor())
        return self.stream_rows(conn, cursor, sql, batch, params)

    def pack_schema(self):
        return sql.PACK_SCHEMA

    def pack_temp_tables(self):
        return sql.PACK_TEMP_TABLES

    def clear_pack_temp(self, conn, name):
        # See temp_garbage_rows: deleted rows of a temporary table are never
        # purged, and the pack's work tables see millions.  Neither
        # statement commits for a TEMPORARY table.
        conn.execute('DROP TEMPORARY TABLE IF EXISTS %s' % name)
        conn.execute(sql.PACK_TEMP_TABLES[name])

    # ------------------------------------------------------------------
    # Upload.

    def upload(self, conn, rows):
        """Multi-row INSERTs into temp_store, each below max_allowed_packet.

        The statement text is built here, states as hexadecimal literals
        (``X'...'``), and sent without driver parameters.  Binding each value
        through the driver costs a Python call per value and, with
        mysqlclient, ``mysql_real_escape_string`` under the utf8mb4 charset
        (a multibyte check per byte) plus the server's slower parsing of
        escaped strings: measured on a 100,000-row upload of 190-byte states,
        1.16 s with bound parameters against 0.40 s like this (PyMySQL,
        which already sends hex, 0.58 s).  Hex doubles the bytes on the wire,
        which the statement budget below accounts for.

        A state too big for a statement of its own (but within the packet
        limit) is sent in pieces appended with CONCAT; a state larger than
        max_allowed_packet cannot be stored at all.
        """
        budget = self.max_allowed_packet - PACKET_MARGIN
        prefix = self.sql.INSERT_TEMP_MANY
        limit = self.upload_batch
        batch = []
        size = len(prefix)
        for oid, prev_tid, state in rows:
            if state is None:
                row_size = ROW_OVERHEAD
            else:
                if len(state) > budget:
                    self._state_too_large(conn, oid, len(state))
                row_size = ROW_OVERHEAD + 2 * len(state)
            if len(prefix) + row_size > budget:
                self._insert_rows(conn, prefix, batch)
                batch, size = [], len(prefix)
                self._upload_in_pieces(conn, oid, prev_tid, state, budget)
                continue
            if batch and (size + row_size > budget or len(batch) >= limit):
                self._insert_rows(conn, prefix, batch)
                batch, size = [], len(prefix)
            batch.append((oid, prev_tid, state))
            size += row_size
        self._insert_rows(conn, prefix, batch)

    def _insert_rows(self, conn, prefix, batch):
        if not batch:
            return
        values = b','.join([
            b"(%d,%d,X'%b')" % (oid, prev_tid, hexlify(state)) if state is not None
            else b'(%d,%d,NULL)' % (oid, prev_tid)
            for oid, prev_tid, state in batch])
        # No parameters (None): neither driver then scans the text for
        # placeholders.
        conn.execute(prefix.encode('ascii') + values, None)

    @property
    def new_rows_direct_bytes(self):
        # insert_new_objects never splits a state: each must fit in a
        # statement of its own, as hexadecimal.  (Not known before the
        # first connection; a commit has its store connection by then.)
        if not self.max_allowed_packet:
            return 0
        return max(0, min(Adapter.new_rows_direct_bytes,
                          (self.max_allowed_packet - PACKET_MARGIN - NEW_ROW_OVERHEAD) // 2))

    def insert_new_objects(self, conn, tid, rows):
        # Statement text built as in upload(), for the same reasons.
        sql = self.sql
        if self.keep_history:
            values = [b"(%d,%d,0,%d,X'%b')" % (oid, tid, len(state), hexlify(state))
                      for oid, state in rows]
        else:
            values = [b"(%d,%d,%d,X'%b')" % (oid, tid, len(state), hexlify(state))
                      for oid, state in rows]
        self._insert_text_rows(conn, sql.NEW_OBJECT_STATES, values)
        if self.keep_history:
            self._insert_text_rows(conn, sql.NEW_OBJECT_CURRENTS,
                                   [b'(%d,%d)' % (oid, tid) for oid, _ in rows])

    def _insert_text_rows(self, conn, prefix, values):
        """Multi-row INSERTs of the ``values`` rows (bytes: each fits in a
        statement of its own, see new_rows_direct_bytes), as few as the
        packet and upload_batch allow."""
        prefix = prefix.encode('ascii')
        budget = self.max_allowed_packet - PACKET_MARGIN
        batch, size = [], len(prefix)
        for value in values:
            if batch and (size + len(value) + 1 > budget or len(batch) >= self.upload_batch):
                conn.execute(prefix + b','.join(batch), None)
                batch, size = [], len(prefix)
            batch.append(value)
            size += len(value) + 1
        if batch:
            conn.execute(prefix + b','.join(batch), None)

    def _upload_in_pieces(self, conn, oid, prev_tid, state, budget):
        piece = max(1, (budget - 200) // 2 - 16)
        conn.execute(self.sql.INSERT_TEMP_MANY + '(%s,%s,%s)',
                     (oid, prev_tid, state[:piece]))
        for start in range(piece, len(state), piece):
            conn.execute(self.sql.APPEND_TEMP_STATE, (state[start:start + piece], oid))

    def upload_blob_chunk(self, conn, oid, chunk_num, data):
        if self.driver.bytes_literal_size(data) + 200 > self.max_allowed_packet - PACKET_MARGIN:
            conn.close()
            raise StateTooLargeError(
                "A blob chunk of %d bytes does not fit in one statement to %s, "
                "whose max_allowed_packet is %d bytes: lower blob-chunk-size or "
                "raise max_allowed_packet." % (len(data), self.describe(),
                                               self.max_allowed_packet))
        if 2 * len(data) + 200 <= self.max_allowed_packet - PACKET_MARGIN:
            # A hex literal, for the reasons given in upload(): with
            # mysqlclient, 20 chunks of 1 MB took 0.72 s bound (escaped)
            # and 0.30 s as hex.
            self.note_temp_rows(conn, 1, len(data), 'temp_blob_chunk')
            conn.execute(b"INSERT INTO temp_blob_chunk (zoid, chunk_num, chunk) "
                         b"VALUES (%d,%d,X'%b')" % (oid, chunk_num, hexlify(data)), None)
        else:
            # Only the escaped form fits (mysqlclient): bind it.
            super().upload_blob_chunk(conn, oid, chunk_num, data)

    def check_metadata_room(self, user, description, extension):
        # A helper agent's check: metadata larger than max_allowed_packet
        # made the server drop the connection ("Server has gone away"), a
        # DisconnectedError, which transaction managers retry in vain.
        # (Sized as the driver writes them: escaped, or in hexadecimal.)
        if not self.max_allowed_packet:
            return
        size = sum(self.driver.bytes_literal_size(bytes(value))
                   for value in (user, description, extension) if value)
        if size + PACKET_MARGIN > self.max_allowed_packet:
            raise StateTooLargeError(
                "The transaction's metadata (user, description and extension) is "
                "%d bytes, more than %s accepts in one statement: its max_allowed_packet "
                "is %d bytes. Raise max_allowed_packet on the server, or note less "
                "in the transaction." % (size, self.describe(), self.max_allowed_packet))

    def _state_too_large(self, conn, oid, size):
        # Nothing of this transaction is committed: discard the connection
        # (the server rolls back) and let the storage open a new one.
        conn.close()
        # (The limit said is the one checked: a helper agent's check found
        # "16776960 bytes, more than ... accepts: its max_allowed_packet is
        # 16777216 bytes".)
        raise StateTooLargeError(
            "The state of object 0x%x is %d bytes, more than the %d bytes %s "
            "accepts in one object (its max_allowed_packet, %d bytes, less %d for "
            "the statement). Raise max_allowed_packet on the server, or store "
            "less in one object."
            % (oid, size, self.max_allowed_packet - PACKET_MARGIN, self.describe(),
               self.max_allowed_packet, PACKET_MARGIN))


def _text(value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode('utf-8', 'replace')
    return value
