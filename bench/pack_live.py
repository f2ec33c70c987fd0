"""Pack on a live site: ``python -m bench.pack_live`` (issue 12's scenario).

A database of N small objects (a BTree of PersistentMappings), half of them
made garbage, is packed with GC by ``zodbpack -d 0`` while one writer
commits a 2-object transaction every 20 ms.  Reported per database and
history mode:

- pack time and zodbpack's peak RSS;
- the writer's commit latency (median, p99, max) and throughput before and
  during the pack, and how many commits took longer than
  pack-batch-timeout;
- the longest time the pack held the commit lock (zodbpack's summary);
- the time of a second pack right after the first (the writer stopped;
  references reused, only its commits made during the first are read),
  and of a third one with nothing new at all.

Examples::

    python -m bench.pack_live --target sqlite --objects 20000
    python -m bench.pack_live --target pg --objects 100000 --history-free

RelStorage 4.3 on the same scenario: run this file (by its path, from a
neutral directory, so that the checkout's ``relstorage`` is not first on
``sys.path``) with the peer virtualenv's interpreter (``make bench-peer``)::

    cd /tmp && /work/main/.venv-peer/bin/python /work/main/bench/pack_live.py \\
        --target pg --objects 1000000 --history-free --template

The script only speaks ZODB and ZConfig (``%import relstorage``), so either
implementation runs it; the first line of its report says which
``relstorage`` it imported.  On MariaDB the peer needs
/work/shared/bench's shim (RS_PEER_MARIADB_COMPAT=1).

``--template`` (PostgreSQL) keeps the populated database as a template
(``relstoragebench_packtpl_<side>_<mode>_<objects>``) and packs a copy of
it, so that A/B runs on a million objects do not rebuild it each time;
``--drop-template`` removes it afterwards.

For experiments: ``RS_PACK_LIVE_PREFIX`` runs zodbpack under a wrapper
("chrt --idle 0"), ``RS_PACK_LIVE_OPTIONS`` adds option lines to both
sides' ``<relstorage>`` ("pack-duty-cycle 0.25; pack-max-delay 1").

Server databases are created and dropped (``relstoragebench_pack_*``);
SQLite data goes to a temporary directory.
"""
import argparse
import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import transaction
import ZODB.config
from BTrees.OOBTree import OOBTree
from persistent.mapping import PersistentMapping

import relstorage

WRITER_INTERVAL = 0.02
#: pack-batch-timeout's default: no commit should wait longer.
BATCH_TIMEOUT = 1.0


