"""The Oracle adapter: offline checks always, the shared suite on a server.

No Oracle server runs on the development machines or in CI, so most of
this module checks the adapter without one:

- ``StatementTests`` drives every adapter verb, in both history modes, on a
  recording stand-in for the driver connection, and parses every statement
  the adapter sends (schema DDL, named statements, IN lists, pack and
  zodbconvert verbs) with sqlglot's ``oracle`` dialect, exactly as sent
  (numbered binds).  A statement that does not parse fails, and so does a
  statement whose binds are not ``:1 .. :n`` for the ``n`` values the code
  passes with it;
- ``DriverTests`` / ``ErrorTests`` / ``ConfigTests`` check driver selection,
  DSN handling, password redaction and the ORA-/DPY- error mapping with
  python-oracledb's real exception and connection-parameter classes (a
  connection refused by a closed local port is a real driver error).

The shared suite (``suite.make_suite``) runs against a staging server when
RS_TEST_DATABASES names ``oracle`` and RS_ORACLE_DSN, RS_ORACLE_USER and
RS_ORACLE_PASSWORD are set.  That user must be allowed to create and drop
users: each test database is a schema of its own (``RSTEST_<pid>...``),
dropped when the process exits.  When RS_TEST_DATABASES does not name
oracle (it does not by default), the server suite is skipped with the
reason printed; when it does but the variables are missing, that fails.
"""
import atexit
import os
import re
import secrets
import socket
import sys
import logging
import shutil
import tempfile
import unittest

import sqlglot
from sqlglot.dialects.oracle import Oracle
from sqlglot.errors import ErrorLevel
from sqlglot.expressions import Command
from sqlglot.expressions import Placeholder
from sqlglot.tokens import TokenType
import transaction.interfaces
from ZODB import POSException
from ZODB.Connection import TransactionMetaData
from ZODB.tests.MinPO import MinPO
from ZODB.tests.StorageTestBase import zodb_pickle
from ZODB.utils import z64

from relstorage import config
from relstorage.adapters.oracle import drivers
from relstorage.adapters.oracle import sql
from relstorage.adapters.oracle.adapter import OracleAdapter
from relstorage.adapters.oracle.adapter import OracleConnectError
from relstorage.adapters.oracle.adapter import OracleLoginError
from relstorage.interfaces import DisconnectedError
from relstorage.interfaces import PermissionDeniedError
from relstorage.interfaces import RelStorageError
from relstorage.options import Options
from relstorage.storage import RelStorage

from . import core_cases as suite_cases
from . import suite

SERVER_VARIABLES = ('RS_ORACLE_DSN', 'RS_ORACLE_USER', 'RS_ORACLE_PASSWORD')


class OracleBinds(Oracle):
    """sqlglot's Oracle dialect plus numbered binds (``:1``), which Oracle
    accepts and sqlglot's tokenizer does not yet (it knows ``:name``)."""

    class Parser(Oracle.Parser):
        COLON_PLACEHOLDER_TOKENS = Oracle.Parser.COLON_PLACEHOLDER_TOKENS | {TokenType.NUMBER}


def parse_oracle(stmt):
    """The one statement in ``stmt``, parsed; raises on anything sqlglot's
    Oracle grammar does not accept (including its opaque Command fallback)."""
    trees = sqlglot.parse(stmt, read=OracleBinds, error_level=ErrorLevel.RAISE)
    if len(trees) != 1 or trees[0] is None:
        raise AssertionError('expected one statement: %r' % stmt)
    if isinstance(trees[0], Command):
        raise AssertionError('sqlglot only knows this as an opaque command: %r' % stmt)
    return trees[0]


def non_oracle_constructs(tree):
    """What ``tree`` uses that sqlglot's lenient Oracle parser accepts but
    Oracle Database 19c does not run (or not on our BLOB columns)."""
    from sqlglot import exp
    found = []
    for node in tree.walk():
        if isinstance(node, exp.Limit):
            found.append('LIMIT (Oracle: FETCH FIRST n ROWS ONLY)')
        elif isinstance(node, exp.OnConflict):
            found.append('ON CONFLICT / ON DUPLICATE KEY (Oracle: MERGE)')
        elif isinstance(node, exp.Returning):
            found.append('RETURNING without INTO')
        elif isinstance(node, exp.Boolean):
            found.append('TRUE/FALSE literals (no SQL BOOLEAN before 23ai)')
        elif isinstance(node, (exp.Any, exp.Array)):
            found.append('array binds')
        elif isinstance(node, exp.Lock) and not node.args.get('update'):
            found.append('FOR SHARE (Oracle has no shared row lock)')
        elif isinstance(node, (exp.Create, exp.Drop)) and node.args.get('exists'):
            found.append('IF [NOT] EXISTS (not before 23ai)')
        elif isinstance(node, exp.Length):
            found.append('LENGTH (does not accept a BLOB: DBMS_LOB.GETLENGTH)')
    return found


def check_oracle(stmt):
    """Parse ``stmt`` as Oracle and refuse what Oracle would not run."""
    tree = parse_oracle(stmt)
    found = non_oracle_constructs(tree)
    if found:
        raise AssertionError('not Oracle SQL (%s): %r' % ('; '.join(found), stmt))
    return tree


def bind_numbers(stmt):
    """Numbers of the ``:n`` binds of ``stmt`` in the order they appear."""
    tokens = OracleBinds().tokenize(stmt)
    return [int(nxt.text) for tok, nxt in zip(tokens, tokens[1:])
            if tok.token_type == TokenType.COLON and nxt.token_type == TokenType.NUMBER]


def oracle_error(message, code):
    """The exception python-oracledb raises for a server error ``message``."""
    from oracledb import errors
    err = errors._Error(message, code=code)
    return err.exc_type(err)


# ----------------------------------------------------------------------
# A recording stand-in for the driver connection.

class Recorder:
    """Answers queries the way an Oracle schema would, closely enough for
    the verbs to run, and records every statement with its parameters."""

    def __init__(self):
        self.calls = []            # (sql, [param rows], many)
        self.tables = set()
        self.sequence = 0
        self.pack_mark = None
        self.fail = None           # (substring, exception): raised when sent
        self.pack_lock_free = True
        #: pack_info's rows, when set (else one made-up row).
        self.pack_info = None
        #: When set, a statement's rowcount is 1 the first time it is sent
        #: and 0 after (so that the pack's loops run a second round).
        self.first_rowcount = False
        self._counted = set()

    def rowcount(self, stmt):
        if not self.first_rowcount or stmt in self._counted:
            return 0
        self._counted.add(stmt)
        return 1

    def answer(self, adapter, stmt, params):
        if self.fail is not None and self.fail[0] in stmt:
            raise self.fail[1]
        s = adapter.sql
        restart = re.match(r'ALTER SEQUENCE zoid_seq RESTART START WITH (\d+)$', stmt)
        if restart:
            self.sequence = int(restart.group(1)) - sql.OID_BLOCK
            return []
        created = re.match(r'CREATE (?:GLOBAL TEMPORARY )?(TABLE|SEQUENCE) (\w+)', stmt)
        if created:
            if created.group(2) in self.tables:
                raise oracle_error('ORA-00955: name is already used by an existing object',
                                   955)
            self.tables.add(created.group(2))
        if stmt == adapter.q(s.LIST_TABLES):
            return [(name,) for name in sorted(self.tables)]
        if stmt == adapter.q(s.NEXT_OID_BLOCKS):
            rows = []
            for _ in range(params[0]):
                self.sequence += sql.OID_BLOCK
                rows.append((self.sequence,))
            return rows
        if stmt == adapter.q(s.OID_SEQUENCE_STATE):
            return [(self.sequence + sql.OID_BLOCK,)]
        if stmt == adapter.q(s.GET_PACK_MARK):
            return [] if self.pack_mark is None else [(self.pack_mark,)]
        if stmt == adapter.q(s.GET_DATABASE_KEY):
            return []           # a database without a key yet: one is written
        if stmt == adapter.q(s.GET_COPY_MARK):
            return []           # no copy unfinished: a new one's mark is written
        if stmt == adapter.q(s.GET_COPY_STATE):
            return [(0, 5), (7, 5)]     # the last transaction was copied
        if stmt == adapter.q(s.PACK_DOM_HAS_ROOT):
            return []           # (else the incremental reachability stops at once)
        if stmt == adapter.q(s.PACK_INFO_GET) and self.pack_info is not None:
            return sorted(self.pack_info.items())
        if stmt == adapter.q(s.TRY_PACK_LOCK):
            return [(1,)] if self.pack_lock_free else []
        if stmt in (adapter.q(s.LOCK_COMMIT), adapter.q(s.GET_LAST_TID)):
            return [(5,)]
        tree = parse_oracle(stmt)
        if hasattr(tree, 'selects'):
            # One row of as many columns as the query selects.
            return [(1,) * len(tree.selects)]
        return []


