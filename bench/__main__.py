"""Benchmark harness: ``python -m bench`` (``make bench``).

Runs zodbshootout against each selected storage (see bench/targets.py),
a bare-driver baseline for each SQL database and driver, zodbconvert of a
generated FileStorage into each RelStorage database, RelStorage 4.3 side
by side with ours (bench/peer.py, with --peer-python) and counts the round
trips of one commit (bench/roundtrips.py); writes ``docs/benchmarks.md``,
``docs/benchmarks.png`` and ``docs/benchmarks.json``.

Examples::

    python -m bench --peer-python .venv-peer/bin/python   # make bench
    python -m bench --targets sqlite,filestorage -p 2
    python -m bench --targets pg-psycopg --merge   # add to existing results
    python -m bench --peer-only --peer-python .venv-peer/bin/python
    python -m bench --smoke                        # SQLite, tiny, < 1 min
    python -m bench --report-only                  # redraw from the JSON
    python -m bench --list                         # targets and availability

Configuration files, SQLite/FileStorage data, logs and the generated
zodbconvert source go to the scratch dir (default ``var/bench``); server
databases are created and dropped by the harness, all named
``relstoragebench_*``.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

from . import baseline
from . import convert
from . import peer
from . import report
from . import roundtrips
from . import shootout
from .targets import (ALL_TARGETS, DEFAULT_TARGETS, TARGETS, Unavailable,
                      safe_message)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv):
    p = argparse.ArgumentParser(prog='python -m bench', description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument('--targets', default=','.join(DEFAULT_TARGETS),
                   help='comma-separated targets (default: %%(default)s; '
                        'all: %s)' % ','.join(TARGETS))
    p.add_argument('--concurrency', default='1,2',
                   help='comma-separated concurrency levels (default 1,2)')
    p.add_argument('--objects', type=int, default=1000)
    p.add_argument('--object-size', type=int, default=128)
    p.add_argument('-p', '--processes', type=int, default=2,
                   help='pyperf worker processes per benchmark (default 2)')
    p.add_argument('-n', '--values', type=int, default=2,
                   help='timed values per process (default 2)')
    p.add_argument('-w', '--warmups', type=int, default=1,
                   help='untimed values per process (default 1)')
    p.add_argument('--phases', default=','.join(shootout.PHASE_KEYS),
                   help='comma-separated zodbshootout phases '
                        '(default: %(default)s)')
    p.add_argument('--baseline-repeat', type=int, default=15)
    p.add_argument('--no-baseline', action='store_true')
    p.add_argument('--no-convert', action='store_true')
    p.add_argument('--scratch', default=os.path.join(ROOT, 'var', 'bench'),
                   help='scratch dir (default var/bench)')
    p.add_argument('--output-dir', default=None,
                   help='where benchmarks.md/.png/.json go (default docs/, '
                        'or SCRATCH/smoke-report with --smoke)')
    p.add_argument('--merge', action='store_true',
                   help='keep the other targets of an existing '
                        'benchmarks.json in the output dir')
    p.add_argument('--report-only', action='store_true',
                   help='only rewrite the .md and .png from the .json')
    p.add_argument('--smoke', action='store_true',
                   help='SQLite only, 100 objects, one process per '
                        'benchmark, tiny zodbconvert source')
    p.add_argument('--list', action='store_true',
                   help='list targets and whether they can run here')
    g = p.add_argument_group(
        'side by side with RelStorage 4.3 (bench/peer.py)',
        'Targets %s, when selected, are also run interleaved with '
        'RelStorage 4.3 installed in its own virtualenv (make bench-peer).'
        % ', '.join(n for n, _ in peer.COMPARED))
    g.add_argument('--peer-python', default=None,
                   help='python of the RelStorage 4.3 virtualenv, e.g. '
                        '.venv-peer/bin/python (default: no comparison)')
    g.add_argument('--peer-only', action='store_true',
                   help='run only the comparison and the round trips; keep '
                        'the other results of an existing benchmarks.json')
    g.add_argument('--peer-repeat', type=int, default=5,
                   help='pairs of runs (ours, 4.3) per phase (default 5)')
    g.add_argument('--peer-processes', type=int, default=1,
                   help='pyperf processes per run (default 1)')
    g.add_argument('--peer-concurrency', type=int, default=1,
                   help='zodbshootout processes running the phase at once '
                        '(default 1; zodbshootout\'s own default is 2)')
    g.add_argument('--peer-values', type=int, default=3,
                   help='timed values per process (default 3)')
    g.add_argument('--peer-phases', default=','.join(shootout.PHASE_KEYS),
                   help='phases compared (default: all)')
    p.add_argument('--no-roundtrips', action='store_true',
                   help='do not count the round trips of a commit')
    args = p.parse_args(argv)
    if args.smoke:
        if args.targets == p.get_default('targets'):
            args.targets = 'sqlite'
        args.concurrency = '1'
        args.objects = min(args.objects, 100)
        args.processes, args.values, args.warmups = 1, 1, 0
        args.baseline_repeat = 3
    args.scratch = os.path.abspath(args.scratch)
    if args.output_dir is None:
        args.output_dir = (os.path.join(args.scratch, 'smoke-report')
                           if args.smoke else os.path.join(ROOT, 'docs'))
    args.targets = [t for t in args.targets.split(',') if t]
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        p.error('unknown targets: %s (known: %s)'
                % (', '.join(unknown), ', '.join(TARGETS)))
    args.concurrency = [int(c) for c in args.concurrency.split(',')]
    args.phases = [ph for ph in args.phases.split(',') if ph]
    args.peer_phases = [ph for ph in args.peer_phases.split(',') if ph]
    if args.peer_concurrency < 1:
        p.error('--peer-concurrency must be at least 1, not %d' % args.peer_concurrency)
    if args.peer_only and not args.peer_python:
        p.error('--peer-only needs --peer-python')
    bad = [ph for ph in args.phases + args.peer_phases
           if ph not in shootout.PHASE_KEYS]
    if bad:
        p.error('unknown phases: %s' % ', '.join(bad))
    return args


def say(msg):
    print('[bench %s] %s' % (time.strftime('%H:%M:%S'), msg), flush=True)


def versions():
    found = {}
    for name, module in (('zodbshootout', 'zodbshootout'),
                         ('pyperf', 'pyperf'), ('zodb', 'ZODB')):
        try:
            from importlib.metadata import version
            found[name] = version(module)
        except Exception:
            found[name] = '?'
    return found


def server_versions(names):
    parts = []
    if any(TARGETS[n].database == 'postgresql' for n in names):
        try:
            from .targets import pg_admin_connect
            conn = pg_admin_connect()
            cur = conn.cursor()
            cur.execute('SHOW server_version')
            parts.append('PostgreSQL %s' % cur.fetchone()[0].split()[0])
            conn.close()
        except Exception:
            pass
    if any(TARGETS[n].database == 'mysql' for n in names):
        try:
            from .targets import mysql_admin_connect
            conn = mysql_admin_connect()
            cur = conn.cursor()
            cur.execute('SELECT VERSION()')
            parts.append('MariaDB/MySQL %s' % cur.fetchone()[0])
            conn.close()
        except Exception:
            pass
    if any(TARGETS[n].database == 'sqlite' for n in names):
        import sqlite3
        parts.append('SQLite %s' % sqlite3.sqlite_version)
    return ', '.join(parts) or 'no servers'


def revision():
    """The commit, and a fingerprint of uncommitted changes in relstorage/
    (so two runs of a changing working tree can be told apart)."""
    try:
        rev = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'],
                             cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        diff = subprocess.run(['git', 'diff', 'HEAD', '--', 'relstorage'],
                              cwd=ROOT, capture_output=True).stdout
        untracked = subprocess.run(
            ['git', 'ls-files', '--others', '--exclude-standard',
             'relstorage'], cwd=ROOT, capture_output=True,
            text=True).stdout.split()
        if not diff and not untracked:
            return 'git %s' % rev
        import hashlib
        h = hashlib.sha1(diff)
        for name in sorted(untracked):
            h.update(name.encode())
            with open(os.path.join(ROOT, name), 'rb') as f:
                h.update(f.read())
        return ('git %s with uncommitted changes in relstorage/ '
                '(fingerprint %s)' % (rev, h.hexdigest()[:10]))
    except Exception:
        return 'unknown revision'


def machine():
    try:
        with open('/proc/meminfo') as f:
            kb = int(f.readline().split()[1])
        mem = ', %.0f GiB' % (kb / 1024 / 1024)
    except Exception:
        mem = ''
    return '%s, %d cores%s' % (platform.machine(), os.cpu_count() or 0, mem)


def preflight(target, args):
    """Open the storage, commit one object, read it back in a new
    connection; raise Unavailable with the error otherwise."""
    if not target.relstorage:
        return
    handle = target.create(args.scratch, 'preflight')
    try:
        import transaction
        import ZODB.config
        path = target.shootout_config(
            handle, os.path.join(args.scratch, target.name + '-preflight.conf'))
        try:
            db = ZODB.config.databaseFromURL(path)
            try:
                tm = transaction.TransactionManager()
                conn = db.open(tm)
                conn.root()['bench'] = 1
                tm.commit()
                conn.close()
                conn = db.open(tm)
                assert conn.root()['bench'] == 1
                conn.close()
            finally:
                db.close()
        except Exception as e:
            raise Unavailable('storage failed a one-object commit: %s'
                              % safe_message(e))
    finally:
        target.drop(handle)


def run_target(target, args):
    entry = {'label': target.label, 'database': target.database,
             'driver': target.driver, 'mode': target.mode,
             'relstorage': target.relstorage}
    try:
        target.check()
        preflight(target, args)
    except Unavailable as e:
        entry.update(status='unavailable', reason=str(e))
        say('%s: not run: %s' % (target.name, e))
        return entry
    entry['status'] = 'ok'
    entry['shootout'] = {}
    logs = os.path.join(args.scratch, 'logs')
    os.makedirs(logs, exist_ok=True)
    for c in args.concurrency:
        tag = 'c%d' % c
        handle = target.create(args.scratch, tag)
        try:
            config = target.shootout_config(
                handle, os.path.join(args.scratch,
                                     '%s-%s.conf' % (target.name, tag)))
            out = os.path.join(args.scratch, '%s-%s.json'
                               % (target.name, tag))
            log = os.path.join(logs, '%s-%s.log' % (target.name, tag))
            say('%s: zodbshootout c=%d ...' % (target.name, c))
            results, elapsed, rc = shootout.run(
                config, out, log, c, args.objects, args.object_size,
                args.processes, args.values, args.warmups, args.phases,
                cwd=args.neutral)
        finally:
            target.drop(handle)
        report.add_summaries(results)
        entry['shootout'][str(c)] = results
        entry.setdefault('load', {})[str(c)] = round(os.getloadavg()[0], 2)
        say('%s: c=%d done in %.0f s (exit %s): %s' % (
            target.name, c, elapsed, rc, ', '.join(
                '%s %s' % (k, report.cell(v)) for k, v in results.items())))
    if target.relstorage and not args.no_baseline:
        try:
            say('%s: bare-driver baseline ...' % target.name)
            entry['baseline'] = report.add_summaries(baseline.run(
                target, args.scratch, args.objects, args.object_size,
                args.baseline_repeat))
            say('%s: baseline: %s' % (target.name, ', '.join(
                '%s %s' % (k, report.cell(v))
                for k, v in entry['baseline'].items())))
        except Exception as e:
            entry.setdefault('notes', []).append(
                'bare-driver baseline failed: %s' % safe_message(e))
    return entry


def run_convert(results, args):
    meta = results['meta']
    names = [n for n in results['order']
             if results['targets'][n].get('status') == 'ok'
             and results['targets'][n].get('relstorage')
             and n in args.targets]
    if not names:
        return
    reason = convert.zodbconvert_available()
    if reason:
        meta['convert_note'] = ('zodbconvert is not usable yet (%s); the '
                                'source generator is ready (bench/convert.py).'
                                % reason)
        say('zodbconvert: skipped: %s' % reason)
        return
    params = dict(convert.SMOKE if args.smoke else convert.DEFAULTS)
    sources = {}

    def source_for(with_blobs):
        if with_blobs not in sources:
            say('zodbconvert: generating the source FileStorage (%s) ...'
                % ('with blobs' if with_blobs else 'without blobs'))
            sources[with_blobs] = convert.generate(
                os.path.join(args.scratch, 'convert-source' +
                             ('' if with_blobs else '-noblobs')),
                with_blobs=with_blobs, **params)
        return sources[with_blobs]

    for name in names:
        target = TARGETS[name]
        problem = convert.blob_problem(target, args.scratch)
        if problem:
            say('%s: blobs not usable (%s); converting without them'
                % (name, problem))
        source = source_for(problem is None)
        meta['convert_source'] = dict(
            records=source['records'], transactions=source['transactions'],
            bytes=source['bytes'], params_blobs=params['blobs'],
            blob_mb=params['blob_mb'])
        log = os.path.join(args.scratch, 'logs', '%s-zodbconvert.log' % name)
        say('%s: zodbconvert ...' % name)
        res = convert.run(target, args.scratch, source, log)
        if problem:
            res['blob_problem'] = problem
            results['targets'][name].setdefault('notes', []).append(
                'blobs left out of the zodbconvert source: a one-blob '
                'commit with blob-dir failed: %s' % problem)
        results['targets'][name]['convert'] = res
        if res['status'] == 'ok':
            say('%s: zodbconvert: %.0f records/s, %.1f MB/s (%.1f s), '
                'verified: %s' % (name, res['records_per_s'], res['mb_per_s'],
                                  res['seconds'], res['verified']))
        else:
            say('%s: zodbconvert failed: %s' % (name, res.get('error')))


def write_outputs(results, output_dir):
    os.makedirs(output_dir, exist_ok=True)
    json_path = os.path.join(output_dir, 'benchmarks.json')
    with open(json_path, 'w') as f:
        json.dump(results, f, indent=1, sort_keys=True)
    md_path = os.path.join(output_dir, 'benchmarks.md')
    # Figures of the stand-alone scripts (bench/commit_size.py, ...),
    # written by hand with their commands: kept in every rewrite.
    extra_path = os.path.join(output_dir, 'benchmarks-extra.md')
    extra = None
    if os.path.exists(extra_path):
        with open(extra_path) as f:
            extra = f.read()
    with open(md_path, 'w') as f:
        f.write(report.markdown(results, extra))
    png_path = os.path.join(output_dir, 'benchmarks.png')
    report.chart(results, png_path)
    say('wrote %s, %s, %s' % (md_path, png_path, json_path))
    return md_path, png_path, json_path


def finish_meta(meta, started, peer_only):
    """Record the run's length and the load at its end, unless it only
    compared with the peer: such a run keeps the earlier run's figures and
    the meta that describes them (its own load is in results['peer'];
    overwriting load_end made a busy earlier run look quiet)."""
    if peer_only:
        return
    meta['seconds'] = round(time.time() - started)
    meta['load_end'] = round(os.getloadavg()[0], 2)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    json_path = os.path.join(args.output_dir, 'benchmarks.json')
    if args.list:
        for t in ALL_TARGETS:
            try:
                t.check()
                state = 'available'
            except Unavailable as e:
                state = 'not available: %s' % e
            print('%-16s %-28s %s' % (t.name, t.label, state))
        return 0
    if args.report_only:
        with open(json_path) as f:
            results = report.add_summaries(json.load(f))
        write_outputs(results, args.output_dir)
        return 0

    os.makedirs(args.scratch, exist_ok=True)
    args.neutral = peer.neutral_dir(args.scratch)
    started = time.time()
    meta = dict(objects=args.objects, object_size=args.object_size,
                concurrency=args.concurrency, processes=args.processes,
                values=args.values, warmups=args.warmups,
                date=time.strftime('%Y-%m-%d'), machine=machine(),
                python=platform.python_version(), revision=revision(),
                servers=server_versions(args.targets), smoke=args.smoke,
                load_start=round(os.getloadavg()[0], 2), cores=os.cpu_count(),
                **versions())
    results = {'meta': meta, 'targets': {}, 'order': []}
    if (args.merge or args.peer_only) and os.path.exists(json_path):
        with open(json_path) as f:
            old = json.load(f)
        for name in old.get('order', []):
            if args.peer_only or name not in args.targets:
                results['targets'][name] = old['targets'][name]
                results['order'].append(name)
        if args.peer_only:
            # The targets' figures are those of the earlier run.
            for key in ('date', 'revision', 'processes', 'values', 'warmups',
                        'concurrency', 'load_start', 'load_end', 'seconds',
                        'convert_source', 'convert_note'):
                if key in old.get('meta', {}):
                    meta[key] = old['meta'][key]
    if not args.peer_only:
        for name in args.targets:
            results['order'].append(name)
            results['targets'][name] = run_target(TARGETS[name], args)
    # Keep the canonical order in the report.
    results['order'].sort(key=lambda n: [t.name for t in ALL_TARGETS].index(n))
    if not args.no_convert and not args.peer_only:
        run_convert(results, args)
    if args.peer_python:
        ours_revision = revision()
        results['peer'] = peer.run(args, say)
        results['peer'].update(date=time.strftime('%Y-%m-%d'), revision=ours_revision,
                               load=round(os.getloadavg()[0], 2))
    if not args.no_roundtrips:
        measured = [TARGETS[n] for n in args.targets
                    if TARGETS[n].relstorage and (
                        args.peer_only or
                        results['targets'][n].get('status') == 'ok')]
        results['roundtrips'] = roundtrips.run(
            measured, args.scratch, args.objects, args.object_size, say)
    finish_meta(meta, started, args.peer_only)
    write_outputs(results, args.output_dir)
    say('done in %.0f s' % (time.time() - started))
    if args.peer_only:
        return 0 if results['peer'].get('status') == 'ok' else 1
    ran = [n for n in args.targets
           if results['targets'][n].get('status') == 'ok']
    return 0 if ran else 1


if __name__ == '__main__':
    sys.exit(main())
