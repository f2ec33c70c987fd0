"""How much the state cache saves: ms to read 1000 small objects.

Not a test (nothing is asserted).  Prints one line per scenario, the
median of ``--repeat`` runs, each run reading ``--count`` objects of about
``--size`` bytes (pickle size) through a ZODB connection whose object cache
was emptied first, so that every object goes through ``storage.load``::

    .venv/bin/python -m bench.cache_bench                     # SQLite
    .venv/bin/python -m bench.cache_bench --db postgresql \\
        --dsn 'host=127.0.0.1 user=postgres'                  # PostgreSQL

Scenarios
  cold        a new storage (empty caches) in this process: every load queries
              (in OID order, read-ahead reads 128 objects per query)
  local       the same storage again: every state and tid from the local cache
  mc-fresh    a fresh process with memcached, states put there by another
              process, which also published its hot list: the fresh process
              warms its local cache from memcached at its first poll
  redis-fresh the same with Redis as the shared cache
  db-fresh    the same fresh process without a shared cache
  *-nohot-random  a fresh process reading in random order after the hot
              list was dropped: one request to the shared cache per state
  *-random    the same, reading the objects in a shuffled order (no
              read-ahead); "+open" adds opening the storage and the first
              poll (which includes the warm start) to the reads
  mc-polled   a running process whose poll told it the new tids of 1000
              objects another process just rewrote: states from memcached
  redis-polled  the same with Redis
  db-polled   the same without a shared cache (states from the database)
  get-*, get_many-*   the shared-cache clients alone: ``--count`` single
              gets, then the same keys in batches of 100
  blobs-*     a fresh process with an empty blob-dir reading ``--blobs``
              blobs of ``--blob-size`` bytes (ms per blob): from the shared
              cache (where another process's reads put them) or from the
              database

memcached (``/usr/bin/memcached``) and Redis (``redis-server``, without
persistence) are started on free 127.0.0.1 ports, each in a session of its
own as services run (with the kernel's autogroup scheduling, a server in
the benchmark's session would share its CPU share).
"""
import argparse
import gc
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import transaction
import ZODB
from persistent.mapping import PersistentMapping
from ZODB.utils import p64

from relstorage.options import Options
from relstorage.storage import RelStorage

PG_BENCH_DB = 'relstorage_cache_bench'


def make_adapter(args, options):
    if args.db == 'sqlite':
        from relstorage.adapters.sqlite.adapter import Sqlite3Adapter
        return Sqlite3Adapter(args.data_dir, options=options)
    from relstorage.adapters.postgresql.adapter import PostgreSQLAdapter
    return PostgreSQLAdapter(dsn='%s dbname=%s' % (args.dsn, PG_BENCH_DB), options=options)


def open_db(args, **kw):
    options = Options(keep_history=False, **kw)
    return ZODB.DB(RelStorage(make_adapter(args, options), options=options))


def populate(args):
    db = open_db(args, cache_local_mb=0)
    with db.transaction() as conn:
        probe = PersistentMapping(v=b'')
        conn.add(probe)
    overhead = len(db.storage.load(probe._p_oid)[0])
    payload = max(1, args.size - overhead)
    oids = []
    with db.transaction() as conn:
        objs = [PersistentMapping(v=b'x' * payload) for _ in range(args.count)]
        for obj in objs:
            conn.add(obj)
    oids = [obj._p_oid for obj in objs]
    size = len(db.storage.load(oids[0])[0])
    db.close()
    return oids, size


def rewrite(args, oids, **kw):
    db = open_db(args, **kw)
    with db.transaction() as conn:
        for oid in oids:
            obj = conn.get(oid)
            obj['v'] = obj['v'][:-1] + b'y'
    db.close()


