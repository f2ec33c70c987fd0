"""Server time of the conflict check before and after, against table size.

    cd /tmp && python /path/to/bench/conflict_plan.py

On the local PostgreSQL, an object_state table of 10,000, 100,000 and
1,000,000 rows (ANALYZEd, as autovacuum would) and a freshly filled
temp_store of 1000 rows (never analysed, as in a commit): EXPLAIN ANALYZE of
the conflict check of the tree before (a join of temp_store with
object_state; the row locks were a statement of their own) and of the row
lock statement that now also returns the tids the check needs.  Prints the
median execution time of 5 and the plan's nodes.
"""
import os

import psycopg

SERVER = 'host=127.0.0.1 user=postgres dbname=%s'
SIZES = (10000, 100000, 1000000)
OLD = """
    EXPLAIN (ANALYZE, FORMAT JSON)
    SELECT t.zoid, s.tid, t.prev_tid FROM temp_store t
    JOIN object_state s ON s.zoid = t.zoid WHERE s.tid <> t.prev_tid
"""
NEW = """
    EXPLAIN (ANALYZE, FORMAT JSON)
    SELECT zoid, tid FROM object_state WHERE zoid = ANY(%s::bigint[])
    ORDER BY zoid FOR UPDATE
"""


def admin(statement):
    with psycopg.connect(SERVER % 'postgres', autocommit=True) as conn:
        conn.execute(statement)


def nodes(plan):
    found = [plan['Node Type']]
    for child in plan.get('Plans', ()):
        found += nodes(child)
    return found


def main():
    name = 'relstoragebench_plans_%d' % os.getpid()
    admin('DROP DATABASE IF EXISTS %s' % name)
    admin('CREATE DATABASE %s' % name)
    try:
        with psycopg.connect(SERVER % name, autocommit=True) as conn:
            conn.execute('CREATE TABLE object_state (zoid BIGINT PRIMARY KEY, '
                         'tid BIGINT NOT NULL, state_size BIGINT NOT NULL, state BYTEA)')
            done = 0
            for size in SIZES:
                conn.execute("INSERT INTO object_state SELECT g, 1, 128, "
                             "decode(repeat('ab', 128), 'hex') "
                             "FROM generate_series(%s::bigint, %s::bigint) g", (done + 1, size))
                done = size
                conn.execute('ANALYZE object_state')
                conn.autocommit = False
                conn.execute('CREATE TEMP TABLE temp_store (zoid BIGINT PRIMARY KEY, '
                             'prev_tid BIGINT NOT NULL, state BYTEA) ON COMMIT DROP')
                oids = list(range(size // 2, size // 2 + 1000))
                with conn.cursor().copy('COPY temp_store (zoid, prev_tid, state) '
                                        'FROM STDIN') as copy:
                    for oid in oids:
                        copy.write_row((oid, 1, b'x' * 128))
                for label, sql, params in (
                        ('before: join with temp_store', OLD, None),
                        ('now: row locks with their tids', NEW,
                         ('{%s}' % ','.join(map(str, oids)),))):
                    times = []
                    for _ in range(5):
                        plan = conn.execute(sql, params).fetchone()[0][0]
                        times.append(plan['Execution Time'])
                    times.sort()
                    print('%8d rows  %-32s %6.2f ms  plan: %s'
                          % (size, label, times[2], ' > '.join(nodes(plan['Plan']))))
                conn.rollback()
                conn.autocommit = True
    finally:
        admin('DROP DATABASE IF EXISTS %s' % name)


if __name__ == '__main__':
    main()