class RecordingCursor:

    def __init__(self, recorder, adapter):
        self.recorder = recorder
        self.adapter = adapter
        self.rows = []
        self.rowcount = 0

    def execute(self, stmt, params=()):
        params = tuple(params or ())
        self.recorder.calls.append((stmt, [params], False))
        self.rows = list(self.recorder.answer(self.adapter, stmt, params))
        self.rowcount = self.recorder.rowcount(stmt)

    def executemany(self, stmt, rows):
        rows = [tuple(r) for r in rows]
        self.recorder.calls.append((stmt, rows, True))
        self.rows = []

    def fetchone(self):
        return self.rows.pop(0) if self.rows else None

    def fetchall(self):
        rows, self.rows = self.rows, []
        return rows

    def fetchmany(self, size):
        rows, self.rows = self.rows[:size], self.rows[size:]
        return rows

    def close(self):
        pass


class RecordingConnection:

    def __init__(self, recorder, adapter):
        self.recorder = recorder
        self.adapter = adapter

    def cursor(self, *args):
        return RecordingCursor(self.recorder, self.adapter)

    def commit(self):
        pass

    def rollback(self):
        pass

    def close(self):
        pass


class RecordingDriver(drivers.OracledbDriver):
    """python-oracledb (its errors and types) with connections replaced by
    recorders."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder
        self.adapter = None

    def connect(self, user, password, dsn, purpose, connect_timeout):
        return RecordingConnection(self.recorder, self.adapter)


def recording_adapter(keep_history, **option_values):
    option_values.setdefault('commit_lock_timeout', 7)
    adapter = OracleAdapter(user='scott', password='tiger', dsn='db.example:1521/ZODB',
                            options=Options(keep_history=keep_history, **option_values))
    recorder = Recorder()
    adapter.driver = RecordingDriver(recorder)
    adapter.driver.adapter = adapter
    return adapter, recorder


BIG = b'x' * (drivers.LOB_BIND_LIMIT + 1)


def drive_every_verb(adapter, recorder):
    """Run every adapter verb the storage, pack and zodbconvert use."""
    hp = adapter.keep_history
    adapter.prepare_schema(create=True)
    # The pack's tables are made by the first pack (below).
    recorder.tables = (set(sql.ALL_TABLES) | set(sql.SEQUENCES)) \
        - set(sql.PACK_TABLES) - set(sql.PACK_TEMP_TABLES)
    if not hp:
        recorder.tables -= {'current_object', 'transaction_log'}
    adapter.prepare_schema(create=False)          # verifies only
    adapter.database_identity()                   # zodbconvert: not onto itself
    load = adapter.open_load()
    adapter.begin_snapshot(load)
    adapter.get_last_tid(load)
    adapter.snapshot_marks(load)
    adapter.snapshot_marks(load, [1, 2])
    adapter.poll_changes(load, 1, 2)
    adapter.poll_changes(load, 1, 5, {3: [7, 8]})      # around a known commit
    adapter.recent_changes(load, 2, 10)
    adapter.load_current(load, 1)
    adapter.load_current_many(load, [1, 2, 3])
    adapter.load_current_many(load, list(range(10, 60, 2)))    # a range
    adapter.load_revision(load, 1, 2)
    adapter.load_before(load, 1, 2)
    adapter.current_tids(load, [1, 2])
    adapter.count_objects(load)
    adapter.count_history(load)
    adapter.database_size(load)
    adapter.history(load, 1, 10)
    adapter.record_iternext(load, 0)
    adapter.record_sizes(load, 0, 10)
    adapter.transactions_in_range(load, 1, 2, 10)
    adapter.records_in_transaction(load, 2)
    adapter.blob_chunk_count(load, 1, 2)
    adapter.any_blob_chunk(load)
    adapter.load_blob_chunk(load, 1, 2, 0)
    adapter.stream_blob_chunk(load, 1, 2, 0, lambda data: None)
    adapter.database_key()
    adapter.session_alive(load)
    if hp:
        adapter.undo_log(load, 2, 20)
        adapter.transaction_packed(load, 2)
        adapter.undo_sources(load, 2)
        adapter.undo_states(load, 2, [1, 10])
    load.rollback()
    adapter.commit_outcome(2, True)      # on a store connection of its own

    store = adapter.open_store()
    adapter.begin_store_checked(store)
    adapter.clear_temp(store)
    adapter.clear_temp_blobs(store)
    adapter.upload(store, [(1, 0, b'small'), (2, 0, None), (3, 0, BIG), (4, 0, b'')])
    adapter.detect_conflicts(store, [(1, 0), (3, 7)])
    adapter.lock_objects_checked(store, [1, 3], [2])
    adapter.fix_prev_tids(store)
    adapter.upload_blob_chunk(store, 1, 0, BIG)
    adapter.upload_blob_chunk(store, 1, 1, b'')
    adapter.advance_tid(store, 100)
    adapter.advance_tid(store, 100, requested=200)
    adapter.move_into_place(store, 200, True, b'user', b'description', BIG)
    adapter.move_into_place(store, 201, False, b'', b'', b'')
    adapter.move_into_place(store, 202, True, b'', b'', b'', all_new=True)
    adapter.move_into_place(store, 203, True, b'', b'', b'', some_new=True)
    # (Oracle keeps temp_store for new objects, new_rows_direct_bytes 0:
    # the base verb's statements are checked all the same.)
    adapter.move_into_place(store, 204, False, b'', b'', b'', new_rows=[(5, b'new')])
    adapter.move_blobs_into_place(store, 200, True)
    adapter.copy_blob(store, 1, 100, 200)
    adapter.lock_commit_checked(store)
    store.commit()

    # Pack, as storage/pack.py runs it.
    adapter.has_blob_chunk = True
    adapter.pack_delete(store, [1, 2], [(3, 150), (4, 150)], 150)
    adapter.bump_pack_mark(store)              # the first pack inserts the mark
    recorder.pack_mark = 1
    adapter.bump_pack_mark(store)
    adapter.pack_mark(store)
    adapter.zap_mark(store)
    adapter.set_copy_mark(store, 1764590000)
    adapter.copy_mark(store)
    adapter.set_copy_mark(store, None)
    adapter.set_copy_mark(store, None, copied_too=False)
    adapter.note_copied_tid(store, 5)
    assert adapter.unfinished_copy(store) == (None, 5)
    store.commit()
    store.close()

    # The two-phase pack, as storage/pack.py runs it.
    lock = adapter.acquire_pack_lock()
    conn = adapter.open_pack()                 # creates the pack tables
    recorder.tables |= set(sql.PACK_TABLES) | set(sql.PACK_TEMP_TABLES)
    conn.close()
    conn = adapter.open_pack()                 # they exist now: no DDL
    load = adapter.open_load()
    adapter.begin_snapshot(load)
    adapter.count_revisions(load, 0, 5)
    list(adapter.iter_revisions(load, 0, 5))
    adapter.renew_snapshot(load, 5)                         # between two pages
    adapter.count_revisions(load, 0, 5, kept_at=4)          # history-preserving only
    list(adapter.iter_revisions(load, 0, 5, kept_at=4))
    load.rollback()
    load.close()
    adapter.begin_store_checked(conn)
    adapter.pack_info(conn)
    adapter.pack_refs_tid(conn)
    adapter.forget_refs_after(conn, 100)
    adapter.add_refs(conn, [1, 2], [(1, 200, 2), (1, 200, 3), (2, 200, 3)])
    adapter.forget_refs_of(conn, [9])          # add_refs calls it history-free only
    adapter.set_pack_info(conn, refs_tid=200, prepared=None)
    adapter.records_seeds(conn)
    adapter.record_seeds(conn, [1, 2], [(1, 200, 2)])    # add_refs' history-free only
    recorder.first_rowcount = True             # the loops go round twice
    adapter.compute_pack_candidates(conn, 150, True)
    # History-free, after a completed pack: the incremental reachability.
    recorder.pack_info = {'seed_base': 1, 'reach_objects': 10, 'seed_tid': 100}
    adapter.compute_pack_candidates(conn, 150, True)
    recorder.pack_info = None
    adapter._any(conn, 'temp_pack_next')       # where rowcount is not known
    adapter.pack_candidate_stats(conn)
    adapter.pack_candidates_of(conn, [1, 2])
    adapter.new_revisions(conn, 200, 300)
    adapter.rescue_candidates(conn, 200, {3, 4})
    adapter.seed_unreached(conn, {3, 4})
    adapter.prepare_pack_deletion(conn)
    adapter.delete_pack_batch(conn, 0, 100)    # with what goes with it
    recorder.first_rowcount = False
    adapter.any_garbage_candidate(conn, {3, 4})
    adapter.clear_pack_removals(conn)
    adapter.new_removal_mark(conn)
    adapter.log_pack_removals(conn, 1, [3], [(4, 150)])
    adapter.forget_deleted(conn, 4)       # (nothing: the batch did it)
    adapter.pack_removals(conn, 0, 1)
    adapter.mark_packed(conn, 150)
    adapter.finish_pack(conn, 150)
    adapter.missing_references(conn)
    conn.commit()
    conn.close()
    lock.close()

    # OIDs: allocation, and the floor zodbconvert raises after a copy.
    adapter.new_oid()
    adapter.note_oids_used(10 * sql.OID_BLOCK + 3)
    adapter.note_oids_used(5)                  # below what we drew: no query
    adapter.zap_all()
    adapter.drop_all()


def named_statements(adapter):
    """name -> text of every statement of ``adapter.sql`` (this mode)."""
    result = {}
    for name in dir(adapter.sql):
        value = getattr(adapter.sql, name)
        if name.isupper() and isinstance(value, str) and not name.endswith('_HF'):
            result[name] = value
    return result


#: Public Adapter methods drive_every_verb need not call, and why.
NOT_DRIVEN = {
    'binary', 'q', 'in_list', 'classify_error', 'translate_error', 'link_lost', 'describe',
    'foreign_triggers',         # no SQL on Oracle (RelStorage 4.3 put its triggers elsewhere)
    'earlier_leftovers',        # the same for its views and routines
    'refresh_statistics',       # no SQL on Oracle (its own statistics upkeep)
    'statements_class',         # helpers and data, exercised through the verbs
    'close',                    # no SQL
    'open_primary_load',        # open_load's connection, on the primary (no SQL)
    'described_server',         # no SQL
    'check_commit_room',        # no SQL where the server has written everything
    'claim_fresh_oids',         # no SQL
    'check_can_write',          # no SQL here (MySQL: what its sessions' set-up saw)
    'forget_oids', 'forget_oid_floor',  # no SQL (a restored backup: the reserved OIDs go)
    'after_fork_in_child',      # no SQL (forgets the parent's OIDs)
    'renew_locks',              # no SQL (locks made again once gevent patched the process)
    'socket_fd', 'set_aside_inherited',     # no SQL (a forked child's sockets)
    'pack_write_lock_target',   # no SQL
    'pair_pack_tables',         # no SQL where the pack's tables live with the data
    'sync_deleted',             # no SQL (a file's fsync, where the pack's tables are apart)
    'deleted_sync',             # the same, as a function
    'writers_waiting',          # no SQL (a file lock, where the commit lock is the write lock)
    'snapshot_ended',           # no SQL (SQLite's upkeep of its write-ahead log)
    'refusal',                  # no SQL (which errors are a missing grant)
    'hidden_tables_hint',       # no SQL (a message's text)
    'check_metadata_room',      # no SQL (MySQL's max_allowed_packet)
    'step_off_server',          # no SQL (replica-conf's choice of server)
    'back_after_timeout',       # the same
    'any_refs',                 # only where object_ref may lose its rows (PostgreSQL)
    'oid_array',                # only for array statements, which Oracle has none of
    'query_script',             # only for scripts (PostgreSQL's ADVANCE_TID), which Oracle has none of
    'stream_rows',              # used by vendors whose iter_states needs a server cursor
    # The schema of earlier releases is not read on Oracle (no SQL: it refuses).
    'earlier_release_reads', 'read_earlier_schema',
    # Oracle cannot bound an idle transaction (holds_locks_for_retry is
    # false): a conflict always rolls back.
    'lock_hold_seconds', 'hold_locks', 'end_hold',
    # No SQL (a number; Oracle sets no idle limit: ends_idle_store_transactions).
    'store_idle_seconds',
}
#: Verbs of undo, which only a history-preserving storage has.
HP_ONLY_VERBS = {'undo_log', 'transaction_packed', 'undo_sources', 'undo_states'}


def track_verbs(adapter):
    """Record the public adapter methods called on ``adapter`` (directly or
    through each other); return the set that fills as they run."""
    from relstorage.adapters.base import Adapter
    called = set()
    for name in dir(Adapter):
        method = getattr(adapter, name)
        if name.startswith('_') or not callable(method) or isinstance(method, type):
            continue

        def wrapper(*args, _name=name, _method=method, **kwargs):
            called.add(_name)
            return _method(*args, **kwargs)
        setattr(adapter, name, wrapper)
    return called


#: Statements the shared Statements class offers that no verb sends, and why.
NOT_SENT = {
    'TRANSACTIONS_IN_RANGE': 'the iterator reads ALL_TRANSACTIONS_IN_RANGE',
    'OBJECTS_IN_TRANSACTION': 'no verb uses it (RECORDS_IN_TRANSACTION does the work)',
    'COUNTED_TABLE': 'a table name, the parameter of COUNT_ESTIMATE, which Oracle has not',
}
#: Statements about older revisions, which a history-free database has not:
#: the verbs send them only when keep-history is on.
HP_ONLY = ('LOAD_BEFORE', 'DELETE_OLDER_REVISIONS', 'DELETE_OLDER_BLOBS',
           # The history-preserving incremental reachability.
           'PACK_FILL_CHANGED', 'PACK_SEED_DROPPED', 'PACK_SEED_NEW', 'PACK_FILL_DOM',
           'PACK_REACH_OUTSIDE_DOM', 'PACK_DOM_ENTRIES_AT', 'PACK_LATE_DOM_AT',
           'PACK_LATE_REFS',
           # Revisions a pack removes are not analysed.
           'PACK_REVISIONS_KEPT', 'PACK_COUNT_REVISIONS_KEPT')
#: ... and statements a history-preserving database answers otherwise
#: (commit_outcome reads transaction_log there; an object's older
#: revisions keep their references there).
HF_ONLY = ('TID_HAS_STATES', 'PACK_REFS_FORGET_OBJECTS',
           # The reachability in two stages and the incremental one.
           'PACK_ROOT', 'PACK_LATE_ROOTS', 'PACK_NEXT_FROM_SEED', 'PACK_REFS_OF',
           'PACK_SEED_INSERT', 'PACK_SEED_TAKE', 'PACK_SEED_CLEAR', 'PACK_SEED_SAVE',
           'PACK_SEED_RESCUED', 'PACK_DOM_FROM_NEXT', 'PACK_FRONTIER_FROM_DOM',
           'PACK_DOM_STEP', 'PACK_FILL_CURRENT_DOM', 'PACK_DOM_HAS_ROOT', 'PACK_DOM_ENTRIES',
           'PACK_SEED_FORGET', 'PACK_SEED_UNREACHED',
           'PACK_LATE_DOM', 'PACK_LATE_ENTRIES', 'PACK_REACH_STEP_DOM')
#: Tables only a history-preserving schema has.
HP_TABLES = ('current_object', 'transaction_log')


class StatementTests(unittest.TestCase):

    def run_verbs(self, keep_history):
        adapter, recorder = recording_adapter(keep_history)
        called = track_verbs(adapter)
        drive_every_verb(adapter, recorder)
        from relstorage.adapters.base import Adapter
        public = {name for name in dir(Adapter) if not name.startswith('_')
                  and callable(getattr(Adapter, name))}
        self.assertEqual(
            sorted(public - called - NOT_DRIVEN - (set() if keep_history else HP_ONLY_VERBS)),
            [],
            'adapter verbs test_oracle does not drive: add them to drive_every_verb '
            'so that the Oracle statements they send are checked')
        return adapter, recorder

    def check_sent(self, keep_history):
        adapter, recorder = self.run_verbs(keep_history)
        self.assertGreater(len(recorder.calls), 50)
        for stmt, rows, many in recorder.calls:
            with self.subTest(stmt=stmt):
                tree = check_oracle(stmt)
                numbers = bind_numbers(stmt)
                self.assertEqual(numbers, list(range(1, len(numbers) + 1)),
                                 'binds must be :1 .. :n in order')
                self.assertEqual(len(list(tree.find_all(Placeholder))), len(numbers))
                self.assertTrue(rows if many else True)
                for params in rows:
                    self.assertEqual(len(params), len(numbers),
                                     'the code passes %r' % (params,))
                if not keep_history:
                    for table in HP_TABLES:
                        self.assertNotIn(table, stmt.lower())
        return adapter, recorder

    def check_coverage(self, adapter, recorder):
        sent = {stmt for stmt, _, _ in recorder.calls}
        missing = []
        for name, text in named_statements(adapter).items():
            forms = {adapter.q(text)} if '{in_list}' not in text else \
                {adapter.in_list(text, n) for n in range(1, 5)}
            if not forms & sent and name not in NOT_SENT:
                if adapter.keep_history:
                    if name not in HF_ONLY:
                        missing.append(name)
                elif not (name in HP_ONLY or any(t in text.lower() for t in HP_TABLES)):
                    missing.append(name)
        self.assertEqual(missing, [], 'statements no verb sent: drive the verb that sends '
                         'them in drive_every_verb, or list them in NOT_SENT with the reason')
        for ddl in adapter.schema_statements():
            self.assertIn(ddl, sent)
        self.assertEqual(
            [stmt for stmt, _, _ in recorder.calls if stmt.startswith('DROP ')],
            sql.drop_statements(recorder.tables))

    def test_history_preserving_statements_parse_with_their_binds(self):
        self.check_coverage(*self.check_sent(True))

    def test_history_free_statements_parse_with_their_binds(self):
        self.check_coverage(*self.check_sent(False))

    def test_every_named_statement_parses(self):
        # Including those no verb sends, in both modes and with NOWAIT.
        for keep_history in (True, False):
            for timeout in (0, 3):
                adapter, _ = recording_adapter(keep_history, commit_lock_timeout=timeout)
                for name, text in named_statements(adapter).items():
                    with self.subTest(name=name, keep_history=keep_history):
                        stmt = adapter.in_list(text, 3) if '{in_list}' in text \
                            else adapter.q(text)
                        check_oracle(stmt)
                        self.assertEqual(bind_numbers(stmt), list(
                            range(1, text.count('%s') + 1 + (3 if '{in_list}' in text else 0))))

    def test_the_check_refuses_other_dialects(self):
        # The checker itself: sqlglot's Oracle parser accepts these, Oracle
        # does not; the shared ANSI and PostgreSQL statements use them.
        from relstorage.adapters.postgresql import sql as pg
        from relstorage.adapters.sql import Statements
        from relstorage.adapters.oracle.adapter import render_binds
        for stmt in (Statements.LOAD_BEFORE, Statements.MOVE_FROM_TEMP,
                     pg.PostgreSQLStatements.UPDATE_CURRENT,
                     pg.PostgreSQLStatements.LOCK_READ_CURRENT,
                     pg.PostgreSQLStatements.ADVANCE_TID, pg.TEMP_STORE, pg.DROP_ALL[0],
                     'SELECT zoid FROM object_state WHERE packed = TRUE',
                     'SELECT zoid FROM object_state LIMIT 1 OFFSET 2 ROWS'):
            with self.subTest(stmt=stmt):
                with self.assertRaises((AssertionError, sqlglot.errors.ParseError)):
                    check_oracle(render_binds(stmt))

    def test_lock_waits_follow_commit_lock_timeout(self):
        for timeout, clause in ((0, 'NOWAIT'), (1, 'WAIT 1'), (30, 'WAIT 30')):
            adapter, _ = recording_adapter(True, commit_lock_timeout=timeout)
            self.assertTrue(adapter.sql.LOCK_COMMIT.endswith('FOR UPDATE ' + clause))
            self.assertIn('ORDER BY zoid FOR UPDATE ' + clause,
                          adapter.in_list(adapter.sql.LOCK_OBJECTS, 2))

    def test_row_locks_in_oid_order_with_read_current(self):
        adapter, recorder = recording_adapter(True)
        conn = adapter.open_store()
        adapter.lock_objects_checked(conn, [9, 3], [5, 1])
        locks = [rows[0] for stmt, rows, _ in recorder.calls if 'FOR UPDATE' in stmt]
        # One OID order across the exclusive and readCurrent rows.
        self.assertEqual([oid for params in locks for oid in params], [1, 3, 5, 9])

    def test_in_lists_stay_within_oracles_limit(self):
        # ORA-01795: at most 1000 expressions in a list.
        adapter, recorder = recording_adapter(False)
        conn = adapter.open_store()
        oids = list(range(2500, 0, -1))
        adapter.lock_objects(conn, oids, [])
        adapter.current_tids(conn, oids)
        sent = [(stmt, rows[0]) for stmt, rows, _ in recorder.calls]
        self.assertEqual(len(sent), 6)
        for stmt, params in sent:
            self.assertLessEqual(len(params), 1000)
            self.assertEqual(bind_numbers(stmt), list(range(1, len(params) + 1)))
        locked = [oid for stmt, params in sent[:3] for oid in params]
        self.assertEqual(locked, sorted(oids))

    def test_lock_waits_that_time_out_are_retryable_conflicts(self):
        from ZODB.POSException import ConflictError
        from relstorage.interfaces import UnableToAcquireCommitLockError
        from relstorage.interfaces import UnableToLockRowsError
        timeout = oracle_error('ORA-30006: resource busy; acquire with WAIT timeout expired',
                               30006)
        deadlock = oracle_error('ORA-00060: deadlock detected while waiting for resource', 60)
        for exc in (timeout, deadlock):
            adapter, recorder = recording_adapter(True)
            conn = adapter.open_store()
            recorder.fail = ('FOR UPDATE', exc)
            with self.assertRaises(UnableToLockRowsError) as cm:
                adapter.lock_objects_checked(conn, [0x10, 0x11], [])
            self.assertIsInstance(cm.exception, ConflictError)
            self.assertIn('0x10', str(cm.exception))
            with self.assertRaises(UnableToAcquireCommitLockError):
                adapter.advance_tid(conn, 100)
            with self.assertRaises(UnableToAcquireCommitLockError):
                adapter.lock_commit_checked(conn)

    def test_a_lost_connection_during_a_statement(self):
        adapter, recorder = recording_adapter(True)
        conn = adapter.open_load()
        recorder.fail = ('SELECT', oracle_error(
            'ORA-03113: end-of-file on communication channel', 3113))
        with self.assertRaises(DisconnectedError) as cm:
            adapter.load_current(conn, 1)
        self.assertIn("service 'ZODB' at db.example:1521", str(cm.exception))
        self.assertTrue(conn.broken)

    def test_upload_binds_large_states_apart(self):
        adapter, recorder = recording_adapter(True)
        conn = adapter.open_store()
        adapter.upload(conn, [(1, 0, b'a'), (2, 0, BIG), (3, 0, None)])
        batches = [rows for stmt, rows, many in recorder.calls if many]
        self.assertEqual(batches, [[(1, 0, b'a'), (3, 0, None)], [(2, 0, BIG)]])
        for rows in batches:
            plan, lobs = drivers.bind_plan(rows)
            self.assertEqual(lobs, {2} if rows[0][2] == BIG else set())

    def test_oid_floor_after_a_copy(self):
        adapter, recorder = recording_adapter(True)
        first = adapter.new_oid()
        self.assertEqual(first, 1)
        adapter.note_oids_used(50 * sql.OID_BLOCK)
        self.assertGreaterEqual(recorder.sequence, 50 * sql.OID_BLOCK)
        self.assertGreater(adapter.new_oid(), 50 * sql.OID_BLOCK)


    def test_oid_floor_past_a_large_gap(self):
        # A review finding: raising the floor drew one NOCACHE value per
        # OID_BLOCK OIDs, under the commit lock: 7.8 million for OIDs near
        # 10**9, for ever near 2**40.  Past a gap of more than one round
        # trip's draws, the sequence is restarted above it, on an
        # autocommit session.
        adapter, recorder = recording_adapter(True)
        adapter.note_oids_used(2 ** 40)
        sent = [stmt for stmt, _, _ in recorder.calls]
        self.assertEqual([stmt for stmt in sent if stmt.startswith('ALTER')],
                         ['ALTER SEQUENCE zoid_seq RESTART START WITH %d'
                          % (2 ** 40 + sql.OID_BLOCK)])
        draws = [params for stmt, params, _ in recorder.calls
                 if stmt == adapter.q(adapter.sql.NEXT_OID_BLOCKS)]
        self.assertEqual(draws, [[(1,)]])       # (one value: the new start)
        self.assertGreater(adapter.new_oid(), 2 ** 40)
        # A gap one round trip covers is drawn, as before.
        adapter, recorder = recording_adapter(True)
        adapter.note_oids_used(sql.MAX_DRAW * sql.OID_BLOCK // 2)
        self.assertFalse([stmt for stmt, _, _ in recorder.calls if stmt.startswith('ALTER')])
        self.assertGreater(adapter.new_oid(), sql.MAX_DRAW * sql.OID_BLOCK // 2)

    def test_a_schema_creation_cut_short_is_completed(self):
        # A review finding: every DDL statement commits on Oracle, and a
        # creation that failed half-way (ORA-01950 at the first INSERT, for
        # a user without a quota) left objects that every later start
        # tried to create again (ORA-00955), for good.  Two processes
        # opening a new schema at once: the same.
        for keep_history in (True, False):
            adapter, recorder = recording_adapter(keep_history)
            recorder.fail = ('INSERT INTO commit_lock', oracle_error(
                "ORA-01950: no privileges on tablespace 'USERS'", 1950))
            with self.assertRaises(PermissionDeniedError) as caught:
                adapter.prepare_schema(create=True)
            self.assertIn('ORA-01950', str(caught.exception))
            self.assertEqual(recorder.tables, {'zoid_seq', 'commit_lock'})
            recorder.fail = None
            adapter.prepare_schema(create=True)
            self.assertTrue(adapter.required_tables() <= recorder.tables)
            # A creation cut short after object_state (or one a second
            # process finds under way) is completed as well (a review
            # finding).
            adapter, recorder = recording_adapter(keep_history)
            recorder.fail = ('CREATE GLOBAL TEMPORARY TABLE temp_store', oracle_error(
                "ORA-01536: space quota exceeded for tablespace 'USERS'", 1536))
            with self.assertRaises(Exception):
                adapter.prepare_schema(create=True)
            self.assertIn('object_state', recorder.tables)
            recorder.fail = None
            adapter.prepare_schema(create=True)
            self.assertTrue(adapter.required_tables() <= recorder.tables)
            # ... and once more, as a second process that lost the race.
            recorder.calls.clear()
            adapter.create_schema(adapter.open_connection('store'))
            self.assertEqual(len(recorder.calls), len(adapter.schema_statements()))

    def test_an_empty_state_is_refused(self):
        # A review finding: Oracle stores a zero-length value as NULL,
        # which reads back as a deleted object (and a pack removes it).
        from relstorage.storage.commit import Commit
        adapter, _ = recording_adapter(False)
        commit = Commit(adapter, None, None, object())
        with self.assertRaises(POSException.StorageError) as caught:
            commit.store(7, 0, b'')
        self.assertIn('object 0x7 is empty', str(caught.exception))
        for call in (lambda: commit.restore(7, 5, b''),
                     lambda: commit.add_copied(type('C', (), {'rows': [(7, b'')]})())):
            with self.assertRaises(POSException.StorageError):
                call()
        commit.store(7, 0, b'x')
        commit.restore(8, 5, None)          # (an undone creation: no state at all)

    def test_a_blob_chunk_gone_is_none_not_empty(self):
        # A review finding: a chunk a pack removed after the chunks were
        # counted read as an empty one: the blob came back cut short.
        adapter, recorder = recording_adapter(False)
        conn = adapter.open_connection('store')
        recorder.answer = lambda adapter, stmt, params: []
        self.assertIsNone(adapter.load_blob_chunk(conn, 1, 2, 0))
        self.assertIsNone(adapter.stream_blob_chunk(conn, 1, 2, 0, lambda data: None))
        recorder.answer = lambda adapter, stmt, params: [(None,)]
        self.assertEqual(adapter.load_blob_chunk(conn, 1, 2, 0), b'')
        recorder.answer = lambda adapter, stmt, params: [(b'data',)]
        self.assertEqual(adapter.load_blob_chunk(conn, 1, 2, 0), b'data')

    def test_commits_of_existing_objects_draw_no_oids(self):
        adapter, recorder = recording_adapter(True)
        recorder.sequence = 100 * sql.OID_BLOCK       # other processes allocated
        adapter.note_oids_used(50 * sql.OID_BLOCK)
        adapter.note_oids_used(60 * sql.OID_BLOCK)    # known safe now: no query
        sent = [stmt for stmt, _, _ in recorder.calls]
        self.assertEqual(sent, [adapter.q(adapter.sql.OID_SEQUENCE_STATE)])
        self.assertEqual(recorder.sequence, 100 * sql.OID_BLOCK)


class BindPlanTests(unittest.TestCase):

    def test_booleans_become_numbers(self):
        rows, lobs = drivers.bind_plan([(1, True, False, None, b'x')])
        self.assertEqual(rows, [(1, 1, 0, None, b'x')])
        self.assertEqual([type(v) for v in rows[0][1:3]], [int, int])
        self.assertEqual(lobs, set())

    def test_large_bytes_are_bound_as_blob(self):
        rows, lobs = drivers.bind_plan([(1, b'small'), (2, BIG)])
        self.assertEqual(lobs, {1})
        self.assertEqual(rows[1], (2, BIG))
        self.assertEqual(drivers.bind_plan([(b'x' * drivers.LOB_BIND_LIMIT,)])[1], set())


class _DBAPICursor:
    """Stands in for the driver's cursor class under our subclass."""

    def __init__(self, connection, *args):
        self._connection = connection
        self.sizes = None

    @property
    def connection(self):
        return self._connection

    def setinputsizes(self, *sizes):
        self.sizes = sizes

    def execute(self, statement, parameters=None, **kwargs):
        self._connection.log.append(('execute', self, statement, parameters, self.sizes))

    def executemany(self, statement, parameters, **kwargs):
        self._connection.log.append(('executemany', self, statement, parameters, self.sizes))

    def close(self):
        self._connection.log.append(('close', self))


