"""Pack of garbage made of subtrees with back references (history-free).

F containers of K children each (a child references its container as
``parent``, a container its children through an OOBTree, as zope.container
and __parent__ make them), half of the containers unlinked, then one pack
with GC and no writer.  The children of a container have higher OIDs than
it and reference it: they go with the deletion batch that holds it (see
docs/pack.rst, "upward-closed" batches).  Usage::

    python bench/pack_tree.py DATABASE F K populate
    python bench/pack_tree.py DATABASE F K pack

DATABASE: a PostgreSQL database name (created beforehand), ``my:NAME`` for
MariaDB/MySQL, or an absolute directory for SQLite.  Populate once, copy
(``CREATE DATABASE ... TEMPLATE``, mysqldump, cp -r), and pack copies.
"""
import sys, time, os, transaction, ZODB, ZODB.config
from BTrees.OOBTree import OOBTree
from persistent.mapping import PersistentMapping
from ZODB.serialize import referencesf
import relstorage
name, F, K, what = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if name.startswith('/'):
    inner = '<sqlite3>\ndata-dir %s\n</sqlite3>' % name
elif name.startswith('my:'):
    inner = '<mysql>\nhost 127.0.0.1\nuser root\ndb %s\n</mysql>' % name[3:]
else:
    inner = '<postgresql>\ndsn host=127.0.0.1 user=postgres dbname=%s\n</postgresql>' % name
conf = '%%import relstorage\n<relstorage>\nkeep-history false\n%s\n</relstorage>' % inner
db = ZODB.DB(ZODB.config.storageFromString(conf))
if what == 'populate':
    with db.transaction() as conn:
        conn.root()['top'] = OOBTree()
    for start in range(0, F, 2000):
        with db.transaction() as conn:
            top = conn.root()['top']
            for f in range(start, min(F, start + 2000)):
                folder = top[f] = PersistentMapping()
                kids = folder['kids'] = OOBTree()
                for k in range(K):
                    kid = kids[k] = PersistentMapping(v=k)
                    kid['parent'] = folder
    with db.transaction() as conn:
        top = conn.root()['top']
        for f in range(0, F, 2):
            del top[f]
    print('populated', len(db.storage))
else:
    print(relstorage.__file__)
    t = time.time()
    r = db.storage.run_pack(time.time() + 1, referencesf)
    print('pack %.1fs' % (time.time() - t), r.summary())
db.close()
