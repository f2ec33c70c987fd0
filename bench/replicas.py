"""Read replicas and failover: ``python -m bench.replicas``.

On a private PostgreSQL primary and hot standby (started and stopped by
``relstorage.tests.private_servers``, never the machine's own servers):

1. throughput of a read-mostly load (cold reads: no state cache, every
   transaction re-reads its objects; one transaction in 20 writes one
   object) for N client processes, against the primary alone and with
   ``ro-replica-conf`` naming the standby;
2. the cost of one load on the replica against one on the primary
   (single process, objects loaded one by one);
3. failover: the time from killing the primary to the first successful
   commit through ``replica-conf`` on the promoted standby, with the
   promotion itself (``pg_ctl promote``) measured apart.

Prints a Markdown table.  Options: ``--clients 1,2,4,8 --seconds 5
--objects 2000 --failovers 3``.
"""
import argparse
import multiprocessing
import os
import random
import statistics
import tempfile
import time

import transaction
import ZODB
from BTrees.OOBTree import OOBTree
from persistent.mapping import PersistentMapping

from relstorage.adapters.postgresql.adapter import PostgreSQLAdapter
from relstorage.options import Options
from relstorage.storage import RelStorage
from relstorage.tests.private_servers import PostgreSQLPair

READS_PER_TXN = 50
WRITE_EVERY = 20


def open_db(dsn, **options):
    options = Options(keep_history=False, cache_local_mb=0, **options)
    return ZODB.DB(RelStorage(PostgreSQLAdapter(dsn=dsn, options=options), options=options))


def populate(dsn, count):
    db = open_db(dsn)
    with db.transaction() as conn:
        tree = conn.root()['objs'] = OOBTree()
        for i in range(count):
            tree[i] = PersistentMapping(n=i, payload='x' * 100)
    db.close()


def client(dsn, options, count, seconds, seed, results):
    db = open_db(dsn, **options)
    rng = random.Random(seed)
    loads = txns = conflicts = 0
    tm = transaction.TransactionManager()
    conn = db.open(tm)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        try:
            with tm:
                tree = conn.root()['objs']
                keys = [rng.randrange(count) for _ in range(READS_PER_TXN)]
                for key in keys:
                    tree[key]['n']
                loads += len(keys)
                if txns % WRITE_EVERY == 0:
                    tree[keys[0]]['n'] += 1
            txns += 1
        except transaction.interfaces.TransientError:
            conflicts += 1
        conn.cacheMinimize()            # cold reads: the next transaction loads again
    conn.close()
    db.close()
    results.put((loads, txns, conflicts))


def throughput(dsn, options, clients, count, seconds):
    results = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=client,
                                     args=(dsn, options, count, seconds, i, results))
             for i in range(clients)]
    for proc in procs:
        proc.start()
    totals = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    loads = sum(t[0] for t in totals)
    conflicts = sum(t[2] for t in totals)
    return loads / seconds, conflicts


def load_costs(dsn, ro_conf, count, rounds=5):
    """Seconds per storage.load of an object on the primary and on the
    replica: the best of ``rounds`` passes each, the two interleaved so
    that both see the same machine."""
    opened = []
    instances = {}
    for name, extra in (('primary', {}), ('replica', {'ro_replica_conf': ro_conf})):
        options = Options(keep_history=False, cache_local_mb=0, **extra)
        storage = RelStorage(PostgreSQLAdapter(dsn=dsn, options=options), options=options)
        db = ZODB.DB(storage)
        opened.append(db)
        instances[name] = storage.new_instance()
    with opened[0].transaction() as conn:
        oids = [conn.root()['objs'][i]._p_oid for i in range(count)]
    # Random order: sequential read-ahead would batch the loads.
    random.Random(1).shuffle(oids)
    best = {}
    for _ in range(rounds):
        for name, instance in instances.items():
            instance.poll_invalidations()
            started = time.perf_counter()
            for oid in oids:
                instance.load(oid)
            elapsed = (time.perf_counter() - started) / len(oids)
            best[name] = min(best.get(name, elapsed), elapsed)
            instance.afterCompletion()
    for instance in instances.values():
        instance.release()
    for db in opened:
        db.close()
    return best['primary'], best['replica']


def failover(count):
    """(seconds from kill to first commit minus promotion, promotion seconds)."""
    pair = PostgreSQLPair().start()
    try:
        primary = pair.dsn('primary')
        populate(primary, count)
        pair.wait_caught_up()
        tmp = tempfile.mkdtemp()
        conf = os.path.join(tmp, 'servers.conf')
        with open(conf, 'w') as f:
            f.write('127.0.0.1:%d\n127.0.0.1:%d\n' % (pair.ports['primary'],
                                                      pair.ports['standby']))
        db = open_db(primary + ' connect_timeout=2', replica_conf=conf)
        tm = transaction.TransactionManager()
        conn = db.open(tm)
        with tm:
            conn.root()['objs'][0]['n'] += 1
        killed = time.perf_counter()
        pair.kill_server('primary')
        before = time.perf_counter()
        pair.promote('standby')
        promotion = time.perf_counter() - before
        while True:
            try:
                with tm:
                    conn.root()['objs'][0]['n'] += 1
                break
            except transaction.interfaces.TransientError:
                time.sleep(0.05)
        total = time.perf_counter() - killed
        conn.close()
        db.close()
        return total - promotion, promotion
    finally:
        pair.stop()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--clients', default='1,2,4,8')
    parser.add_argument('--seconds', type=float, default=5)
    parser.add_argument('--objects', type=int, default=2000)
    parser.add_argument('--failovers', type=int, default=3)
    args = parser.parse_args(argv)
    clients = [int(n) for n in args.clients.split(',')]

    pair = PostgreSQLPair().start()
    try:
        primary = pair.dsn('primary')
        populate(primary, args.objects)
        pair.wait_caught_up()
        tmp = tempfile.mkdtemp()
        ro_conf = os.path.join(tmp, 'ro.conf')
        with open(ro_conf, 'w') as f:
            f.write('127.0.0.1:%d\n' % pair.ports['standby'])
        targets = (('primary alone', {}), ('primary + replica', {'ro_replica_conf': ro_conf}))
        print('| clients | %s |' % ' | '.join('%s (loads/s)' % name for name, _ in targets))
        print('|---|%s' % ('---|' * len(targets)))
        for n in clients:
            cells = []
            for _, options in targets:
                rate, conflicts = throughput(primary, options, n, args.objects, args.seconds)
                cells.append('%.0f%s' % (rate, ' (%d retried)' % conflicts if conflicts else ''))
            print('| %d | %s |' % (n, ' | '.join(cells)))
        on_primary, on_replica = load_costs(primary, ro_conf, args.objects)
        print()
        print('One load (random order, no cache): primary %.1f µs, replica %.1f µs (%+.1f%%)'
              % (on_primary * 1e6, on_replica * 1e6, (on_replica / on_primary - 1) * 100))
    finally:
        pair.stop()

    if args.failovers:
        runs = [failover(min(args.objects, 200)) for _ in range(args.failovers)]
        print()
        print('Failover, kill of the primary to the first commit on the promoted standby: '
              'median %.2f s plus the promotion (median %.2f s); runs: %s'
              % (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                 ', '.join('%.2f+%.2f s' % r for r in runs)))


if __name__ == '__main__':
    main()
