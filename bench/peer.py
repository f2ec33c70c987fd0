"""RelStorage 4.3 side by side with this checkout, in the same run.

The incumbent is installed from PyPI into a virtualenv of its own
(``make bench-peer``: ``.venv-peer``) and treated as a black box: the
harness runs its zodbshootout and never imports its code.  For each
database and each zodbshootout phase, the two sides run interleaved,
``ours, 4.3, ours, 4.3, ...`` (``--peer-repeat`` pairs), every run on a
freshly created database of the same server, with the same ZConfig text
(default options), so that drift on the machine hits both sides alike.

Every zodbshootout process starts in an empty directory: pyperf starts its
workers with ``python -m``, which puts the working directory first on
``sys.path``, so a run from the checkout would make the peer's workers
import our package.  To prove which implementation ran, each process of
each side records at exit which ``relstorage`` it imported and the version
of the distribution beside it (bench/hooks/rs_bench_whoami.py, installed in
both virtualenvs); a run whose records do not all name the expected side is
not counted.

The ratio of a phase is 4.3's time divided by ours, per pair of runs (the
medians of their values): above 1 we are faster.  The report gives the
median ratio and the lowest and highest of the pairs.
"""
import json
import os
import shutil
import subprocess
import sys

from . import shootout
from .targets import TARGETS, Unavailable, safe_message

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: Our target -> the column it stands for.  The same driver on both sides.
COMPARED = (
    ('pg-psycopg2', 'PostgreSQL HF'),
    ('pg-psycopg2-hp', 'PostgreSQL HP'),
    ('mysql-mysqldb', 'MariaDB HF'),
    ('sqlite', 'SQLite'),
)
PEER_VERSION = '4.3'
PEER_LABEL = 'RelStorage 4.3'


class Side:
    """One implementation: which interpreter runs it, and what its
    processes must report having imported."""

    def __init__(self, key, label, python, expect_dir, expect_version):
        self.key = key
        self.label = label
        self.python = python
        self.expect_dir = os.path.realpath(expect_dir)
        self.expect_version = expect_version

    def env(self, database, whoami):
        env = {k: v for k, v in os.environ.items()
               if k not in ('PYTHONPATH', 'PYTHONHOME', 'PYTHONSTARTUP',
                            'RS_PEER_MARIADB_COMPAT', 'RS_BENCH_WHOAMI')}
        env['RS_BENCH_WHOAMI'] = whoami
        if self.key == 'peer' and database == 'mysql':
            # ../shared/bench/README.md: 4.3 sends MySQL-8-only SQL to
            # MariaDB 10.11 unless its shim is on.
            env['RS_PEER_MARIADB_COMPAT'] = '1'
        return env

    def check_record(self, record):
        """None if ``record`` (one whoami line) shows this side, else why not."""
        path = record.get('relstorage_file')
        version = record.get('relstorage_version', '')
        if not path:
            return None          # this process never imported relstorage
        real = os.path.realpath(path)
        if not real.startswith(self.expect_dir + os.sep):
            return 'pid %s imported relstorage from %s, not from %s' % (
                record.get('pid'), path, self.expect_dir)
        if not version.startswith(self.expect_version):
            return 'pid %s found relstorage %s, not %s' % (
                record.get('pid'), version, self.expect_version)
        return None


def sides(peer_python):
    """(ours, peer); raise Unavailable when the peer virtualenv is unusable."""
    import relstorage
    ours = Side('ours', 'this checkout', sys.executable,
                os.path.join(ROOT, 'relstorage'), relstorage.__version__)
    if not peer_python or not os.path.exists(peer_python):
        raise Unavailable('no RelStorage 4.3 virtualenv (%s); run "make bench-peer"'
                          % (peer_python or 'no --peer-python given'))
    # The venv's directory, not the interpreter it links to.
    venv = os.path.dirname(os.path.dirname(os.path.abspath(peer_python)))
    peer = Side('peer', PEER_LABEL, os.path.abspath(peer_python), venv,
                PEER_VERSION + '.')
    return ours, peer


def probe(side, cwd):
    """Ask the side's interpreter which relstorage it has (a subprocess:
    the harness itself never imports the peer)."""
    code = ('import json, relstorage, importlib.metadata as m, importlib.util as u; '
            'print(json.dumps({"relstorage_file": relstorage.__file__, '
            '"relstorage_version": m.version("relstorage"), '
            '"mariadb_shim": u.find_spec("peer_mariadb_compat") is not None}))')
    proc = subprocess.run([side.python, '-c', code], cwd=cwd, capture_output=True,
                          text=True, env=side.env(None, os.devnull), timeout=120)
    if proc.returncode:
        raise Unavailable('%s: %s' % (side.python, proc.stderr.strip().splitlines()[-1:]))
    record = json.loads(proc.stdout)
    problem = side.check_record(record)
    if problem:
        raise Unavailable(problem)
    return record


def neutral_dir(scratch):
    """An empty working directory for zodbshootout (see the module doc)."""
    path = os.path.join(scratch, 'neutral-cwd')
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def read_whoami(path):
    records = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    records.append(json.loads(line))
    except OSError:
        pass
    return records


