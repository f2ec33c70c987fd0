"""Round trips to the database server of one commit, counted on the client.

The harness opens our storage in its own process with every DB-API
connection it makes wrapped (``DBConnection`` is handed a counting proxy),
runs ``ZODB.DB`` commits of ``objects`` new objects (add), of the same
objects changed (update), and of nothing (an empty ``tpc`` cycle), and
counts, from just before ``transaction.commit()`` to just after it, on the
storage's load, store and OID connections:

- every ``execute``, ``executemany``, COPY and stored procedure call (one
  request the client waits for; an ``executemany`` is counted once, as
  mysqlclient sends one multi-row INSERT, while psycopg2 sends one
  statement per row: where it is used on PostgreSQL, its rows are given
  too);
- every ``commit`` and ``rollback``;
- on psycopg connections outside autocommit, the ``BEGIN`` the driver sends
  by itself before the first statement of a transaction.

Results from a buffered cursor are fetched with the statement, so fetches
are not counted.  SQLite runs in the process: its "round trips" are calls
into the library, listed for comparison.
"""
import collections

#: SQL verbs we name in the breakdown; anything else is 'other'.
VERBS = ('SELECT', 'INSERT', 'UPDATE', 'DELETE', 'COPY', 'BEGIN', 'SET', 'LOCK',
         'CALL', 'EXECUTE', 'PREPARE', 'WITH', 'TRUNCATE', 'CREATE', 'START', 'SHOW',
         'SAVEPOINT', 'RELEASE', 'DO', 'XA')


class Counter:

    def __init__(self):
        self.active = False
        self.calls = collections.Counter()       # (purpose, verb) -> n
        self.rows = 0                             # executemany rows

    def add(self, purpose, verb, n=1):
        if self.active:
            self.calls[(purpose, verb)] += n

    def snapshot(self):
        total = sum(self.calls.values())
        by_purpose = collections.Counter()
        by_verb = collections.Counter()
        for (purpose, verb), n in self.calls.items():
            by_purpose[purpose] += n
            by_verb[verb] += n
        return {'total': total, 'by_purpose': dict(by_purpose),
                'by_verb': dict(by_verb), 'executemany_rows': self.rows}


def _verb(sql):
    if isinstance(sql, bytes):
        sql = sql.decode('latin-1', 'replace')
    words = str(sql).split(None, 1)
    word = words[0].upper() if words else ''
    return word if word in VERBS else 'other'


class CountingCursor:

    def __init__(self, cursor, owner):
        self._cursor = cursor
        self._owner = owner

    def __getattr__(self, name):
        return getattr(self._cursor, name)

    def __iter__(self):
        return iter(self._cursor)

    def _statement(self, sql):
        self._owner.statement(_verb(sql))

    def execute(self, sql, *args, **kw):
        self._statement(sql)
        return self._cursor.execute(sql, *args, **kw)

    def executemany(self, sql, seq, *args, **kw):
        seq = list(seq)
        self._statement(sql)
        if self._owner.counter.active:
            self._owner.counter.rows += len(seq)
        return self._cursor.executemany(sql, seq, *args, **kw)

    def copy_expert(self, sql, *args, **kw):          # psycopg2
        self._statement(sql)
        return self._cursor.copy_expert(sql, *args, **kw)

    def copy(self, sql, *args, **kw):                 # psycopg 3
        self._statement(sql)
        return self._cursor.copy(sql, *args, **kw)

    def callproc(self, name, *args, **kw):
        self._owner.statement('CALL')
        return self._cursor.callproc(name, *args, **kw)


class CountingConnection:

    def __init__(self, raw, purpose, counter, implicit_begin):
        self._raw = raw
        self._purpose = purpose
        self.counter = counter
        self._implicit_begin = implicit_begin
        self._in_txn = False

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def statement(self, verb):
        if (self._implicit_begin and not self._in_txn
                and not getattr(self._raw, 'autocommit', True)):
            self.counter.add(self._purpose, 'BEGIN (implicit)')
        self._in_txn = True
        self.counter.add(self._purpose, verb)

    def cursor(self, *args, **kw):
        return CountingCursor(self._raw.cursor(*args, **kw), self)

    def commit(self):
        self.counter.add(self._purpose, 'COMMIT')
        self._in_txn = False
        return self._raw.commit()

    def rollback(self):
        self.counter.add(self._purpose, 'ROLLBACK')
        self._in_txn = False
        return self._raw.rollback()


def install(counter, implicit_begin):
    """Make every DBConnection made from now on count on ``counter``;
    return a function that undoes it."""
    from relstorage.adapters import connections
    original = connections.DBConnection.__init__

    def __init__(self, adapter, raw, purpose):
        original(self, adapter, CountingConnection(raw, purpose, counter, implicit_begin),
                 purpose)

    connections.DBConnection.__init__ = __init__

    def uninstall():
        connections.DBConnection.__init__ = original
    return uninstall


def measure(target, scratch, objects, object_size):
    """{'add': counts, 'update': counts, 'empty': counts} for one commit
    each, on a fresh database of ``target``."""
    import transaction
    import ZODB
    import ZODB.config
    from persistent.mapping import PersistentMapping
    from ZODB.Connection import TransactionMetaData

    handle = target.create(scratch, 'roundtrips')
    counter = Counter()
    uninstall = install(counter, implicit_begin=target.database == 'postgresql')
    try:
        text = '%%import relstorage\n%s' % target.storage_section(handle, '')
        db = ZODB.DB(ZODB.config.storageFromString(text))
        try:
            tm = transaction.TransactionManager()
            conn = db.open(tm)
            root = conn.root()
            result = {}

            def counted(key, change):
                tm.begin()
                change()
                counter.calls.clear()
                counter.rows = 0
                counter.active = True
                try:
                    tm.commit()
                finally:
                    counter.active = False
                result[key] = counter.snapshot()

            # A warm-up commit, so that the counts are those of a connection
            # in use (temporary tables made, statements prepared).
            counted('warmup', lambda: root.__setitem__('warmup', PersistentMapping()))
            del result['warmup']
            payload = b'x' * object_size
            items = []

            def add():
                for i in range(objects):
                    item = PersistentMapping(data=payload)
                    items.append(item)
                    root['item%d' % i] = item

            def update():
                for item in items:
                    item['data'] = payload + b'!'

            counted('add', add)
            counted('update', update)
            conn.close()
            # A commit that writes nothing (zodbshootout's tpc phase): ZODB
            # would not call the storage at all, so run its two-phase commit
            # directly, once to warm up and once counted.
            storage = db.storage
            for key in ('warmup', 'empty'):
                counter.calls.clear()
                counter.rows = 0
                counter.active = key == 'empty'
                try:
                    meta = TransactionMetaData()
                    storage.tpc_begin(meta)
                    storage.tpc_vote(meta)
                    storage.tpc_finish(meta)
                finally:
                    counter.active = False
            result['empty'] = counter.snapshot()
        finally:
            db.close()
    finally:
        uninstall()
        target.drop(handle)
    return result


def run(targets, scratch, objects, object_size, say):
    out = {}
    for target in targets:
        try:
            out[target.name] = measure(target, scratch, objects, object_size)
            say('round trips, %s: %s' % (target.name, ', '.join(
                '%s %d' % (k, v['total']) for k, v in out[target.name].items())))
        except Exception as e:  # pylint:disable=broad-except
            from .targets import safe_message
            out[target.name] = {'error': safe_message(e)}
            say('round trips, %s: failed: %s' % (target.name, out[target.name]['error']))
    return out