class _DBAPIConnection:

    def __init__(self):
        self.log = []

    def cursor(self, *args):
        return _DBAPICursor(self, *args)


class BindingCursorTests(unittest.TestCase):
    """Our connection and cursor subclasses, over stand-in base classes
    (their construction needs a server)."""

    def setUp(self):
        module = type('module', (), {'Cursor': _DBAPICursor, 'Connection': _DBAPIConnection})
        self.conn = drivers._connection_class(module)()
        self.conn.lob_type = 'BLOB'
        self.cursor = self.conn.cursor()

    def test_booleans_and_small_bytes_on_the_main_cursor(self):
        self.cursor.execute('S', (True, b'x', 3))
        self.cursor.executemany('M', [(False, b'y')])
        self.assertEqual(self.conn.log, [
            ('execute', self.cursor, 'S', (1, b'x', 3), None),
            ('executemany', self.cursor, 'M', [(0, b'y')], None)])

    def test_large_bytes_on_a_cursor_of_their_own(self):
        self.cursor.execute('S', (1, BIG))
        self.cursor.executemany('M', [(1, b'a', None), (2, BIG, b'b')])
        self.cursor.execute('T', (2,))
        (kind1, cur1, _, params1, sizes1), close1, (kind2, cur2, _, rows2, sizes2), \
            close2, last = self.conn.log
        self.assertEqual((kind1, params1, sizes1), ('execute', (1, BIG), (None, 'BLOB')))
        self.assertEqual((kind2, rows2, sizes2),
                         ('executemany', [(1, b'a', None), (2, BIG, b'b')],
                          (None, 'BLOB', None)))
        for cur, close in ((cur1, close1), (cur2, close2)):
            self.assertIsNot(cur, self.cursor)
            self.assertEqual(close, ('close', cur))
        # The main cursor never had input sizes set.
        self.assertEqual(last, ('execute', self.cursor, 'T', (2,), None))

    def test_named_binds_pass_through(self):
        self.cursor.execute('S', {'a': True})
        self.cursor.execute('S')
        self.assertEqual([entry[3] for entry in self.conn.log], [{'a': True}, None])


