"""Run zodbshootout on one generated ZConfig file and read its results.

zodbshootout (with pyperf) runs every benchmark in fresh worker processes;
``processes`` of them per benchmark, each contributing ``values`` timed
values after ``warmups`` untimed ones. ``--loops 1`` skips pyperf's
calibration: one value is then ``inner_loops`` (10) runs of the phase, and
pyperf divides, so every value is seconds per phase on ``objects`` objects.

A benchmark that raises is logged by zodbshootout and given the value 666
(its marker); zodbshootout also returns 666 for combinations it knows not
to work (FileStorage with more than one process; ZEO readCurrent and
conflicts with processes). Both come back here as a status, not a number.
"""
import os
import re
import signal
import subprocess
import sys
import time

from .targets import safe_message

#: Phase key -> (zodbshootout benchmark name, description of the name).
PHASES = (
    ('add', 'add', r'add \d+ objects'),
    ('update', 'update', r'update \d+ objects'),
    ('cold', 'cold', r'read \d+ cold objects'),
    ('prefetch_cold', 'prefetch_cold', r'read \d+ cold prefeteched objects'),
    ('warm', 'warm', r'write/read \d+ objects'),
    ('readCurrent', 'readCurrent', r'readCurrent \d+ objects'),
    ('new_oid', 'new_oid', r'allocate \d+ OIDs'),
    ('conflicts', 'conflicts', r'update \d+ conflicting objects'),
    ('tpc', 'tpc', r'tpc'),
)
PHASE_KEYS = tuple(p[0] for p in PHASES)
PHASE_TITLES = {
    'add': 'add',
    'update': 'update',
    'cold': 'cold read',
    'prefetch_cold': 'prefetched cold read',
    'warm': 'write-then-read (warm)',
    'readCurrent': 'readCurrent',
    'new_oid': 'allocate OIDs',
    'conflicts': 'conflicting updates',
    'tpc': 'empty commit (tpc)',
}
MAGIC = 666  # zodbshootout's value for a failed or disabled benchmark

_NAME = re.compile(r'^\{c=(\d+) [a-z]+, o=(\d+)\} (.+?): (.+?)( \(disabled\))?$')


def classify(short_name):
    for key, _, pattern in PHASES:
        if re.fullmatch(pattern, short_name):
            return key
    return None


def run(config_path, out_path, log_path, concurrency, objects, object_size,
        processes, values, warmups, phases=PHASE_KEYS, timeout=900,
        python=None, cwd=None, env=None):
    """Run zodbshootout; return ``{phase: result}`` where a result is a dict
    with ``values`` (seconds per phase) or ``status`` and ``error``.

    ``python`` is the interpreter of the virtualenv to benchmark (default:
    ours); ``cwd`` and ``env`` those of the zodbshootout process.  pyperf
    starts its workers with ``python -m``, which puts the working directory
    first on ``sys.path``: whoever benchmarks another installation than the
    checkout must pass a directory where no ``relstorage`` package lies.
    """
    if os.path.exists(out_path):
        os.remove(out_path)
    names = [dict((p[0], p[1]) for p in PHASES)[k] for k in phases]
    cmd = [python or sys.executable, '-m', 'zodbshootout',
           '--include-mapping', 'false',
           '--concurrency', str(concurrency),
           '--object-counts', str(objects),
           '--object-size', str(object_size),
           '--processes', str(processes),
           '--values', str(values),
           '--warmups', str(warmups),
           '--loops', '1',
           '--quiet',
           '--output', out_path,
           config_path] + names
    started = time.time()
    with open(log_path, 'w') as log:
        log.write('$ %s\n' % ' '.join(cmd))
        log.flush()
        # Own process group, so a hung run is stopped with all its workers.
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, cwd=cwd, env=env)
        try:
            returncode = process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = 'timeout after %d s' % timeout
    elapsed = time.time() - started
    errors = scan_log(log_path)
    results = {}
    if os.path.exists(out_path):
        results = read_results(out_path)
    for key in phases:
        if key in results:
            result = results[key]
            if result.get('status') == 'failed':
                result['error'] = errors.get(key, 'see %s' % log_path)
            continue
        results[key] = {
            'status': 'failed',
            'error': errors.get(key) or ('zodbshootout exited %s%s; see %s' % (
                returncode, ': ' + errors['*'] if '*' in errors else '', log_path)),
        }
    return results, elapsed, returncode


def read_results(out_path):
    import pyperf
    suite = pyperf.BenchmarkSuite.load(out_path)
    results = {}
    for bench in suite.get_benchmarks():
        m = _NAME.match(bench.get_name())
        if not m:
            continue
        key = classify(m.group(4))
        if key is None:
            continue
        vals = list(bench.get_values())
        if m.group(5):
            results[key] = {'status': 'disabled',
                            'error': 'disabled by zodbshootout for this '
                                     'storage and concurrency'}
        elif not vals or any(v >= MAGIC for v in vals):
            good = [v for v in vals if v < MAGIC]
            results[key] = {'status': 'failed', 'values': good}
        else:
            results[key] = {'status': 'ok', 'values': vals}
    return results


_BENCH_FUNC = {
    'bench_add': 'add', 'bench_update': 'update',
    'bench_cold_read': 'cold', 'bench_cold_read_prefetch': 'prefetch_cold',
    'bench_read_after_write': 'warm', 'bench_readCurrent': 'readCurrent',
    'bench_new_oid': 'new_oid', 'bench_conflicting_updates': 'conflicts',
    'bench_tpc': 'tpc',
}


def scan_log(log_path):
    """Find zodbshootout's "When running <bench_x>" tracebacks in the log;
    return ``{phase: last line of the first traceback}``, and under ``'*'``
    that of the first traceback of all."""
    errors = {}
    try:
        with open(log_path, errors='replace') as f:
            lines = f.read().splitlines()
    except OSError:
        return errors
    current = None
    for i, line in enumerate(lines):
        if line.startswith('Traceback') and '*' not in errors:
            # Whatever failed outside a benchmark (opening the storage,
            # populating it): the first one explains the exit status.
            for follow in lines[i + 1:i + 400]:
                if follow and not follow.startswith(' '):
                    errors['*'] = safe_message_text(follow)
                    break
        m = re.search(r'When running .*?\b(bench_[A-Za-z_]+)', line)
        if m:
            current = _BENCH_FUNC.get(m.group(1))
            # The exception line ends the traceback that follows.
            for follow in lines[i + 1:i + 400]:
                if follow and not follow.startswith((' ', 'Traceback',
                                                     'During handling',
                                                     'The above exception')):
                    if current and current not in errors:
                        errors[current] = safe_message_text(follow)
                    break
    return errors


def safe_message_text(text):
    from relstorage.options import redact_secrets
    return redact_secrets(' '.join(text.split()))[:300]


__all__ = ['run', 'PHASES', 'PHASE_KEYS', 'PHASE_TITLES', 'safe_message']
