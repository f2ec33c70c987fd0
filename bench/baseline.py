"""Bare-driver baseline: what the database itself costs for each phase.

The same round trips a storage needs, done directly with the same DB-API
driver on a one-table schema (``zoid`` primary key, ``tid``, ``state``),
with ``objects`` states of ``object_size`` bytes:

``add``
    one bulk INSERT of all rows (new primary keys), then COMMIT;
``update``
    one bulk upsert of the same rows with new states, then COMMIT;
``cold``
    one single-row primary-key SELECT per object (``objects`` round trips);
``prefetch_cold``
    one SELECT of all rows (``WHERE zoid IN (...)``);
``tpc``
    the smallest durable commit: update one row, COMMIT;
``empty_commit``
    (shown, not used for ratios) a transaction of one ``SELECT 1``, then
    COMMIT: the round trips of a commit with nothing to flush.

On servers the bulk statements are one multi-row ``VALUES`` list (one
round trip). SQLite runs in-process, so there ``executemany`` in one
transaction is the bulk form; its connections use the same settings as
the RelStorage SQLite adapter (WAL, synchronous=FULL, BEGIN IMMEDIATE for
writes). Each phase is repeated ``repeat`` times after one warm-up.
"""
import os
import random
import time

from .targets import (Unavailable, mysql_create, mysql_drop, mysql_settings,
                      pg_create, pg_drop, pg_dsn_for, safe_message, DB_PREFIX)

PHASES = ('add', 'update', 'cold', 'prefetch_cold', 'tpc', 'empty_commit')


class _Bare:
    placeholder = '%s'
    in_chunk = 1000

    def __init__(self, driver):
        self.driver = driver

    def create_schema(self, cur):
        for stmt in self.SCHEMA:
            cur.execute(stmt)

    def values_sql(self, n, width=3):
        row = '(' + ', '.join([self.placeholder] * width) + ')'
        return ', '.join([row] * n)

    def bulk_insert(self, cur, rows):
        params = [v for row in rows for v in row]
        cur.execute('INSERT INTO object_state (zoid, tid, state) VALUES '
                    + self.values_sql(len(rows)), params)

    def bulk_upsert(self, cur, rows):
        params = [v for row in rows for v in row]
        cur.execute('INSERT INTO object_state (zoid, tid, state) VALUES '
                    + self.values_sql(len(rows)) + self.UPSERT_TAIL, params)

    def begin_write(self, conn, cur):
        pass

    def begin_read(self, conn, cur):
        pass

    def end_read(self, conn):
        conn.rollback()


class _PG(_Bare):
    SCHEMA = (
        'CREATE TABLE object_state (zoid BIGINT PRIMARY KEY, '
        'tid BIGINT NOT NULL, state BYTEA)',
        'CREATE TABLE commit_counter (id INTEGER PRIMARY KEY, n BIGINT)',
        'INSERT INTO commit_counter VALUES (0, 0)',
    )
    UPSERT_TAIL = (' ON CONFLICT (zoid) DO UPDATE SET tid = EXCLUDED.tid, '
                   'state = EXCLUDED.state')

    def setup(self, tag):
        self.dbname = DB_PREFIX + 'baseline_' + tag
        pg_create(self.dbname)

    def connect(self):
        module = __import__(self.driver)
        return module.connect(pg_dsn_for(self.dbname))

    def teardown(self):
        pg_drop(self.dbname)


class _MySQL(_Bare):
    SCHEMA = (
        'CREATE TABLE object_state (zoid BIGINT PRIMARY KEY, '
        'tid BIGINT NOT NULL, state LONGBLOB) ENGINE = InnoDB',
        'CREATE TABLE commit_counter (id INTEGER PRIMARY KEY, n BIGINT) '
        'ENGINE = InnoDB',
        'INSERT INTO commit_counter VALUES (0, 0)',
    )
    UPSERT_TAIL = (' ON DUPLICATE KEY UPDATE tid = VALUES(tid), '
                   'state = VALUES(state)')

    def setup(self, tag):
        self.dbname = DB_PREFIX + 'baseline_' + tag
        mysql_create(self.dbname)

    def connect(self):
        settings = dict(mysql_settings(), db=self.dbname)
        if self.driver == 'MySQLdb':
            import MySQLdb
            return MySQLdb.connect(**settings)
        import pymysql
        return pymysql.connect(**settings)

    def teardown(self):
        mysql_drop(self.dbname)


