"""The main job on the embedded default: FileStorage -> SQLite RelStorage.

``make demo`` runs this.  It builds a FileStorage of a few thousand objects
over a few hundred transactions, copies it into a history-preserving
RelStorage on SQLite (no server), then reads everything back through ZODB
and compares it record by record with the source, printing what it did.

    python -m relstorage.demo [--objects N] [--dir DIR]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import ZODB
import ZODB.config
import ZODB.FileStorage
from BTrees.OOBTree import OOBTree
from persistent.mapping import PersistentMapping

from relstorage import zodbconvert
from relstorage import zodbpack

CONVERT = """
%%import relstorage
<filestorage source>
  path %s
</filestorage>
<relstorage destination>
  keep-history true
  <sqlite3>
    data-dir %s
  </sqlite3>
</relstorage>
"""

STORAGE = """
%%import relstorage
<relstorage>
  keep-history true
  <sqlite3>
    data-dir %s
  </sqlite3>
</relstorage>
"""


def build_source(path, objects, per_txn):
    storage = ZODB.FileStorage.FileStorage(path, create=True)
    db = ZODB.DB(storage)
    with db.transaction('create the catalog') as conn:
        conn.root.catalog = OOBTree()
    made = 0
    while made < objects:
        with db.transaction('add documents %d-%d' % (made, made + per_txn - 1)) as conn:
            catalog = conn.root.catalog
            for i in range(made, min(objects, made + per_txn)):
                catalog['doc%06d' % i] = PersistentMapping(
                    title='Document %d' % i, body='x' * (i % 200), version=1)
        made += per_txn
    with db.transaction('edit every tenth document') as conn:
        for key, doc in conn.root.catalog.items():
            if int(key[3:]) % 10 == 0:
                doc['version'] = 2
    db.close()


def compare(source, dest):
    """Compare every transaction and record; return (transactions, records)."""
    txns = records = 0
    for src_txn, dst_txn in zip(source.iterator(), dest.iterator()):
        assert src_txn.tid == dst_txn.tid, (src_txn.tid, dst_txn.tid)
        assert src_txn.description == dst_txn.description
        src_records = sorted((r.oid, r.data) for r in src_txn)
        dst_records = sorted((r.oid, r.data) for r in dst_txn)
        assert src_records == dst_records, 'records differ in %r' % src_txn.tid
        txns += 1
        records += len(src_records)
    return txns, records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--objects', type=int, default=5000)
    parser.add_argument('--dir', help='keep the files here instead of a temporary directory')
    args = parser.parse_args(argv)

    workdir = args.dir or tempfile.mkdtemp(prefix='relstorage-demo-')
    fs_path = os.path.join(workdir, 'Data.fs')
    data_dir = os.path.join(workdir, 'sqlite')
    # (A helper agent's check: files of these names in --dir were removed
    # without a word.)
    found = [name for name in ('Data.fs', 'sqlite', 'convert.conf', 'pack.conf')
             if os.path.lexists(os.path.join(workdir, name))]
    if found:
        parser.error('--dir %s already holds %s; the demo writes them afresh: give it a '
                     'new or empty directory' % (workdir, ', '.join(found)))
    os.makedirs(workdir, exist_ok=True)
    try:
        t0 = time.time()
        build_source(fs_path, args.objects, per_txn=25)
        print('Built a FileStorage of %d documents in %.1fs: %s'
              % (args.objects, time.time() - t0, fs_path))

        conf = os.path.join(workdir, 'convert.conf')
        with open(conf, 'w') as f:
            f.write(CONVERT % (fs_path, data_dir))
        print('$ zodbconvert --verify %s' % conf, flush=True)
        t0 = time.time()
        status = zodbconvert.main(['--verify', '--no-progress', conf])
        if status:
            print('zodbconvert failed with status %s' % status)
            return status
        print('Copied it into RelStorage on SQLite in %.1fs (%s)' % (time.time() - t0, data_dir))

        source = ZODB.FileStorage.FileStorage(fs_path, read_only=True)
        dest = ZODB.config.storageFromString(STORAGE % data_dir)

        txns, records = compare(source, dest)
        print('Compared %d transactions and %d records: identical' % (txns, records))

        db = ZODB.DB(dest)
        with db.transaction() as conn:
            catalog = conn.root.catalog
            count = len(catalog)
            edited = sum(1 for doc in catalog.values() if doc['version'] == 2)
        print('Read back through ZODB: %d documents, %d of them edited, %d objects in storage'
              % (count, edited, len(dest)))
        undo = db.undoLog(0, 1)
        print('Last undoable transaction: %r' % (undo[0]['description'],))
        db.close()
        source.close()
        assert count == args.objects

        pack_conf = os.path.join(workdir, 'pack.conf')
        with open(pack_conf, 'w') as f:
            f.write(STORAGE % data_dir)
        # (-d 0: to now; without it zodbpack keeps a day of history, and
        # everything here is seconds old.)
        print('$ zodbpack -d 0 %s' % pack_conf, flush=True)
        if zodbpack.main(['-q', '-d', '0', pack_conf]):
            return 1
        dest = ZODB.config.storageFromString(STORAGE % data_dir)
        db = ZODB.DB(dest)
        with db.transaction() as conn:
            assert len(conn.root.catalog) == args.objects
        print('Packed: %d objects remain, all documents still readable' % len(dest))
        db.close()
        print('Demo finished: all checks passed.')
        if not args.dir:
            print('(%s is removed now; run with --dir DIR to keep the files and '
                  'rerun the commands above.)' % workdir)
        return 0
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == '__main__':
    sys.exit(main())