# ----------------------------------------------------------------------
# Drivers, DSNs, errors: python-oracledb's own classes, no server.

def closed_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


class DriverTests(unittest.TestCase):

    def test_auto_and_oracledb_are_python_oracledb_in_thin_mode(self):
        import oracledb
        for name in ('auto', 'oracledb', 'python-oracledb', 'OracleDB', None):
            driver = drivers.select_driver(name)
            self.assertIs(driver.module, oracledb)
        self.assertTrue(oracledb.is_thin_mode())

    def test_cx_oracle_resolves_to_oracledb_when_not_installed(self):
        import importlib.util
        driver = drivers.select_driver('cx_Oracle')
        if importlib.util.find_spec('cx_Oracle') is None:
            self.assertEqual(driver.name, 'oracledb')
        else:
            self.assertEqual(driver.name, 'cx_Oracle')

    def test_unknown_driver(self):
        with self.assertRaises(RelStorageError) as cm:
            drivers.select_driver('odbc')
        self.assertIn('oracledb', str(cm.exception))

    def test_connection_classes_extend_the_driver(self):
        import oracledb
        driver = drivers.select_driver('oracledb')
        self.assertTrue(issubclass(driver.connection_class, oracledb.Connection))
        self.assertIs(driver.connection_class.lob_type, oracledb.DB_TYPE_BLOB)

    def test_config_driver_names_match(self):
        self.assertEqual(set(config.DRIVER_NAMES['oracle']), set(drivers.DRIVER_NAMES))