def timed_read(db, oids, conn=None):
    """ms to load every object once through a connection with an empty cache."""
    own = conn is None
    if own:
        conn = db.open(transaction.TransactionManager())
    conn.transaction_manager.begin()         # poll, then read in that snapshot
    conn.cacheMinimize()
    start = time.perf_counter()
    for oid in oids:
        conn.get(oid)._p_activate()
    elapsed = (time.perf_counter() - start) * 1000
    conn.transaction_manager.abort()
    if own:
        conn.close()
    return elapsed


def child_read(args):
    """A fresh process: open, read once, print the ms.

    ``open_ms`` is the time to open the storage and begin the first
    transaction (connections, first poll, and with a shared cache the warm
    start); ``ms`` the reads alone, after a full garbage collection.
    """
    oids = [p64(int(o)) for o in args.oids.split(',')]
    if args.shuffle:
        random.Random(42).shuffle(oids)
    kw = {'cache_servers': args.servers} if args.servers else {}
    start = time.perf_counter()
    db = open_db(args, **kw)
    conn = db.open(transaction.TransactionManager())
    conn.transaction_manager.begin()
    open_ms = (time.perf_counter() - start) * 1000
    # A full collection now, not during the reads: the objects that opening
    # created (imports: the redis package alone adds about 11000) otherwise
    # make the reads of some processes pay for one, of others not.
    gc.collect()
    ms = timed_read(db, oids, conn)
    conn.close()
    stats = db.storage.cache_stats()
    db.close()
    print(json.dumps({'ms': ms, 'open_ms': open_ms, 'db_loads': stats['db_loads'],
                      'shared_hits': stats.get('shared', {}).get('hits', 0),
                      'warmed': stats['warmed_from_shared']}))


def fresh_process(args, oids, servers=None, shuffle=False):
    cmd = [sys.executable, '-m', 'bench.cache_bench', '--child-read', '--db', args.db,
           '--data-dir', args.data_dir or '', '--dsn', args.dsn,
           '--oids', ','.join(str(int.from_bytes(o, 'big')) for o in oids)]
    if servers:
        cmd += ['--servers', servers]
    if shuffle:
        cmd.append('--shuffle')
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def drop_hot_list(args, servers):
    """Replace the published hot list by an empty one (a storage without
    a local cache neither warms from it nor publishes its own)."""
    db = open_db(args, cache_servers=servers, cache_local_mb=0)
    db.storage._cache.shared.set_hot(0, [])
    db.close()


