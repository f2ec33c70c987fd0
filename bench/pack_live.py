"""Pack on a live site: ``python -m bench.pack_live`` (issue 12's scenario).

A database of N small objects (a BTree of PersistentMappings), half of them
made garbage, is packed with GC by ``zodbpack -d 0`` while one writer
commits a 2-object transaction every 20 ms.  Reported per database and
history mode:

- pack time and zodbpack's peak RSS;
- the writer's commit latency (median, p99, max) and throughput before and
  during the pack;
- the longest time the pack held the commit lock (zodbpack's summary);
- the time of a second pack right after the first (references reused).

Examples::

    python -m bench.pack_live --target sqlite --objects 20000
    python -m bench.pack_live --target pg --objects 100000 --history-free

Server databases are created and dropped (``relstoragebench_pack_*``);
SQLite data goes to a temporary directory.
"""
import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import transaction
import ZODB
from BTrees.OOBTree import OOBTree
from persistent.mapping import PersistentMapping

from relstorage.options import Options
from relstorage.storage import RelStorage

WRITER_INTERVAL = 0.02


def make_target(name, keep_history, scratch):
    """(adapter factory, ZConfig adapter section, cleanup)."""
    dbname = 'relstoragebench_pack_%d' % os.getpid()
    if name == 'sqlite':
        from relstorage.adapters.sqlite.adapter import Sqlite3Adapter
        data_dir = os.path.join(scratch, 'data')
        return ((lambda options: Sqlite3Adapter(data_dir, options=options)),
                '<sqlite3>\n data-dir %s\n</sqlite3>' % data_dir, lambda: None)
    if name == 'pg':
        import psycopg
        from relstorage.adapters.postgresql.adapter import PostgreSQLAdapter
        base = os.environ.get('RS_PG_DSN', 'host=127.0.0.1 user=postgres')
        admin = psycopg.connect(base + ' dbname=postgres', autocommit=True)
        admin.execute('DROP DATABASE IF EXISTS %s' % dbname)
        admin.execute('CREATE DATABASE %s' % dbname)
        dsn = base + ' dbname=%s' % dbname

        def cleanup():
            admin.execute('DROP DATABASE IF EXISTS %s WITH (FORCE)' % dbname)
        return ((lambda options: PostgreSQLAdapter(dsn=dsn, options=options)),
                '<postgresql>\n dsn %s\n</postgresql>' % dsn, cleanup)
    if name == 'mariadb':
        import MySQLdb
        from relstorage.adapters.mysql.adapter import MySQLAdapter
        params = dict(host=os.environ.get('RS_MYSQL_HOST', '127.0.0.1'), user='root',
                      passwd=os.environ.get('RS_MYSQL_PASSWD', ''))
        admin = MySQLdb.connect(**params)
        admin.autocommit(True)
        cur = admin.cursor()
        cur.execute('DROP DATABASE IF EXISTS %s' % dbname)
        cur.execute('CREATE DATABASE %s' % dbname)

        def cleanup():
            cur.execute('DROP DATABASE IF EXISTS %s' % dbname)
        section = '<mysql>\n host %s\n user root\n db %s\n%s</mysql>' % (
            params['host'], dbname, (' passwd %s\n' % params['passwd']) if params['passwd'] else '')
        return ((lambda options: MySQLAdapter(options=options, db=dbname, **params)),
                section, cleanup)
    raise SystemExit('unknown target %r (sqlite, pg, mariadb)' % name)


def populate(db, objects):
    per_txn = 10000
    with db.transaction() as conn:
        conn.root()['tree'] = OOBTree()
    for start in range(0, objects, per_txn):
        with db.transaction() as conn:
            tree = conn.root()['tree']
            for i in range(start, min(objects, start + per_txn)):
                tree[i] = PersistentMapping(v=i)
        conn.cacheMinimize()
    # Half garbage: every other key removed.
    for start in range(0, objects, per_txn):
        with db.transaction() as conn:
            tree = conn.root()['tree']
            for i in range(start, min(objects, start + per_txn), 2):
                del tree[i]