class DSNTests(unittest.TestCase):

    def adapter(self, **kw):
        kw.setdefault('user', 'zope')
        return OracleAdapter(options=Options(), **kw)

    def test_easy_connect(self):
        adapter = self.adapter(password='pw', dsn='db.example:1522/ZODBPDB')
        self.assertEqual(adapter.describe(),
                         "Oracle database service 'ZODBPDB' at db.example:1522 as user 'zope'")

    def test_default_port_and_descriptor(self):
        self.assertIn("'ORCL' at dbhost:1521", self.adapter(dsn='dbhost/ORCL').describe())
        descriptor = ('(DESCRIPTION=(ADDRESS=(PROTOCOL=TCP)(HOST=h2)(PORT=1600))'
                      '(CONNECT_DATA=(SERVICE_NAME=S2)))')
        self.assertIn("'S2' at h2:1600", self.adapter(dsn=descriptor).describe())

    def test_tns_alias(self):
        adapter = self.adapter(dsn='zodb_prod')
        self.assertEqual(adapter.describe(), "Oracle database TNS alias 'zodb_prod' as user 'zope'")

    def test_credentials_in_the_dsn_are_used_and_never_shown(self):
        adapter = OracleAdapter(dsn='scott/s3cr3t@db:1521/XE', options=Options())
        self.assertEqual((adapter.user, adapter.dsn), ('scott', 'db:1521/XE'))
        self.assertNotIn('s3cr3t', adapter.describe())

    def test_missing_dsn(self):
        with self.assertRaises(RelStorageError) as cm:
            self.adapter(dsn='')
        self.assertIn('dsn', str(cm.exception))


