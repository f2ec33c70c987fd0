"""The read phases, for comparing two trees of our own side by side.

    cd /tmp && python /path/to/bench/read_ab.py --db postgresql \\
        --trees /work/old,/work/new --rounds 5

Like write_ab.py (same options, alternating A B A B, a fresh process on a
fresh database each run), for what a read-mostly site does, on 1000
objects of about 128 bytes through ZODB.DB (times are the fastest of 7
repetitions within a run, the least disturbed by other jobs):

- ``cold``: one transaction reading every object with both the ZODB
  connection's cache and the storage's state cache emptied (zodbshootout's
  cold read: one query per object);
- ``warm``: the same with only the connection's cache emptied (served by
  the state cache, zodbshootout's warm read);
- ``txns``: 1000 transactions, each reading one object from the
  connection's cache: what each transaction's start and end cost (poll,
  snapshot, afterCompletion).
"""
import os
import sys

RUN = r'''
import json, os, sys, time, transaction, ZODB
import relstorage
from persistent.mapping import PersistentMapping
from persistent.list import PersistentList
sys.path.insert(0, sys.argv[2])
from scratchdb import open_storage, fresh, drop
spec = json.loads(sys.argv[1])
N, REPEAT = 1000, 7
fresh(spec['db'], spec['where'])
db = ZODB.DB(open_storage(spec))
out = {'relstorage': os.path.dirname(relstorage.__file__)}
with db.transaction() as c:
    c.root()['objs'] = PersistentList(PersistentMapping(pad=b'x' * 100) for _ in range(N))
tm = transaction.TransactionManager()
conn = db.open(tm)


def read_all(clear_storage_cache):
    tm.begin()
    objs = conn.root()['objs']
    conn.cacheMinimize()
    if clear_storage_cache:
        db.storage._cache.clear()
    t = time.perf_counter()
    for o in objs:
        o._p_activate()
    elapsed = time.perf_counter() - t
    tm.abort()
    return elapsed


for phase, clear in (('cold', True), ('warm', False)):
    read_all(clear)
    out[phase] = min(read_all(clear) for _ in range(REPEAT))
objs = conn.root()['objs']
times = []
for _ in range(REPEAT):
    t = time.perf_counter()
    for i in range(N):
        tm.begin()
        objs[i]._p_activate()
        tm.commit()
    times.append(time.perf_counter() - t)
out['txns'] = min(times)
conn.close()
db.close()
drop(spec['db'], spec['where'])
print(json.dumps(out))
'''

PHASES = ('cold', 'warm', 'txns')

if __name__ == '__main__':
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import write_ab
    write_ab.main(run=RUN, phases=PHASES, description=__doc__.splitlines()[0])
