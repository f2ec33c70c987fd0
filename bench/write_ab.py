"""The write phases, for comparing two trees of our own side by side.

    cd /tmp && python /path/to/bench/write_ab.py --db postgresql \\
        --trees /work/old,/work/new --rounds 5

For each round and each tree (alternating A B A B, each run a fresh
process on a fresh database), times zodbshootout's write phases with 1000
objects of 128 bytes through ZODB.DB:

- ``add``: one transaction adding 1000 objects;
- ``update``: one transaction changing them all;
- ``conflicting``: one transaction changing all 1000 while another
  connection has changed them since (each resolved by _p_resolveConflict).

Prints the median of the rounds per tree and phase, and the ratio
(first tree / second tree; above 1 means the second is faster).  Each run
prints which relstorage it imported, so the report shows what ran.
"""
import argparse
import os
import statistics

from scratchdb import run_in_tree

RUN = r'''
import json, os, sys, time, shutil, tempfile, transaction, ZODB
import relstorage
from persistent import Persistent
from persistent.list import PersistentList
sys.path.insert(0, sys.argv[2])
from scratchdb import open_storage, fresh, drop
spec = json.loads(sys.argv[1])
N = 1000


class Counter(Persistent):
    def __init__(self):
        self.value = 0
        self.pad = b'x' * 100

    def _p_resolveConflict(self, old, committed, new):
        result = dict(new)
        result['value'] = committed['value'] + new['value'] - old['value']
        return result


sys.modules['__main__'].Counter = Counter
fresh(spec['db'], spec['where'])
db = ZODB.DB(open_storage(spec))
out = {'relstorage': os.path.dirname(relstorage.__file__)}
tm1, tm2 = transaction.TransactionManager(), transaction.TransactionManager()
c1, c2 = db.open(tm1), db.open(tm2)


def timed_commit(tm):
    t = time.perf_counter()
    tm.commit()
    return time.perf_counter() - t


def bump(objects):
    for o in objects:
        o.value += 1


objs = [Counter() for _ in range(N)]
c1.root()['objs'] = PersistentList(objs)
out['add'] = timed_commit(tm1)
bump(objs)
out['update'] = timed_commit(tm1)
tm2.begin()
bump(c2.root()['objs'])
tm2.commit()
bump(objs)                       # now stale: every object conflicts
out['conflicting'] = timed_commit(tm1)
tm2.begin()
assert sum(o.value for o in c2.root()['objs']) == 3 * N
c1.close(); c2.close(); db.close()
drop(spec['db'], spec['where'])
print(json.dumps(out))
'''


PHASES = ('add', 'update', 'conflicting')


def main(argv=None, run=RUN, phases=PHASES, description=__doc__.splitlines()[0]):
    """Time ``phases`` (keys of the JSON the script ``run`` prints)
    for two trees, alternating; read_ab.py uses it with its own script."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument('--db', default='sqlite', choices=('sqlite', 'postgresql', 'mysql'))
    parser.add_argument('--trees', required=True, help='two checkouts, comma-separated')
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--history-preserving', action='store_true')
    args = parser.parse_args(argv)
    trees = args.trees.split(',')
    here = os.path.dirname(os.path.abspath(__file__))
    where = ('/tmp/relstoragebench_ab_%d' % os.getpid() if args.db == 'sqlite'
             else 'relstoragebench_ab_%d' % os.getpid())
    spec = {'db': args.db, 'where': where, 'keep_history': args.history_preserving}
    times = {tree: {p: [] for p in phases} for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            result = run_in_tree(tree, run, spec, here)
            for p in phases:
                times[tree][p].append(result[p] * 1000)
    a, b = trees
    print('%s %s, %d rounds, median ms (ran: %s | %s)'
          % (args.db, 'HP' if args.history_preserving else 'HF', args.rounds, a, b))
    for p in phases:
        ma, mb = statistics.median(times[a][p]), statistics.median(times[b][p])
        print('  %-12s %8.1f %8.1f   ratio %.2f' % (p, ma, mb, ma / mb))


if __name__ == '__main__':
    main()