class ErrorTests(unittest.TestCase):

    def setUp(self):
        self.driver = drivers.select_driver('oracledb')

    def classify(self, exc):
        return drivers.classify_error(self.driver, exc)

    def test_lock_errors(self):
        for code, text in ((54, 'ORA-00054: resource busy and acquire with NOWAIT '
                                'specified or timeout expired'),
                           (30006, 'ORA-30006: resource busy; acquire with WAIT timeout '
                                   'expired'),
                           (60, 'ORA-00060: deadlock detected while waiting for resource')):
            with self.subTest(code=code):
                self.assertEqual(self.classify(oracle_error(text, code)), 'lock')

    def test_disconnect_errors(self):
        from oracledb import errors
        for code, text in ((3113, 'ORA-03113: end-of-file on communication channel'),
                           (3114, 'ORA-03114: not connected to ORACLE'),
                           (3135, 'ORA-03135: connection lost contact'),
                           (28, 'ORA-00028: your session has been killed')):
            with self.subTest(code=code):
                self.assertEqual(self.classify(oracle_error(text, code)), 'disconnect')
        closed = errors._create_exception(errors.ERR_CONNECTION_CLOSED)
        self.assertEqual(closed.args[0].full_code, 'DPY-4011')
        self.assertEqual(self.classify(closed), 'disconnect')
        not_connected = errors._create_exception(errors.ERR_NOT_CONNECTED)
        self.assertEqual(self.classify(not_connected), 'disconnect')

    def test_no_room_errors(self):
        for code, text in ((1653, 'ORA-01653: unable to extend table RS.OBJECT_STATE by 128 '
                                  'in tablespace USERS'),
                           (1691, 'ORA-01691: unable to extend lob segment RS.SYS_LOB by 8 '
                                  'in tablespace USERS')):
            with self.subTest(code=code):
                self.assertEqual(self.classify(oracle_error(text, code)), 'full')

    def test_duplicate_key(self):
        # A new object whose row exists (see Adapter.move_into_place).
        self.assertEqual(self.classify(oracle_error(
            'ORA-00001: unique constraint (RS.PK_OBJECT_STATE) violated', 1)), 'duplicate')

    def test_other_errors(self):
        self.assertIsNone(self.classify(oracle_error(
            'ORA-00942: table or view does not exist', 942)))
        self.assertIsNone(self.classify(ValueError('ORA-00054')))

    def test_a_disconnect_becomes_a_transient_error(self):
        adapter, _ = recording_adapter(True)
        adapter.driver = self.driver
        conn = type('Conn', (), {'purpose': 'store', 'broken': False, 'server': None})()
        translated = adapter.translate_error(
            oracle_error('ORA-03113: end-of-file on communication channel', 3113), conn)
        self.assertIsInstance(translated, DisconnectedError)
        self.assertIsInstance(translated, transaction.interfaces.TransientError)
        self.assertTrue(conn.broken)

    def test_refused_connection_names_host_and_service(self):
        port = closed_port()
        adapter = OracleAdapter(user='zope', password='pa55word',
                                dsn='127.0.0.1:%d/ZODBSVC' % port,
                                options=Options())
        with self.assertRaises(OracleConnectError) as cm:
            RelStorage(adapter, options=adapter.options)
        message = str(cm.exception)
        self.assertIn("'ZODBSVC' at 127.0.0.1:%d" % port, message)
        self.assertIn("'zope'", message)
        self.assertIn('DPY-6005', message)
        self.assertNotIn('pa55word', message)
        self.assertIsInstance(cm.exception, transaction.interfaces.TransientError)

    def test_a_host_name_that_does_not_resolve_is_named(self):
        # A helper agent's check: python-oracledb's thin mode let the
        # socket.gaierror through, bare, where every other failure to
        # connect names the database and the user.
        import ZODB.config
        config = ('%import relstorage\n<relstorage>\n<oracle>\nuser zope\npassword pa55word\n'
                  'dsn nosuchhost.invalid:1521/ZODBSVC\n</oracle>\n</relstorage>\n')
        with self.assertRaises(RelStorageError) as cm:
            ZODB.config.storageFromString(config)
        message = str(cm.exception)
        self.assertIn("'ZODBSVC' at nosuchhost.invalid:1521", message)
        self.assertIn("'zope'", message)
        self.assertNotIn('pa55word', message)
        self.assertNotIsInstance(cm.exception, transaction.interfaces.TransientError)

    def test_a_held_pack_lock_is_not_taken(self):
        # SKIP LOCKED answers no row while another session holds the row.
        adapter, recorder = recording_adapter(True)
        recorder.pack_lock_free = False
        self.assertIsNone(adapter.acquire_pack_lock())
        recorder.pack_lock_free = True
        self.assertIsNotNone(adapter.acquire_pack_lock())

    def test_two_first_packs_both_make_the_lock_row(self):
        # The loser of the race for the row's insert still asks for the lock.
        adapter, recorder = recording_adapter(True)
        recorder.fail = ('INSERT INTO commit_lock', oracle_error(
            'ORA-00001: unique constraint (RS.SYS_C0012) violated', 1))
        self.assertIsNotNone(adapter.acquire_pack_lock())
        self.assertIn(adapter.q(adapter.sql.TRY_PACK_LOCK), [c[0] for c in recorder.calls])

    def test_pack_tables_are_created_only_when_missing(self):
        adapter, recorder = recording_adapter(False)
        recorder.tables = {'object_ref', 'temp_pack_reach'}
        adapter.open_pack().close()
        created = sorted(re.match(r'CREATE (?:GLOBAL TEMPORARY )?(?:TABLE|INDEX) (\w+)',
                                  stmt).group(1)
                         for stmt, _, _ in recorder.calls if stmt.startswith('CREATE'))
        self.assertEqual(created, ['pack_info', 'pack_object', 'pack_removed_list', 'pack_seed',
                                   'temp_pack_batch', 'temp_pack_current', 'temp_pack_dom',
                                   'temp_pack_edges', 'temp_pack_extra',
                                   'temp_pack_frontier', 'temp_pack_next', 'temp_pack_seed'])

    def test_replica_conf_lists_dsns_and_moves_to_the_next(self):
        # replica-conf for Oracle: one DSN per line.  Neither server here
        # answers (no Oracle can run on these machines): the chooser tries
        # the first, logs the move to the second, and the error names it.
        first, second = closed_port(), closed_port()
        tmp = tempfile.mkdtemp(prefix='relstoragetest_ora_')
        self.addCleanup(shutil.rmtree, tmp, True)
        conf = os.path.join(tmp, 'replicas.conf')
        with open(conf, 'w') as f:
            f.write('# primary, then the standby\n127.0.0.1:%d/ZODBSVC\n\n'
                    '127.0.0.1:%d/ZODBSTBY\n' % (first, second))
        options = Options(replica_conf=conf)
        adapter = OracleAdapter(user='zope', password='pa55word',
                                dsn='unused.example:1521/X', options=options)
        with self.assertLogs('relstorage', logging.INFO) as logs:
            with self.assertRaises(OracleConnectError) as cm:
                adapter.connect('load')
        text = '\n'.join(logs.output)
        self.assertIn('127.0.0.1:%d/ZODBSVC' % first, text)
        self.assertIn('127.0.0.1:%d/ZODBSTBY' % second, text)
        self.assertNotIn('pa55word', text + str(cm.exception))
        self.assertIn("'ZODBSTBY'", str(cm.exception))

    def failing_adapter(self, exc, password='hunter2-secret'):
        driver = drivers.select_driver('oracledb')

        def refuse(*args):
            raise exc
        driver._connect = refuse
        adapter = OracleAdapter(user='zope', password=password,
                                dsn='db.example:1521/ZODBSVC', options=Options())
        adapter.driver = driver
        return adapter

    def test_login_refused(self):
        adapter = self.failing_adapter(oracle_error(
            'ORA-01017: invalid credential or not authorized; logon denied', 1017))
        with self.assertRaises(OracleLoginError) as cm:
            RelStorage(adapter, options=adapter.options)
        message = str(cm.exception)
        self.assertIn('ORA-01017', message)
        self.assertIn("'zope'", message)
        self.assertNotIn('hunter2-secret', message)
        self.assertNotIsInstance(cm.exception, DisconnectedError)

    def test_listener_errors_name_host_and_service(self):
        from oracledb import errors
        for exc in (
                oracle_error('ORA-12541: Cannot connect. No listener at host db.example '
                             'port 1521.', 12541),
                oracle_error('ORA-12514: Cannot connect to database. Service ZODBSVC is not '
                             'registered with the listener at host db.example port 1521.',
                             12514),
                errors._create_exception(errors.ERR_INVALID_SERVICE_NAME,
                                         service_name='ZODBSVC', host='db.example',
                                         port=1521)):
            with self.subTest(exc=str(exc)):
                adapter = self.failing_adapter(exc)
                with self.assertRaises(OracleConnectError) as cm:
                    adapter.connect('load')
                self.assertIn("service 'ZODBSVC' at db.example:1521", str(cm.exception))

    def test_password_never_echoed_even_if_the_driver_does(self):
        adapter = self.failing_adapter(oracle_error(
            'ORA-99999: something mentioning hunter2-secret', 99999))
        with self.assertRaises(RelStorageError) as cm:
            adapter.connect('store')
        self.assertNotIn('hunter2-secret', str(cm.exception))