def side():
    """'ours' or 'peer' (RelStorage 4.x), by the imported package."""
    version = getattr(relstorage, '__version__', None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version
            version = dist_version('relstorage')
        except Exception:  # pylint:disable=broad-except
            version = '?'
    here = os.path.dirname(os.path.abspath(relstorage.__file__))
    peer = '.venv-peer' in here or str(version).startswith('4.')
    return ('peer' if peer else 'ours'), version, here


def pg_admin(statement):
    import psycopg2
    base = os.environ.get('RS_PG_DSN', 'host=127.0.0.1 user=postgres')
    conn = psycopg2.connect(base + ' dbname=postgres')
    conn.autocommit = True
    try:
        cur = conn.cursor()
        cur.execute(statement)
        rows = cur.fetchall() if cur.description else None
        cur.close()
        return rows
    finally:
        conn.close()


def pg_exists(name):
    return bool(pg_admin("SELECT 1 FROM pg_database WHERE datname = '%s'" % name))


def mysql_admin(statement):
    import MySQLdb
    conn = MySQLdb.connect(host=os.environ.get('RS_MYSQL_HOST', '127.0.0.1'), user='root',
                           passwd=os.environ.get('RS_MYSQL_PASSWD', ''))
    try:
        conn.cursor().execute(statement)
    finally:
        conn.close()


def pg_section(dbname):
    base = os.environ.get('RS_PG_DSN', 'host=127.0.0.1 user=postgres')
    return '<postgresql>\n dsn %s dbname=%s\n</postgresql>' % (base, dbname)


def storage_config(keep_history, section):
    # RS_PACK_LIVE_OPTIONS: an experiment's option lines, "pack-duty-cycle
    # 0.25; pack-max-delay 1" (for both sides: the keys are 4.3's too).
    extra = ''.join(' %s\n' % line.strip() for line in
                    os.environ.get('RS_PACK_LIVE_OPTIONS', '').split(';') if line.strip())
    return ('%%import relstorage\n<relstorage>\n keep-history %s\n'
            ' commit-lock-timeout 30\n%s%s\n</relstorage>\n'
            % ('true' if keep_history else 'false', extra, section))


def open_db(keep_history, section):
    return ZODB.config.databaseFromString(
        '<zodb>\n%s</zodb>\n' % storage_config(keep_history, section))


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
        conn.cacheMinimize()


class Target:
    """A database to pack: ``section`` (ZConfig), ``make()``, ``cleanup()``."""

    def __init__(self, args, keep_history, scratch, who):
        self.args = args
        self.keep_history = keep_history
        self.scratch = scratch
        name = args.target
        mode = 'hp' if keep_history else 'hf'
        self.dbname = 'relstoragebench_pack_%d' % os.getpid()
        self.template = 'relstoragebench_packtpl_%s_%s_%d' % (who, mode, args.objects)
        if name == 'sqlite':
            data_dir = os.path.join(scratch, 'data')
            self.section = '<sqlite3>\n data-dir %s\n</sqlite3>' % data_dir
        elif name == 'pg':
            self.section = pg_section(self.dbname)
        elif name == 'mariadb':
            self.section = ('<mysql>\n host %s\n user root\n db %s\n%s</mysql>' % (
                os.environ.get('RS_MYSQL_HOST', '127.0.0.1'), self.dbname,
                (' passwd %s\n' % os.environ['RS_MYSQL_PASSWD'])
                if os.environ.get('RS_MYSQL_PASSWD') else ''))
        else:
            raise SystemExit('unknown target %r (sqlite, pg, mariadb)' % name)

    def make(self):
        """Create the database with its objects; return the seconds spent
        populating (0 when copied from a template)."""
        target = self.args.target
        if target == 'pg':
            pg_admin('DROP DATABASE IF EXISTS %s' % self.dbname)
            if self.args.template:
                if not pg_exists(self.template):
                    pg_admin('CREATE DATABASE %s' % self.template)
                    seconds = self._populate(pg_section(self.template))
                    print('populated template %s in %.1fs' % (self.template, seconds))
                started = time.time()
                pg_admin('CREATE DATABASE %s TEMPLATE %s' % (self.dbname, self.template))
                print('copied template %s in %.1fs' % (self.template, time.time() - started))
                return 0
            pg_admin('CREATE DATABASE %s' % self.dbname)
        elif target == 'mariadb':
            mysql_admin('DROP DATABASE IF EXISTS %s' % self.dbname)
            mysql_admin('CREATE DATABASE %s' % self.dbname)
        return self._populate(self.section)

    def _populate(self, section):
        db = open_db(self.keep_history, section)
        try:
            started = time.time()
            populate(db, self.args.objects)
            return time.time() - started
        finally:
            db.close()

    def cleanup(self):
        target = self.args.target
        if target == 'pg':
            pg_admin('DROP DATABASE IF EXISTS %s WITH (FORCE)' % self.dbname)
            if self.args.drop_template:
                pg_admin('DROP DATABASE IF EXISTS %s WITH (FORCE)' % self.template)
        elif target == 'mariadb':
            mysql_admin('DROP DATABASE IF EXISTS %s' % self.dbname)


class Writer(threading.Thread):
    """Commits a 2-object transaction every 20 ms; records latencies."""

    def __init__(self, db):
        super().__init__(daemon=True)
        self.db = db
        self.samples = []           # (start time, latency, committed)
        self.stop = threading.Event()

    def run(self):
        tm = transaction.TransactionManager()
        conn = self.db.open(tm)
        n = 0
        while not self.stop.is_set():
            started = time.time()
            ok = True
            try:
                tm.begin()
                root = conn.root()
                root['w1'] = PersistentMapping(n=n)
                root['w2'] = PersistentMapping(n=n)
                tm.commit()
            except Exception:  # pylint:disable=broad-except
                tm.abort()
                ok = False
            self.samples.append((started, time.time() - started, ok))
            n += 1
            time.sleep(max(0, WRITER_INTERVAL - (time.time() - started)))
        conn.close()

    def stats(self, start, end):
        chosen = [(l, ok) for t, l, ok in self.samples if start <= t < end]
        lat = sorted(l for l, _ok in chosen)
        if not lat:
            return None
        return {'commits_per_s': round(sum(1 for _l, ok in chosen if ok) / (end - start), 1),
                'failed': sum(1 for _l, ok in chosen if not ok),
                'median_ms': round(1000 * statistics.median(lat), 1),
                'p99_ms': round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
                'max_ms': round(1000 * lat[-1], 1),
                'over_batch_timeout': sum(1 for l in lat if l > BATCH_TIMEOUT)}


def run_zodbpack(config):
    """Run zodbpack in a child, sampling its RSS (the children's
    ru_maxrss would report the largest child ever waited for)."""
    started = time.time()
    script = os.path.join(os.path.dirname(sys.executable), 'zodbpack')
    argv = [script, '-d', '0', config]
    if os.environ.get('RS_PACK_LIVE_DEBUG'):
        # zodbpack logs the traceback of a failure at DEBUG level.
        argv = [sys.executable, '-c',
                'import logging, sys; logging.basicConfig(level=logging.DEBUG); '
                'from relstorage import zodbpack; sys.exit(zodbpack.main(sys.argv[1:]))',
                '-d', '0', config]
    # Files, not pipes: nothing reads the pipes until the pack ends.
    prefix = os.environ.get('RS_PACK_LIVE_PREFIX')
    if prefix:
        # An experiment's wrapper, e.g. "nice -n 19" or "chrt --idle 0".
        argv = shlex.split(prefix) + argv
    out_file = tempfile.TemporaryFile('w+')
    err_file = tempfile.TemporaryFile('w+')
    proc = subprocess.Popen(argv, stdout=out_file, stderr=err_file, text=True)
    peak = 0
    status = '/proc/%d/status' % proc.pid
    while proc.poll() is None:
        try:
            with open(status) as f:
                for line in f:
                    if line.startswith('VmHWM:'):
                        peak = max(peak, int(line.split()[1]))
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    proc.wait()
    out_file.seek(0)
    err_file.seek(0)
    out, err = out_file.read(), err_file.read()
    out_file.close()
    err_file.close()
    elapsed = time.time() - started
    if proc.returncode:
        raise SystemExit('zodbpack failed: %s' % err.strip()[-3000:])
    longest = re.search(r'longest ([0-9.]+)s', out)
    return {'seconds': elapsed, 'peak_rss_mb': peak / 1024.0,
            'longest_lock_s': float(longest.group(1)) if longest else None,
            'summary': (out.strip() or err.strip()).splitlines()[-1:] }


def pack_phases(summary, pack_start, pack_end):
    """(name, start, end) of the phases of a pack, from our zodbpack's
    summary line (which gives their durations; 4.3's does not): placed
    back from the pack's end, so the process's start-up counts in the
    first."""
    found = re.search(r'analysis ([0-9.]+)s, reachability ([0-9.]+)s.*deletion ([0-9.]+)s',
                      ' '.join(summary))
    if not found:
        return []
    analysis, reach, deletion = map(float, found.groups())
    deletion_start = pack_end - deletion
    reach_start = deletion_start - reach
    return [('analysis', pack_start, reach_start),
            ('reachability', reach_start, deletion_start),
            ('deletion', deletion_start, pack_end)]


def main(argv=None):
    parser = argparse.ArgumentParser(prog='python -m bench.pack_live')
    parser.add_argument('--target', default='sqlite', help='sqlite, pg or mariadb')
    parser.add_argument('--objects', type=int, default=20000)
    parser.add_argument('--history-free', action='store_true')
    parser.add_argument('--before', type=float, default=5.0,
                        help='seconds of writer latency measured before the pack')
    parser.add_argument('--template', action='store_true',
                        help='PostgreSQL: keep the populated database as a template '
                        'and pack a copy (reused by the next run of the same size)')
    parser.add_argument('--drop-template', action='store_true',
                        help='drop the template at the end')
    parser.add_argument('--populate-only', action='store_true',
                        help='with --template: build the template and stop')
    args = parser.parse_args(argv)
    keep_history = not args.history_free
    who, version, where = side()
    print('relstorage %s from %s (%s)' % (version, where, who))
    scratch = tempfile.mkdtemp(prefix='relstoragebench_pack_')
    target = Target(args, keep_history, scratch, who)
    try:
        if args.populate_only:
            args.template = True
            if not pg_exists(target.template):
                target.make()
            return
        seconds = target.make()
        if seconds:
            print('populated %d objects in %.1fs' % (args.objects, seconds))
        config = os.path.join(scratch, 'pack.conf')
        with open(config, 'w') as f:
            f.write(storage_config(keep_history, target.section))
        db = open_db(keep_history, target.section)
        writer = Writer(db)
        writer.start()
        time.sleep(args.before)
        pack_start = time.time()
        first = run_zodbpack(config)
        pack_end = time.time()
        writer.stop.set()
        writer.join()
        db.close()
        # The writer's commits during the first pack are new to the
        # second (references read again for them only); the third has
        # nothing new at all.
        second = run_zodbpack(config)
        third = run_zodbpack(config)
        print('target %s, %s, %d objects (half garbage), %s' % (
            args.target, 'history-preserving' if keep_history else 'history-free',
            args.objects, who))
        print('  writer before the pack: %s' % writer.stats(pack_start - args.before, pack_start))
        print('  writer during the pack: %s' % writer.stats(pack_start, pack_end))
        print('  first pack:  %.1fs, peak RSS %.0f MB, longest commit-lock hold %ss'
              % (first['seconds'], first['peak_rss_mb'], first['longest_lock_s']))
        print('               %s' % first['summary'])
        print('  second pack: %.1fs, peak RSS %.0f MB (after the writer stopped)'
              % (second['seconds'], second['peak_rss_mb']))
        print('               %s' % second['summary'])
        print('  third pack:  %.1fs (nothing new)' % third['seconds'])
        print('               %s' % third['summary'])
        for name, start, end in pack_phases(first['summary'], pack_start, pack_end):
            print('  writer during the %s: %s' % (name, writer.stats(start, end)))
        samples = os.environ.get('RS_PACK_LIVE_SAMPLES')
        if samples:
            # The writer's commits, to see which phase of the pack the
            # slow ones met (zodbpack's summary gives the phase times).
            import json
            with open(samples, 'w') as f:
                json.dump({'pack_start': pack_start, 'pack_end': pack_end,
                           'summary': first['summary'], 'samples': writer.samples}, f)
    finally:
        target.cleanup()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == '__main__':
    main()