def run_one(side, target, phase, tag, args, cwd):
    """One zodbshootout run of one phase on a fresh database."""
    handle = target.create(args.scratch, tag)
    base = os.path.join(args.scratch, 'peer', '%s-%s' % (target.name, tag))
    whoami = base + '.whoami'
    if os.path.exists(whoami):
        os.remove(whoami)
    try:
        config = target.shootout_config(handle, base + '.conf')
        results, elapsed, rc = shootout.run(
            config, base + '.json', base + '.log', args.peer_concurrency,
            args.objects, args.object_size,
            args.peer_processes, args.peer_values, args.warmups, [phase],
            python=side.python, cwd=cwd, env=side.env(target.database, whoami))
    finally:
        target.drop(handle)
    result = dict(results[phase])
    result['log'] = base + '.log'
    records = read_whoami(whoami)
    ran = [r for r in records if r.get('relstorage_file')]
    problems = [p for p in (side.check_record(r) for r in records) if p]
    result['processes_checked'] = len(ran)
    if problems or not ran:
        result['provenance'] = 'failed'
        result['provenance_error'] = (problems[0] if problems else
                                      'no process reported which relstorage it ran '
                                      '(is bench/hooks/rs_bench_whoami.pth installed?)')
        if result.get('status') == 'ok':
            result['status'] = 'failed'
            result['error'] = 'not counted: ' + result['provenance_error']
    else:
        result['provenance'] = 'ok'
        result['relstorage'] = {'file': ran[0]['relstorage_file'],
                                'version': ran[0]['relstorage_version']}
    return result


def run(args, say):
    """The side-by-side comparison for the selected targets; a dict for
    results['peer'] (see report.peer_markdown)."""
    from .report import summarize
    wanted = [(name, column) for name, column in COMPARED if name in args.targets]
    out = {'repeat': args.peer_repeat, 'processes': args.peer_processes,
           'concurrency': args.peer_concurrency,
           'values': args.peer_values, 'warmups': args.warmups,
           'objects': args.objects, 'object_size': args.object_size,
           'phases': list(args.peer_phases), 'order': [n for n, _ in wanted],
           'targets': {}}
    os.makedirs(os.path.join(args.scratch, 'peer'), exist_ok=True)
    cwd = neutral_dir(args.scratch)
    try:
        ours, peer = sides(args.peer_python)
        out['sides'] = {'ours': probe(ours, cwd), 'peer': probe(peer, cwd)}
    except Unavailable as e:
        out['status'] = 'unavailable'
        out['reason'] = str(e)
        say('side by side: not run: %s' % e)
        return out
    out['status'] = 'ok'
    out['sides']['ours']['python'] = ours.python
    out['sides']['peer']['python'] = peer.python
    for name, column in wanted:
        target = TARGETS[name]
        entry = {'column': column, 'label': target.label, 'driver': target.driver,
                 'mode': target.mode, 'database': target.database, 'phases': {}}
        out['targets'][name] = entry
        try:
            target.check()
        except Unavailable as e:
            entry.update(status='unavailable', reason=str(e))
            say('side by side, %s: not run: %s' % (name, e))
            continue
        entry['status'] = 'ok'
        for phase in args.peer_phases:
            runs = {'ours': [], 'peer': []}
            for rep in range(args.peer_repeat):
                for side in (ours, peer):
                    tag = 'peer_%s_%s_%d' % (phase.lower(), side.key, rep)
                    try:
                        result = run_one(side, target, phase, tag, args, cwd)
                    except Exception as e:  # pylint:disable=broad-except
                        result = {'status': 'failed', 'error': safe_message(e)}
                    runs[side.key].append(result)
            entry['phases'][phase] = phase_summary(runs, summarize)
            say('side by side, %s, %s: %s' % (name, phase,
                                             describe_ratio(entry['phases'][phase])))
    return out


def phase_summary(runs, summarize):
    """Ratios of the pairs where both sides produced values."""
    ratios = []
    for a, b in zip(runs['ours'], runs['peer']):
        ours = median_of(a)
        theirs = median_of(b)
        if ours and theirs:
            ratios.append(theirs / ours)
    summary = {'runs': runs, 'ratios': ratios}
    for key in ('ours', 'peer'):
        values = [v for r in runs[key] if r.get('status') == 'ok' for v in r['values']]
        summary[key + '_median'] = summarize(values)[0] if values else None
        errors = [r.get('error') for r in runs[key] if r.get('status') != 'ok']
        if errors:
            summary[key + '_error'] = errors[0] or 'failed'
    if ratios:
        summary['ratio'] = summarize(ratios)[0]
        summary['ratio_min'] = min(ratios)
        summary['ratio_max'] = max(ratios)
    return summary


def median_of(result):
    if result.get('status') != 'ok' or not result.get('values'):
        return None
    from .report import summarize
    return summarize(result['values'])[0]


def describe_ratio(summary):
    if summary.get('ratio') is None:
        return 'no ratio (ours: %s; 4.3: %s)' % (summary.get('ours_error', 'ok'),
                                                summary.get('peer_error', 'ok'))
    return '%.2f (%.2f-%.2f over %d pairs)' % (summary['ratio'], summary['ratio_min'],
                                               summary['ratio_max'], len(summary['ratios']))