class ConfigTests(unittest.TestCase):

    def load(self, section):
        from .test_options_config import load_db
        from .test_options_config import relstorage_section
        return load_db(relstorage_section('', section)).config.storage

    def test_existing_zope_conf_keys(self):
        factory = self.load('<oracle>\n user zope\n password s3cret\n dsn db:1521/XE\n'
                            ' commit-lock-id 7\n twophase true\n driver cx_Oracle\n</oracle>')
        section = factory.config.adapter
        self.assertEqual((section.config.commit_lock_id, section.config.twophase),
                         (7, True))
        adapter = section.create(factory.options)
        self.assertIsInstance(adapter, OracleAdapter)
        self.assertEqual(adapter.describe(),
                         "Oracle database service 'XE' at db:1521 as user 'zope'")
        self.assertNotIn('s3cret', repr(section))

    def test_password_in_the_dsn_is_not_in_the_repr(self):
        factory = self.load('<oracle>\n dsn scott/t1ger-pw@db:1521/XE\n</oracle>')
        self.assertNotIn('t1ger-pw', repr(factory.config.adapter))
        self.assertIn('scott/***@db:1521/XE', repr(factory.config.adapter))

    def test_zodburi(self):
        from zodburi import resolve_uri
        factory, _ = resolve_uri('oracle://scott:t%40ger@dbhost:1522/ZODB?driver=cx_Oracle')
        adapter = factory.adapter_factory.create(factory.options)
        self.assertEqual(adapter.describe(),
                         "Oracle database service 'ZODB' at dbhost:1522 as user 'scott'")
        self.assertEqual(adapter._password, 't@ger')