def start_server(cmd, port):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)
    for _ in range(100):
        try:
            socket.create_connection(('127.0.0.1', port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def start_memcached():
    port = free_port()
    cmd = ['memcached', '-l', '127.0.0.1', '-p', str(port), '-U', '0', '-m', '64']
    if os.geteuid() == 0:
        cmd += ['-u', 'root']
    return start_server(cmd, port), '127.0.0.1:%d' % port


def start_redis(tmp):
    port = free_port()
    cmd = ['redis-server', '--bind', '127.0.0.1', '--port', str(port), '--save', '',
           '--appendonly', 'no', '--dir', tmp]
    return start_server(cmd, port), 'redis://127.0.0.1:%d/0' % port


def pg_setup(args, drop_only=False):
    import psycopg
    conn = psycopg.connect(args.dsn + ' dbname=postgres', autocommit=True)
    conn.execute('DROP DATABASE IF EXISTS %s' % PG_BENCH_DB)
    if not drop_only:
        conn.execute('CREATE DATABASE %s' % PG_BENCH_DB)
    conn.close()


def populate_blobs(args, tmp):
    """``args.blobs`` blobs of ``args.blob_size`` bytes; their oids."""
    from ZODB.blob import Blob
    blob_dir = tempfile.mkdtemp(prefix='blobs-', dir=tmp)
    db = open_db(args, blob_dir=blob_dir, shared_blob_dir=False, cache_local_mb=0)
    with db.transaction() as conn:
        blobs = []
        for number in range(args.blobs):
            blob = Blob()
            with blob.open('w') as f:
                f.write(bytes([number % 256]) * args.blob_size)
            conn.root()['blob%d' % number] = blob
            blobs.append(blob)
    oids = [blob._p_oid for blob in blobs]
    db.close()
    return oids


def child_blobs(args):
    """A fresh process with an empty blob-dir: ms to read every blob."""
    oids = [p64(int(o)) for o in args.oids.split(',')]
    kw = {'cache_servers': args.servers} if args.servers else {}
    blob_dir = tempfile.mkdtemp(prefix='cache_bench_blobs_')
    try:
        db = open_db(args, blob_dir=blob_dir, shared_blob_dir=False, **kw)
        conn = db.open(transaction.TransactionManager())
        conn.transaction_manager.begin()
        gc.collect()
        start = time.perf_counter()
        for oid in oids:
            with conn.get(oid).open() as f:
                f.read()
        ms = (time.perf_counter() - start) * 1000
        shared = db.storage.cache_stats().get('shared', {})
        conn.close()
        db.close()
    finally:
        shutil.rmtree(blob_dir, ignore_errors=True)
    print(json.dumps({'ms': ms, 'blob_hits': shared.get('blob_hits', 0)}))


def blob_scenarios(args, tmp, shared):
    oids = populate_blobs(args, tmp)
    print('%d blobs of %d bytes, read by a fresh process with an empty blob-dir'
          % (len(oids), args.blob_size))
    cmd = [sys.executable, '-m', 'bench.cache_bench', '--child-blobs', '--db', args.db,
           '--data-dir', args.data_dir or '', '--dsn', args.dsn,
           '--oids', ','.join(str(int.from_bytes(o, 'big')) for o in oids)]

    def run(servers):
        out = subprocess.run(cmd + (['--servers', servers] if servers else []), check=True,
                             capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return json.loads(out.stdout.strip().splitlines()[-1])

    for servers in shared.values():
        run(servers)                 # reads them from the database and shares them
    kinds = ('mc', 'redis', 'db')
    runs = {kind: [] for kind in kinds}
    for _ in range(args.repeat):
        for kind in kinds:
            runs[kind].append(run(shared.get(kind)))
    for kind in kinds:
        report('blobs-%s' % kind, [r['ms'] / len(oids) for r in runs[kind]],
               '  per blob [%d from the shared cache]' % runs[kind][-1]['blob_hits'])


def client_scenarios(args, shared):
    """The clients alone, in this process: ms for ``--count`` single gets,
    and for the same keys in batches of 100 (128-byte values)."""
    from relstorage.cache.shared import open_shared_cache
    clients = {kind: open_shared_cache(servers, None, 'cache_bench')
               for kind, servers in shared.items()}
    pairs = [(oid, 1) for oid in range(args.count)]
    for client in clients.values():
        client.set_many({pair: b'x' * 128 for pair in pairs}, wait=True)
    runs = {}
    for _ in range(args.repeat):
        for kind, client in clients.items():
            start = time.perf_counter()
            for oid, tid in pairs:
                client.get(oid, tid)
            middle = time.perf_counter()
            for first in range(0, len(pairs), 100):
                client.get_many(pairs[first:first + 100])
            end = time.perf_counter()
            runs.setdefault('get-' + kind, []).append((middle - start) * 1000)
            runs.setdefault('get_many-' + kind, []).append((end - middle) * 1000)
    for name, values in runs.items():
        report(name, values)
    for client in clients.values():
        client.close()


def report(name, values, note=''):
    print('%-24s %8.1f ms  (median of %d: %s)%s' % (
        name, statistics.median(values), len(values),
        ' '.join('%.1f' % v for v in values), note))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--db', choices=('sqlite', 'postgresql'), default='sqlite')
    parser.add_argument('--dsn', default='host=127.0.0.1 user=postgres')
    parser.add_argument('--data-dir')
    parser.add_argument('--count', type=int, default=1000)
    parser.add_argument('--size', type=int, default=128)
    parser.add_argument('--repeat', type=int, default=5)
    parser.add_argument('--blobs', type=int, default=20,
                        help='blobs read in the blob scenario (0: none)')
    parser.add_argument('--blob-size', type=int, default=100000)
    parser.add_argument('--child-read', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--child-blobs', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--oids', help=argparse.SUPPRESS)
    parser.add_argument('--servers', help=argparse.SUPPRESS)
    parser.add_argument('--shuffle', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_read:
        return child_read(args)
    if args.child_blobs:
        return child_blobs(args)

    tmp = tempfile.mkdtemp(prefix='cache_bench_')
    if args.db == 'sqlite':
        args.data_dir = os.path.join(tmp, 'data')
    else:
        pg_setup(args)
    mc, servers = start_memcached()
    rd, redis_servers = start_redis(tmp)
    shared = {'mc': servers, 'redis': redis_servers}
    try:
        oids, size = populate(args)
        print('%s: %d objects, pickles of %d bytes; %d runs each'
              % (args.db, len(oids), size, args.repeat))

        shuffled = list(oids)
        random.Random(42).shuffle(shuffled)
        for order, sequence in (('', oids), ('-random', shuffled)):
            cold, local = [], []
            for _ in range(args.repeat):
                db = open_db(args)
                cold.append(timed_read(db, sequence))
                local.append(timed_read(db, sequence))
                assert db.storage.cache_stats()['index_mismatches'] == 0
                db.close()
            report('cold' + order, cold)
            report('local' + order, local)

        # Another process puts the states into the shared caches by
        # reading them (and publishes its hot list when it closes).
        for address in shared.values():
            fresh_process(args, oids, address)
        kinds = ('mc', 'redis', 'db')
        scenarios = [(kind, order, shuffle, False) for order, shuffle
                     in (('', False), ('-random', True)) for kind in kinds]
        # Without the hot list every state is one request to the shared cache.
        scenarios += [(kind, '-nohot-random', True, True) for kind in ('mc', 'redis')]
        runs = {scenario: [] for scenario in scenarios}
        for _ in range(args.repeat):
            # Interleaved, so that a busy spell hits every scenario alike.
            for scenario in scenarios:
                kind, _, shuffle, nohot = scenario
                if nohot:
                    drop_hot_list(args, shared[kind])
                runs[scenario].append(fresh_process(args, oids, shared.get(kind), shuffle))
        for scenario in scenarios:
            kind, order = scenario[:2]
            last = runs[scenario][-1]
            report('%s-fresh%s' % (kind, order), [r['ms'] for r in runs[scenario]],
                   '  [%d db loads, %d shared-cache hits, %d warmed at start]'
                   % (last['db_loads'], last['shared_hits'], last['warmed']))
            report('  +open', [r['ms'] + r['open_ms'] for r in runs[scenario]],
                   '  (open and first poll included)')

        for kind in kinds:
            kw = {'cache_servers': shared[kind]} if kind in shared else {}
            db = open_db(args, **kw)
            conn = db.open(transaction.TransactionManager())
            polled = []
            for _ in range(args.repeat):
                conn.transaction_manager.begin()
                conn.transaction_manager.abort()
                rewrite(args, oids, **kw)        # the other process
                polled.append(timed_read(db, oids, conn))
            stats = db.storage.cache_stats()
            conn.close()
            db.close()
            note = '  [%d db loads, %d shared-cache hits, %d local hits, %d warmed]' % (
                stats['db_loads'], stats.get('shared', {}).get('hits', 0), stats['hits'],
                stats['warmed_from_shared'])
            report('%s-polled' % kind, polled, note)
        client_scenarios(args, shared)
        if args.blobs:
            blob_scenarios(args, tmp, shared)
    finally:
        for proc in (mc, rd):
            proc.terminate()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        if args.db == 'postgresql':
            pg_setup(args, drop_only=True)


if __name__ == '__main__':
    sys.exit(main())
