"""Database sessions one process holds under a read-mostly load.

    cd /tmp && python /path/to/bench/sessions.py --db postgresql \\
        [--trees /work/old,/work/new] [--threads 8] [--rounds 200]

For each tree (a fresh process on a fresh database each), 8 threads each
open a ZODB connection (ZODB.DB, pool size 7 as ZODB's default) and run
``--rounds`` transactions: read 100 objects and spend 2 ms (a page being
rendered; a sleep, so threads overlap as in a server), and in one
transaction out of ``--write-every`` (10) change one of them.  A monitor counts the server-side sessions on the
benchmark database every 20 ms (PostgreSQL: ``pg_stat_activity``;
MariaDB: ``information_schema.processlist``), from a session of its own on
another database, so it never counts itself.  Reported, per tree:

- ``peak``: the most sessions seen while the load ran;
- ``open``: sessions when every thread has finished its transactions but
  still holds its ZODB connection open;
- ``closed``: after every ZODB connection was closed (back in the DB's pool);
- ``later``: one more transaction (one connection, one change) after the
  sessions idled past the pool's idle limit (``IDLE_CLOSE_AFTER`` in
  relstorage/adapters/sessions.py, 60 s, set to 1 s here to keep the run
  short; trees without it just wait the same 1.5 s).

Each run prints which relstorage it imported, so the report shows what ran.
"""
import argparse
import json
import os
import subprocess
import sys

RUN = r'''
import json, os, sys, threading, time, transaction, ZODB
import relstorage
from persistent.mapping import PersistentMapping
sys.path.insert(0, sys.argv[2])
from scratchdb import open_storage, fresh, drop
spec = json.loads(sys.argv[1])
THREADS, ROUNDS, OBJECTS = spec['threads'], spec['rounds'], 100


def count_sessions():
    if spec['db'] == 'postgresql':
        import psycopg
        with psycopg.connect('host=127.0.0.1 user=postgres dbname=postgres',
                             autocommit=True) as conn:
            return conn.execute('SELECT count(*) FROM pg_stat_activity WHERE datname = %s',
                                (spec['where'],)).fetchone()[0]
    import MySQLdb
    conn = MySQLdb.connect(host='127.0.0.1', user='root', passwd='')
    try:
        cur = conn.cursor()
        cur.execute('SELECT count(*) FROM information_schema.processlist WHERE db = %s',
                    (spec['where'],))
        return cur.fetchone()[0]
    finally:
        conn.close()


fresh(spec['db'], spec['where'])
db = ZODB.DB(open_storage(spec), pool_size=7)
out = {'relstorage': os.path.dirname(relstorage.__file__)}
conn = db.open()
for i in range(OBJECTS):
    conn.root()[i] = PersistentMapping(value=0)
transaction.commit()
conn.close()

peak = [0]
done = threading.Event()


def monitor():
    while not done.is_set():
        peak[0] = max(peak[0], count_sessions())
        time.sleep(0.02)


finished = threading.Barrier(THREADS + 1)
release = threading.Event()


def worker(n):
    tm = transaction.TransactionManager()
    c = db.open(tm)
    for r in range(ROUNDS):
        tm.begin()
        root = c.root()
        total = sum(root[i]['value'] for i in range(OBJECTS))
        time.sleep(0.002)
        if r % spec['write_every'] == n % spec['write_every']:
            root[(n * 7 + r) % OBJECTS]['value'] += 1
        try:
            tm.commit()
        except Exception:
            tm.abort()
    finished.wait()
    release.wait()
    c.close()


mon = threading.Thread(target=monitor)
mon.start()
threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
for t in threads:
    t.start()
finished.wait()
out['open'] = count_sessions()
release.set()
for t in threads:
    t.join()
done.set()
mon.join()
out['peak'] = peak[0]
out['closed'] = count_sessions()
try:
    from relstorage.adapters import sessions
    sessions.IDLE_CLOSE_AFTER = 1.0
except ImportError:
    pass
time.sleep(1.5)
with db.transaction() as c:
    c.root()[0]['value'] += 1
out['later'] = count_sessions()
db.close()
for _ in range(20):
    # (PostgreSQL lists a backend until it has exited.)
    out['after_close'] = count_sessions()
    if not out['after_close']:
        break
    time.sleep(0.05)
drop(spec['db'], spec['where'])
print(json.dumps(out))
'''


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--db', choices=('postgresql', 'mysql'), default='postgresql')
    parser.add_argument('--trees', default=None,
                        help="comma-separated source trees to compare (default: the "
                             "relstorage this python imports)")
    parser.add_argument('--threads', type=int, default=8)
    parser.add_argument('--rounds', type=int, default=200)
    parser.add_argument('--write-every', type=int, default=10)
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    trees = args.trees.split(',') if args.trees else [None]
    for n, tree in enumerate(trees):
        spec = {'db': args.db, 'where': 'rs_sessions_%d_%d' % (os.getpid(), n),
                'keep_history': True, 'threads': args.threads, 'rounds': args.rounds,
                'write_every': args.write_every}
        env = dict(os.environ)
        if tree:
            env['PYTHONPATH'] = tree
        proc = subprocess.run([sys.executable, '-c', RUN, json.dumps(spec), here],
                              env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
            sys.exit(proc.stderr)
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        print("%-32s peak %3d  open %3d  closed %3d  later %3d  after db.close %3d"
              % (out['relstorage'], out['peak'], out['open'], out['closed'],
                 out['later'], out['after_close']))


if __name__ == '__main__':
    main()
