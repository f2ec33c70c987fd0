"""Operations benchmark: zodbconvert of a generated FileStorage.

The source is made once per scratch dir (and reused while its parameters
stay the same): ``transactions`` transactions of ``objects_per_txn`` small
persistent objects each (about 100,000 records of ~100 bytes), then one
transaction holding ``blobs`` blobs of ``blob_mb`` MB. A second source
without the blobs is used for a storage that fails a one-blob check
(:func:`blob_problem`), so the records are still measured.

The conversion runs ``python -m relstorage.zodbconvert CONFIG`` into a
fresh database and is timed from outside (process start to exit, so it
includes interpreter start-up, about 0.3 s). Afterwards the destination's
last transaction id is compared with the source's. Results are records/s
(data records copied, blob records included) and MB/s (pickle bytes plus
blob bytes).
"""
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

from .targets import safe_message

DEFAULTS = dict(transactions=100, objects_per_txn=1000, object_size=100,
                blobs=20, blob_mb=1)
SMOKE = dict(transactions=5, objects_per_txn=200, object_size=100,
             blobs=2, blob_mb=1)


def generate(directory, transactions, objects_per_txn, object_size, blobs,
             blob_mb, with_blobs=True, revisions=1):
    """Make (or reuse) the source FileStorage in *directory*; return its
    metadata dict (path, blob_dir, records, bytes, blob_bytes, ...).

    With ``revisions`` > 1, the small objects are rewritten in further
    passes of ``transactions`` transactions (the last pass rewriting only a
    share of them when ``revisions`` is not whole), so that the source holds
    about ``revisions`` records per object: a history for the history-free
    fast path to skip."""
    params = dict(transactions=transactions, objects_per_txn=objects_per_txn,
                  object_size=object_size, blobs=blobs if with_blobs else 0,
                  blob_mb=blob_mb, version=1)
    if revisions > 1:
        # Only then, so that sources made before this option are reused.
        params['revisions'] = revisions
    meta_path = os.path.join(directory, 'source.json')
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get('params') == params and os.path.exists(meta['path']):
            return meta
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)

    import transaction
    import ZODB
    from persistent.mapping import PersistentMapping
    from ZODB.blob import Blob
    from ZODB.FileStorage import FileStorage

    path = os.path.join(directory, 'Data.fs')
    blob_dir = os.path.join(directory, 'blobs') if params['blobs'] else None
    rnd = random.Random(1)
    started = time.time()
    storage = FileStorage(path, blob_dir=blob_dir)
    db = ZODB.DB(storage, cache_size=objects_per_txn * 2)
    conn = db.open()
    root = conn.root()
    root['data'] = PersistentMapping()
    transaction.commit()
    for t in range(transactions):
        container = PersistentMapping()
        # The container is one record, so each transaction writes
        # objects_per_txn records in all.
        for i in range(objects_per_txn - 1):
            container[i] = PersistentMapping(
                {'data': rnd.randbytes(object_size)})
        root['data'][t] = container
        transaction.get().note('generated transaction %d' % t)
        transaction.commit()
        conn.cacheMinimize()
    passes = int(math.ceil(revisions)) - 1
    for r in range(1, passes + 1):
        # The last pass may rewrite only a part of the objects (revisions
        # 1.5: half of them once more).
        share = min(revisions - r, 1.0)
        for t in range(transactions):
            container = root['data'][t]
            for i in range(int(round((objects_per_txn - 1) * share))):
                container[i]['data'] = rnd.randbytes(object_size)
            container['revision'] = r
            transaction.get().note('revision %d of transaction %d' % (r, t))
            transaction.commit()
            conn.cacheMinimize()
    if params['blobs']:
        container = PersistentMapping()
        for i in range(params['blobs']):
            blob = Blob()
            with blob.open('w') as f:
                f.write(rnd.randbytes(blob_mb * 1024 * 1024))
            container[i] = blob
        root['blobs'] = container
        transaction.get().note('generated blobs')
        transaction.commit()
    conn.close()
    db.close()

    # Count what a copy has to move.
    storage = FileStorage(path, blob_dir=blob_dir, read_only=True)
    records = txns = pickle_bytes = blob_bytes = 0
    try:
        for txn in storage.iterator():
            txns += 1
            for record in txn:
                records += 1
                pickle_bytes += len(record.data or b'')
                if blob_dir:
                    try:
                        blob_path = storage.loadBlob(record.oid, record.tid)
                    except Exception:  # not a blob record
                        continue
                    blob_bytes += os.path.getsize(blob_path)
        last_tid = storage.lastTransaction().hex()
    finally:
        storage.close()
    meta = dict(params=params, path=path, blob_dir=blob_dir, records=records,
                transactions=txns, bytes=pickle_bytes, blob_bytes=blob_bytes,
                last_tid=last_tid, generate_seconds=time.time() - started)
    with open(meta_path, 'w') as f:
        json.dump(meta, f, indent=1)
    return meta


