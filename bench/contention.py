"""Commits under contention: N processes increment shared objects.

    python -m bench.contention --db postgresql --processes 2,4,8 --txns 150

Each process runs ``--txns`` transactions; each transaction adds 1 to a
shared counter without conflict resolution (a MinPO), to a BTrees.Length
(which resolves conflicts) and to a key of a shared OOBTree, and is retried
on ConflictError until it commits.  Reported per process count: commits per
second, retries per commit, and the most attempts one transaction needed.
The final values are checked: every commit counted exactly once.

Databases: ``sqlite`` (a temporary directory), ``postgresql`` and ``mysql``
(databases named ``relstoragebench_contention_<pid>`` on the local test
servers, created and dropped here).  ``--history-preserving`` switches mode.
Run it from a directory outside the checkout to measure an installed copy;
the first line printed says which relstorage ran.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scratchdb import drop  # noqa: E402
from scratchdb import fresh  # noqa: E402
from scratchdb import open_storage  # noqa: E402

WORKER = r'''
import json, sys, time, transaction, ZODB
from ZODB.POSException import ConflictError
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec['bench_dir'])
from scratchdb import open_storage
txns = spec['txns']
db = ZODB.DB(open_storage(spec))
tm = transaction.TransactionManager()
conn = db.open(tm)
retries = worst = 0
conn.root()         # connected and polled before the clock starts
started = time.time()
for i in range(txns):
    for attempt in range(1, 10000):
        try:
            tm.begin()
            root = conn.root()
            root['counter'].value += 1
            root['length'].change(1)
            tree = root['tree']
            tree['k'] = tree.get('k', 0) + 1
            tm.commit()
            break
        except ConflictError:
            tm.abort()
            retries += 1
    worst = max(worst, attempt)
ended = time.time()
conn.close()
db.close()
print(json.dumps({'retries': retries, 'worst': worst, 'started': started, 'ended': ended}))
'''


def run(db, processes, txns, keep_history, where):
    import ZODB
    from BTrees.Length import Length
    from BTrees.OOBTree import OOBTree
    from ZODB.tests.MinPO import MinPO
    fresh(db, where)
    spec = {'db': db, 'where': where, 'keep_history': keep_history, 'txns': txns,
            'bench_dir': os.path.dirname(os.path.abspath(__file__))}
    zdb = ZODB.DB(open_storage(spec))
    with zdb.transaction() as conn:
        root = conn.root()
        root['counter'], root['length'], root['tree'] = MinPO(0), Length(), OOBTree()
    procs = [subprocess.Popen([sys.executable, '-c', WORKER, json.dumps(spec)],
                              stdout=subprocess.PIPE) for _ in range(processes)]
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit('a worker failed')
        results.append(json.loads(out))
    # From the first worker's first transaction to the last one's end: the
    # interpreters' start-up is not commit time.
    elapsed = max(r['ended'] for r in results) - min(r['started'] for r in results)
    total = processes * txns
    with zdb.transaction() as conn:
        root = conn.root()
        assert root['counter'].value == total, root['counter'].value
        assert root['length']() == total
        assert root['tree']['k'] == total
    zdb.close()
    drop(db, where)
    retries = sum(r['retries'] for r in results)
    return {'processes': processes, 'commits_per_s': total / elapsed,
            'retries_per_commit': retries / float(total),
            'worst_attempts': max(r['worst'] for r in results)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--db', default='sqlite', choices=('sqlite', 'postgresql', 'mysql'))
    parser.add_argument('--processes', default='2,4,8')
    parser.add_argument('--txns', type=int, default=150)
    parser.add_argument('--history-preserving', action='store_true')
    args = parser.parse_args(argv)
    import relstorage
    print('relstorage from %s' % os.path.dirname(relstorage.__file__))
    if args.db == 'sqlite':
        where = tempfile.mkdtemp(prefix='relstoragebench_contention_')
    else:
        where = 'relstoragebench_contention_%d' % os.getpid()
    mode = 'HP' if args.history_preserving else 'HF'
    print('%-10s %-4s %9s %12s %17s %14s' % ('database', 'mode', 'processes', 'commits/s',
                                            'retries/commit', 'worst attempts'))
    for n in [int(x) for x in args.processes.split(',')]:
        r = run(args.db, n, args.txns, args.history_preserving, where)
        print('%-10s %-4s %9d %12.1f %17.2f %14d' % (
            args.db, mode, n, r['commits_per_s'], r['retries_per_commit'],
            r['worst_attempts']))
        sys.stdout.flush()


if __name__ == '__main__':
    main()