class _Sqlite(_Bare):
    placeholder = '?'
    SCHEMA = (
        'CREATE TABLE object_state (zoid INTEGER PRIMARY KEY, '
        'tid INTEGER NOT NULL, state BLOB)',
        'CREATE TABLE commit_counter (id INTEGER PRIMARY KEY, n INTEGER)',
        'INSERT INTO commit_counter VALUES (0, 0)',
    )
    UPSERT_TAIL = (' ON CONFLICT (zoid) DO UPDATE SET tid = excluded.tid, '
                   'state = excluded.state')

    def __init__(self, driver, scratch):
        _Bare.__init__(self, driver)
        self.scratch = scratch

    def setup(self, tag):
        self.path = os.path.join(self.scratch, DB_PREFIX + 'baseline_%s.sqlite3'
                                 % tag)
        self._remove()

    def connect(self):
        import sqlite3
        conn = sqlite3.connect(self.path, isolation_level=None)
        conn.execute('PRAGMA journal_mode = wal')
        conn.execute('PRAGMA synchronous = full')
        return _SqliteConn(conn)

    def bulk_insert(self, cur, rows):
        cur.executemany('INSERT INTO object_state (zoid, tid, state) '
                        'VALUES (?, ?, ?)', rows)

    def bulk_upsert(self, cur, rows):
        cur.executemany('INSERT INTO object_state (zoid, tid, state) '
                        'VALUES (?, ?, ?)' + self.UPSERT_TAIL, rows)

    def begin_write(self, conn, cur):
        cur.execute('BEGIN IMMEDIATE')

    def begin_read(self, conn, cur):
        cur.execute('BEGIN DEFERRED')

    def teardown(self):
        self._remove()

    def _remove(self):
        for suffix in ('', '-wal', '-shm', '-journal'):
            if os.path.exists(self.path + suffix):
                os.remove(self.path + suffix)


class _SqliteConn:
    """sqlite3 in autocommit mode with explicit BEGIN, like the adapter."""

    def __init__(self, conn):
        self.conn = conn

    def cursor(self):
        return self.conn.cursor()

    def commit(self):
        if self.conn.in_transaction:
            self.conn.execute('COMMIT')

    def rollback(self):
        if self.conn.in_transaction:
            self.conn.execute('ROLLBACK')

    def close(self):
        self.conn.close()


def _bare_for(database, driver, scratch):
    if database == 'postgresql':
        return _PG(driver)
    if database == 'mysql':
        return _MySQL(driver)
    if database == 'sqlite':
        return _Sqlite(driver, scratch)
    raise ValueError(database)


def run(target, scratch, objects=1000, object_size=128, repeat=15):
    """Time each phase; return ``{phase: {'status': 'ok', 'values': [...]}}``
    (seconds per phase), or raise Unavailable."""
    bare = _bare_for(target.database, target.driver, scratch)
    tag = target.driver.lower()
    try:
        bare.setup(tag)
    except Exception as e:
        raise Unavailable('baseline database: %s' % safe_message(e))
    try:
        conn = bare.connect()
        try:
            return _phases(bare, conn, objects, object_size, repeat)
        finally:
            conn.close()
    finally:
        bare.teardown()


def _phases(bare, conn, objects, object_size, repeat):
    rnd = random.Random(42)
    cur = conn.cursor()
    bare.begin_write(conn, cur)
    bare.create_schema(cur)
    conn.commit()

    def states():
        return [rnd.randbytes(object_size) for _ in range(objects)]

    times = {p: [] for p in PHASES}
    next_oid = [1]
    written = []  # the oids of the most recent add, read by the reads

    def timed(phase, func, *args):
        begin = time.perf_counter()
        func(*args)
        times[phase].append(time.perf_counter() - begin)

    def add(rows):
        bare.begin_write(conn, cur)
        bare.bulk_insert(cur, rows)
        conn.commit()

    def update(rows):
        bare.begin_write(conn, cur)
        bare.bulk_upsert(cur, rows)
        conn.commit()

    select_one = ('SELECT tid, state FROM object_state WHERE zoid = %s'
                  % bare.placeholder)

    def cold(oids):
        bare.begin_read(conn, cur)
        for oid in oids:
            cur.execute(select_one, (oid,))
            row = cur.fetchone()
            assert row is not None
        bare.end_read(conn)

    def prefetch(oids):
        bare.begin_read(conn, cur)
        got = 0
        for start in range(0, len(oids), bare.in_chunk):
            chunk = oids[start:start + bare.in_chunk]
            cur.execute('SELECT zoid, tid, state FROM object_state '
                        'WHERE zoid IN (%s)'
                        % ', '.join([bare.placeholder] * len(chunk)), chunk)
            got += len(cur.fetchall())
        assert got == len(oids), got
        bare.end_read(conn)

    def durable_commit():
        bare.begin_write(conn, cur)
        cur.execute('UPDATE commit_counter SET n = n + 1 WHERE id = 0')
        conn.commit()

    def empty_commit():
        bare.begin_write(conn, cur)
        cur.execute('SELECT 1')
        cur.fetchall()
        conn.commit()

    tid = 1
    for i in range(repeat + 1):  # the first round is a warm-up
        first = next_oid[0]
        oids = list(range(first, first + objects))
        next_oid[0] += objects
        tid += 1
        rows = [(oid, tid, s) for oid, s in zip(oids, states())]
        timed('add', add, rows)
        tid += 1
        rows = [(oid, tid, s) for oid, s in zip(oids, states())]
        timed('update', update, rows)
        shuffled = oids[:]
        rnd.shuffle(shuffled)
        timed('cold', cold, shuffled)
        timed('prefetch_cold', prefetch, shuffled)
        timed('tpc', durable_commit)
        timed('empty_commit', empty_commit)
        if i == 0:
            for values in times.values():
                del values[:]
    cur.close()
    return {phase: {'status': 'ok', 'values': values}
            for phase, values in times.items()}