# ----------------------------------------------------------------------
# The shared suite on a staging server.

def server_wanted():
    names = os.environ.get('RS_TEST_DATABASES')
    return bool(names) and 'oracle' in [n.strip() for n in names.split(',')]


class _Admin:
    """The RS_ORACLE_USER connection, creating and dropping test users."""

    _conn = None

    def conn(self):
        if self._conn is None:
            driver = drivers.select_driver('auto')
            self._conn = driver.module.connect(user=os.environ['RS_ORACLE_USER'],
                                               password=os.environ['RS_ORACLE_PASSWORD'],
                                               dsn=os.environ['RS_ORACLE_DSN'])
            self._conn.autocommit = True
        return self._conn

    def ensure_user(self, user, password):
        cur = self.conn().cursor()
        try:
            cur.execute('SELECT COUNT(*) FROM all_users WHERE username = :1', [user])
            if not cur.fetchone()[0]:
                # Identifiers cannot be bound; both are generated here.
                cur.execute('CREATE USER %s IDENTIFIED BY "%s"' % (user, password))
                cur.execute('GRANT CREATE SESSION, CREATE TABLE, CREATE SEQUENCE, '
                            'UNLIMITED TABLESPACE TO %s' % user)
            _created.add(user)
        finally:
            cur.close()

    def drop_users(self):
        if self._conn is None:
            return
        cur = self._conn.cursor()
        for user in sorted(_created):
            try:
                cur.execute('DROP USER %s CASCADE' % user)
            except Exception:  # pylint:disable=broad-except
                pass
        self._conn.close()


ADMIN = _Admin()
_created = set()
atexit.register(ADMIN.drop_users)
_PASSWORD = 'Rs' + secrets.token_hex(12)


class OracleFactory(suite.NamedDatabases):
    """One schema (user) per factory; ``fresh`` empties it."""

    name = 'oracle'
    big_blob_test = False

    def __init__(self, suffix=''):
        self.user = ('RSTEST_%d%s' % (os.getpid(), suffix)).upper()
        self.dsn = os.environ['RS_ORACLE_DSN']
        self._sibling = None
        self._named = {}
        self._fresh_in = None

    def fresh(self, keep_history):
        ADMIN.ensure_user(self.user, _PASSWORD)
        self.make_adapter(Options(keep_history=keep_history)).drop_all()

    def make_adapter(self, options):
        return OracleAdapter(user=self.user, password=_PASSWORD, dsn=self.dsn,
                             options=options)

    def sibling(self):
        if self._sibling is None:
            self._sibling = OracleFactory('_DST')
        return self._sibling

    def make_named(self, key):
        return OracleFactory('_N_' + key.upper())

    def write_subprocess_factory(self, directory, keep_history):
        with open(os.path.join(directory, 'factory_for_subprocess.py'), 'w') as f:
            f.write(SUBPROCESS_FACTORY % (keep_history, self.user, _PASSWORD, self.dsn))
        return directory

    def cleanup(self):
        pass


SUBPROCESS_FACTORY = """
from relstorage.adapters.oracle.adapter import OracleAdapter
KEEP_HISTORY = %r
def make_adapter(options):
    return OracleAdapter(user=%r, password=%r, dsn=%r, options=options)
"""


class LockTimeoutTests(suite_cases.FactoryCase):
    """Server only: bounded lock waits become retryable conflicts."""

    def begin_store(self, storage, oid, serial, value):
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        storage.store(oid, serial, zodb_pickle(MinPO(value)), '', txn)
        return txn

    def test_row_lock_timeout(self):
        from relstorage.interfaces import UnableToLockRowsError
        a = self.storage()
        b = self.storage(commit_lock_timeout=1)
        oid = a.new_oid()
        tid0 = self.commit(a, oid, z64, 'first')
        ta = self.begin_store(a, oid, tid0, 'a')
        a.tpc_vote(ta)
        tb = self.begin_store(b, oid, tid0, 'b')
        with self.assertRaises(UnableToLockRowsError):
            b.tpc_vote(tb)
        b.tpc_abort(tb)
        a.tpc_finish(ta)

    def test_commit_lock_timeout(self):
        from relstorage.interfaces import UnableToAcquireCommitLockError
        a = self.storage(commit_lock_timeout=1)
        oid = a.new_oid()
        tid0 = self.commit(a, oid, z64, 'first')
        holder = self.factory.make_adapter(Options()).connect('store')
        try:
            holder.cursor().execute('SELECT tid FROM commit_lock WHERE id = 0 FOR UPDATE')
            ta = self.begin_store(a, oid, tid0, 'a')
            a.tpc_vote(ta)
            with self.assertRaises(UnableToAcquireCommitLockError):
                a.tpc_finish(ta)
            a.tpc_abort(ta)
        finally:
            holder.rollback()
            holder.close()


class ServerSuiteNotRun(unittest.TestCase):
    reason = None

    def test_oracle_server_suite(self):
        self.skipTest(self.reason)


class ServerSuiteUnavailable(unittest.TestCase):
    reason = None

    def test_oracle_server_available(self):
        self.fail(self.reason)


def server_suite():
    loader = unittest.defaultTestLoader
    if not server_wanted():
        reason = ('no Oracle server: the shared suite runs on one when RS_TEST_DATABASES '
                  'names oracle and %s are set' % ', '.join(SERVER_VARIABLES))
        sys.stderr.write('test_oracle: %s\n' % reason)
        return loader.loadTestsFromTestCase(
            type('ServerSuiteNotRun', (ServerSuiteNotRun,), {'reason': reason}))
    missing = [name for name in SERVER_VARIABLES if not os.environ.get(name)]
    if missing:
        reason = ('RS_TEST_DATABASES names oracle but %s %s not set'
                  % (', '.join(missing), 'is' if len(missing) == 1 else 'are'))
        return loader.loadTestsFromTestCase(
            type('ServerSuiteUnavailable', (ServerSuiteUnavailable,), {'reason': reason}))
    factory = OracleFactory()
    tests = suite.make_suite(factory, extra_cases=(LockTimeoutTests,))
    _rehome(tests, factory)
    return tests


def _rehome(tests, factory):
    """Give the shared-suite tests ids under this module (``-t test_oracle``)."""
    for test in tests:
        if isinstance(test, unittest.TestSuite):
            _rehome(test, factory)
        elif hasattr(test, '_dt_test'):
            if not test._dt_test.name.startswith(__name__):
                test._dt_test.name = '%s.%s.%s' % (__name__, factory.name,
                                                   test._dt_test.name)
        elif type(test).__module__ == suite.__name__:
            type(test).__module__ = __name__


def _test_suite():
    loader = unittest.defaultTestLoader
    tests = unittest.TestSuite()
    for case in (StatementTests, BindPlanTests, BindingCursorTests, DriverTests, DSNTests,
                 ErrorTests, ConfigTests):
        tests.addTest(loader.loadTestsFromTestCase(case))
    tests.addTest(server_suite())
    return tests


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