def zodbconvert_available():
    """None if ``python -m relstorage.zodbconvert`` looks usable, else the
    reason it does not."""
    proc = subprocess.run([sys.executable, '-m', 'relstorage.zodbconvert',
                           '--help'], capture_output=True, text=True,
                          timeout=120)
    out = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0 or 'not yet implemented' in out:
        last = out.splitlines()[-1] if out else 'no output'
        return ('relstorage.zodbconvert --help exited %s (%s)'
                % (proc.returncode, safe_message_text(last)))
    return None


def safe_message_text(text):
    from relstorage.options import redact_secrets
    return redact_secrets(' '.join(text.split()))[:300]


def blob_problem(target, scratch):
    """None if *target* stores and reads back a blob with ``blob-dir``
    set, else why not."""
    import transaction
    import ZODB.config
    from ZODB.blob import Blob
    handle = target.create(scratch, 'blobcheck')
    blob_dir = os.path.join(scratch, target.name + '-blobcheck-blobs')
    shutil.rmtree(blob_dir, ignore_errors=True)
    os.makedirs(blob_dir)
    try:
        path = target.shootout_config(
            handle, os.path.join(scratch, target.name + '-blobcheck.conf'),
            blob_dir=blob_dir)
        db = ZODB.config.databaseFromURL(path)
        try:
            tm = transaction.TransactionManager()
            conn = db.open(tm)
            blob = Blob(b'bench')
            conn.root()['blob'] = blob
            tm.commit()
            conn.close()
            conn = db.open(tm)
            with conn.root()['blob'].open() as f:
                if f.read() != b'bench':
                    return 'a blob read back wrong'
            conn.close()
        finally:
            db.close()
        return None
    except Exception as e:
        return safe_message(e)
    finally:
        target.drop(handle)
        shutil.rmtree(blob_dir, ignore_errors=True)


def run(target, scratch, source, log_path, timeout=1200, options=()):
    """Convert *source* (metadata from :func:`generate`) into a fresh
    database of *target* (zodbconvert *options* added); return a result
    dict."""
    handle = target.create(scratch, 'convert')
    blob_dir = None
    if source['blob_dir']:
        blob_dir = os.path.join(scratch, target.name + '-convert-blobs')
        shutil.rmtree(blob_dir, ignore_errors=True)
        os.makedirs(blob_dir)
    try:
        config = target.zodbconvert_config(
            handle, os.path.join(scratch, '%s-zodbconvert.conf' % target.name),
            source['path'], source['blob_dir'], blob_dir=blob_dir)
        cmd = [sys.executable, '-m', 'relstorage.zodbconvert'] + list(options) + [config]
        with open(log_path, 'w') as log:
            log.write('$ %s\n' % ' '.join(cmd))
            log.flush()
            started = time.perf_counter()
            try:
                proc = subprocess.run(cmd, stdout=log,
                                      stderr=subprocess.STDOUT,
                                      timeout=timeout)
                returncode = proc.returncode
            except subprocess.TimeoutExpired:
                returncode = 'timeout'
            elapsed = time.perf_counter() - started
        if returncode != 0:
            with open(log_path, errors='replace') as f:
                tail = [line for line in f.read().splitlines() if line]
            return {'status': 'failed', 'seconds': elapsed,
                    'error': 'exit %s: %s' % (
                        returncode,
                        safe_message_text(tail[-1] if tail else ''))}
        verified = verify(config, source)
        total = source['bytes'] + source['blob_bytes']
        return {
            'status': 'ok', 'seconds': elapsed,
            'records': source['records'],
            'records_per_s': source['records'] / elapsed,
            'mb_per_s': total / elapsed / 1e6,
            'with_blobs': bool(source['blob_dir']),
            'verified': verified,
        }
    except Exception as e:
        return {'status': 'failed', 'error': safe_message(e)}
    finally:
        target.drop(handle)
        if blob_dir:
            shutil.rmtree(blob_dir, ignore_errors=True)


