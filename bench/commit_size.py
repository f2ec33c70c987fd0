"""The cost of a 1000-object commit against the size of the database.

    cd /tmp && python /path/to/bench/commit_size.py --trees /work/new \\
        --sizes 10000,1000000 --rounds 5
    cd /tmp && python /path/to/bench/commit_size.py --trees /work/old,/work/new

PostgreSQL (history-free) on the local test server.  For each size, a fresh
database gets that many existing objects of 128 bytes (written straight
into ``object_state`` with ``generate_series``, then ANALYZEd as autovacuum
would; the OID sequence is moved past them), and then, in a fresh process
per tree and round (trees alternating), ZODB.DB commits:

- ``add``: 1000 new objects (and the root that holds their list);
- ``update``: the same 1000 objects changed;
- ``update-old``: 1000 of the pre-existing objects changed (read first).

Prints the median and the spread (lowest-highest) of the rounds, in ms,
per tree, size and phase, and which relstorage each run imported.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from scratchdb import run_in_tree

RUN = r'''
import json, os, sys, time, transaction, ZODB
import relstorage
from persistent import Persistent
from persistent.list import PersistentList
sys.path.insert(0, sys.argv[2])
from scratchdb import open_storage
spec = json.loads(sys.argv[1])
N = 1000


class Item(Persistent):
    def __init__(self):
        self.value = 0
        self.pad = b'x' * 100


sys.modules['__main__'].Item = Item
db = ZODB.DB(open_storage(spec))
out = {'relstorage': os.path.dirname(relstorage.__file__)}
conn = db.open()
root = conn.root()


def timed_commit():
    t = time.perf_counter()
    transaction.commit()
    return time.perf_counter() - t


# A first commit opens the store connection (and makes its temporary
# tables): not what is measured.
root['warm'] = 1
transaction.commit()
objs = [Item() for _ in range(N)]
root['objs'] = PersistentList(objs)
out['add'] = timed_commit()
for o in objs:
    o.value += 1
out['update'] = timed_commit()
# Pre-existing objects (written by the filler as pickles of Item).
start = spec['old_from']
old = [conn.get((start + i).to_bytes(8, 'big')) for i in range(N)]
for o in old:
    o.value += 1
out['update-old'] = timed_commit()
conn.close()
db.close()
print(json.dumps(out))
'''

PHASES = ('add', 'update', 'update-old')


def _pg(dbname, statements):
    import psycopg
    with psycopg.connect('host=127.0.0.1 user=postgres dbname=%s' % dbname,
                         autocommit=True) as conn:
        for stmt in statements:
            conn.execute(stmt)


def fill(where, size, tree, here):
    """A fresh database with ``size`` objects; returns the first filler OID."""
    _pg('postgres', ['DROP DATABASE IF EXISTS %s' % where, 'CREATE DATABASE %s' % where])
    # The schema, made by the storage itself.
    code = ('import sys, json; sys.path.insert(0, sys.argv[2]); '
            'from scratchdb import open_storage; '
            's = open_storage(json.loads(sys.argv[1])); s.close()')
    spec = json.dumps({'db': 'postgresql', 'where': where, 'keep_history': False})
    subprocess.run([sys.executable, '-c', code, spec, here], check=True, cwd='/tmp',
                   env=dict(os.environ, PYTHONPATH=tree))
    # A pickle of Item (module __main__) with value 0, as ZODB writes it:
    # the class, then the state.
    import io
    import pickle

    class Item:
        pass
    Item.__module__ = '__main__'
    Item.__qualname__ = Item.__name__ = 'Item'
    sys.modules['__main__'].Item = Item
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, 3)
    pickler.dump(Item)
    pickler.dump({'value': 0, 'pad': b'x' * 100})
    data = buf.getvalue()
    first = 1000000
    _pg(where, [
        "INSERT INTO object_state (zoid, tid, state_size, state) "
        "SELECT g, 1, %d, '\\x%s'::bytea FROM generate_series(%d, %d) g"
        % (len(data), data.hex(), first, first + size - 1),
        "UPDATE commit_lock SET tid = GREATEST(tid, 1) WHERE id = 0",
        "SELECT setval('zoid_seq', %d)" % (first + size + 100000),
        "ANALYZE object_state",
    ])
    return first


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--trees', required=True, help='one or more checkouts, comma-separated')
    parser.add_argument('--sizes', default='10000,1000000')
    parser.add_argument('--rounds', type=int, default=5)
    args = parser.parse_args(argv)
    trees = args.trees.split(',')
    here = os.path.dirname(os.path.abspath(__file__))
    where = 'relstoragebench_size_%d' % os.getpid()
    results = {}
    try:
        for size in [int(s) for s in args.sizes.split(',')]:
            first = fill(where, size, trees[0], here)
            spec = {'db': 'postgresql', 'where': where, 'keep_history': False,
                    'old_from': first}
            times = {tree: {p: [] for p in PHASES} for tree in trees}
            for _ in range(args.rounds):
                for tree in trees:
                    result = run_in_tree(tree, RUN, spec, here)
                    for p in PHASES:
                        times[tree][p].append(result[p] * 1000)
            results[size] = times
            print('PostgreSQL HF, %d existing objects, %d rounds, ms median (lowest-highest)'
                  % (size, args.rounds))
            for tree in trees:
                print('  %s (ran %s)' % (tree, tree))
                for p in PHASES:
                    v = times[tree][p]
                    print('    %-11s %7.1f  (%.1f-%.1f)'
                          % (p, statistics.median(v), min(v), max(v)))
            sys.stdout.flush()
    finally:
        _pg('postgres', ['DROP DATABASE IF EXISTS %s' % where])
    return results


if __name__ == '__main__':
    main()