class Writer(threading.Thread):
    """Commits a 2-object transaction every 20 ms; records latencies."""

    def __init__(self, db):
        super().__init__(daemon=True)
        self.db = db
        self.samples = []           # (start time, latency)
        self.stop = threading.Event()

    def run(self):
        tm = transaction.TransactionManager()
        conn = self.db.open(tm)
        n = 0
        while not self.stop.is_set():
            started = time.time()
            try:
                tm.begin()
                root = conn.root()
                root['w1'] = PersistentMapping(n=n)
                root['w2'] = PersistentMapping(n=n)
                tm.commit()
            except Exception:  # pylint:disable=broad-except
                tm.abort()
            self.samples.append((started, time.time() - started))
            n += 1
            time.sleep(max(0, WRITER_INTERVAL - (time.time() - started)))
        conn.close()

    def stats(self, start, end):
        lat = sorted(l for t, l in self.samples if start <= t < end)
        if not lat:
            return None
        return {'commits_per_s': len(lat) / (end - start),
                'median_ms': 1000 * statistics.median(lat),
                'p99_ms': 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
                'max_ms': 1000 * lat[-1]}


def run_zodbpack(config):
    started = time.time()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    script = os.path.join(os.path.dirname(sys.executable), 'zodbpack')
    proc = subprocess.run([script, '-d', '0', config], capture_output=True, text=True)
    elapsed = time.time() - started
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode:
        raise SystemExit('zodbpack failed: %s' % proc.stderr.strip())
    longest = re.search(r'longest ([0-9.]+)s', proc.stdout)
    return {'seconds': elapsed, 'peak_rss_mb': max(rss, before) / 1024.0,
            'longest_lock_s': float(longest.group(1)) if longest else None,
            'summary': proc.stdout.strip()}


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.pack_live')
    parser.add_argument('--target', default='sqlite', help='sqlite, pg or mariadb')
    parser.add_argument('--objects', type=int, default=20000)
    parser.add_argument('--history-free', action='store_true')
    parser.add_argument('--before', type=float, default=5.0,
                        help='seconds of writer latency measured before the pack')
    args = parser.parse_args(argv)
    keep_history = not args.history_free
    scratch = tempfile.mkdtemp(prefix='relstoragebench_pack_')
    make_adapter, section, cleanup = make_target(args.target, keep_history, scratch)
    try:
        options = Options(keep_history=keep_history, commit_lock_timeout=30)
        db = ZODB.DB(RelStorage(make_adapter(options), options=options))
        t0 = time.time()
        populate(db, args.objects)
        print('populated %d objects in %.1fs' % (args.objects, time.time() - t0))
        config = os.path.join(scratch, 'pack.conf')
        with open(config, 'w') as f:
            f.write('%%import relstorage\n<relstorage>\n keep-history %s\n%s\n</relstorage>\n'
                    % ('true' if keep_history else 'false', section))
        writer = Writer(db)
        writer.start()
        time.sleep(args.before)
        pack_start = time.time()
        first = run_zodbpack(config)
        pack_end = time.time()
        second = run_zodbpack(config)
        writer.stop.set()
        writer.join()
        db.close()
        print('target %s, %s, %d objects (half garbage)' % (
            args.target, 'history-preserving' if keep_history else 'history-free',
            args.objects))
        print('  writer before the pack: %s' % writer.stats(pack_start - args.before, pack_start))
        print('  writer during the pack: %s' % writer.stats(pack_start, pack_end))
        print('  first pack:  %.1fs, peak RSS %.0f MB, longest commit-lock hold %ss'
              % (first['seconds'], first['peak_rss_mb'], first['longest_lock_s']))
        print('               %s' % first['summary'])
        print('  second pack: %.1fs (nothing new)' % second['seconds'])
    finally:
        cleanup()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == '__main__':
    main()