def verify(config_path, source):
    """Compare the destination's last transaction id with the source's."""
    code = (
        'import io, sys, ZConfig\n'
        'schema = ZConfig.loadSchemaFile(io.StringIO("""'
        '<schema><import package="ZODB"/>'
        '<multisection type="ZODB.storage" name="*" attribute="storages"/>'
        '</schema>"""))\n'
        'conf, _ = ZConfig.loadConfig(schema, sys.argv[1])\n'
        'dest = [s for s in conf.storages if s.name == "destination"][0]\n'
        'st = dest.open()\n'
        'print(st.lastTransaction().hex())\n'
        'st.close()\n')
    proc = subprocess.run([sys.executable, '-c', code, config_path],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return 'could not open destination: %s' % safe_message_text(
            (proc.stderr.strip().splitlines() or [''])[-1])
    got = proc.stdout.strip()
    if got == source['last_tid']:
        return 'ok'
    return 'last tid %s, source %s' % (got, source['last_tid'])


def main(argv=None):
    """``python -m bench.convert``: only the zodbconvert benchmark, for a few
    targets, several runs each, the targets taking turns (so that a load
    from other work on the machine spreads over all of them alike).
    Prints each run and the median per target; writes no report."""
    import argparse
    import statistics
    from .targets import TARGETS, Unavailable
    p = argparse.ArgumentParser(prog='python -m bench.convert',
                                description=main.__doc__)
    p.add_argument('--targets', default='mysql-mysqldb',
                   help='comma-separated RelStorage targets (see '
                        '"python -m bench --list")')
    p.add_argument('--runs', type=int, default=3,
                   help='runs per target (default 3)')
    p.add_argument('--no-blobs', action='store_true',
                   help='convert the source without the blob transaction')
    p.add_argument('--smoke', action='store_true',
                   help='the tiny source of "python -m bench --smoke"')
    p.add_argument('--revisions', type=float, default=1,
                   help='records per small object in the source (default 1: '
                        'no history)')
    p.add_argument('--strategy', choices=('auto', 'replay', 'current'),
                   help="pass zodbconvert's --strategy (default: its own)")
    p.add_argument('--scratch', default=os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        'var', 'bench'))
    args = p.parse_args(argv)
    names = [n for n in args.targets.split(',') if n]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        p.error('unknown targets: %s' % ', '.join(unknown))
    scratch = os.path.abspath(args.scratch)
    os.makedirs(os.path.join(scratch, 'logs'), exist_ok=True)
    for name in names:
        try:
            TARGETS[name].check()
        except Unavailable as e:
            p.error('%s cannot run here: %s' % (name, e))
    params = dict(SMOKE if args.smoke else DEFAULTS)
    with_blobs = not args.no_blobs
    source = generate(os.path.join(scratch, 'convert-source' +
                                   ('' if with_blobs else '-noblobs') +
                                   ('-r%g' % args.revisions if args.revisions > 1
                                    else '')),
                      with_blobs=with_blobs, revisions=args.revisions, **params)
    options = ['--strategy', args.strategy] if args.strategy else []
    rates = {name: [] for name in names}
    for i in range(args.runs):
        for name in names:
            log = os.path.join(scratch, 'logs', '%s-zodbconvert.log' % name)
            res = run(TARGETS[name], scratch, source, log, options=options)
            if res['status'] != 'ok' or res['verified'] != 'ok':
                print('%s run %d: %s' % (name, i + 1, res), flush=True)
                return 1
            rates[name].append(res['records_per_s'])
            with open(log, errors='replace') as f:
                chose = [line.strip() for line in f
                         if line.startswith('History-free destination:')]
            print('%s run %d: %.0f records/s, %.1f MB/s (%.2f s), load %.2f%s'
                  % (name, i + 1, res['records_per_s'], res['mb_per_s'],
                     res['seconds'], os.getloadavg()[0],
                     ('\n    ' + chose[0]) if chose else ''), flush=True)
    for name in names:
        print('%s: median %.0f records/s over %d runs (%s)' % (
            name, statistics.median(rates[name]), len(rates[name]),
            ', '.join('%.0f' % r for r in rates[name])))
    return 0


if __name__ == '__main__':
    sys.exit(main())
