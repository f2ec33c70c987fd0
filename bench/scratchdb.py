"""Scratch databases for the stand-alone benchmark scripts (contention.py,
write_ab.py): open a storage on one, create it fresh, drop it.

``spec`` is a dict: ``db`` ('sqlite', 'postgresql' or 'mysql'), ``where``
(a directory for SQLite, a database name on the local test servers) and
``keep_history``.
"""
import json
import os
import shutil
import subprocess
import sys


def open_storage(spec):
    from relstorage.options import Options
    from relstorage.storage import RelStorage
    options = Options(keep_history=spec['keep_history'], commit_lock_timeout=30)
    db = spec['db']
    if db == 'sqlite':
        from relstorage.adapters.sqlite.adapter import Sqlite3Adapter
        adapter = Sqlite3Adapter(data_dir=spec['where'], options=options)
    elif db == 'postgresql':
        from relstorage.adapters.postgresql.adapter import PostgreSQLAdapter
        adapter = PostgreSQLAdapter(dsn='host=127.0.0.1 user=postgres dbname=%s' % spec['where'],
                                    options=options)
    else:
        from relstorage.adapters.mysql.adapter import MySQLAdapter
        adapter = MySQLAdapter(options=options, host='127.0.0.1', user='root', passwd='',
                               db=spec['where'])
    return RelStorage(adapter, options=options)


def _server_sql(db, statement):
    if db == 'postgresql':
        import psycopg
        with psycopg.connect('host=127.0.0.1 user=postgres dbname=postgres',
                             autocommit=True) as conn:
            conn.execute(statement)
    else:
        import MySQLdb
        conn = MySQLdb.connect(host='127.0.0.1', user='root', passwd='')
        try:
            conn.cursor().execute(statement)
        finally:
            conn.close()


def fresh(db, where):
    """An empty database (or directory) ``where``."""
    if db == 'sqlite':
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where)
        return
    _server_sql(db, 'DROP DATABASE IF EXISTS %s' % where)
    _server_sql(db, 'CREATE DATABASE %s' % where)


def drop(db, where):
    if db == 'sqlite':
        shutil.rmtree(where, ignore_errors=True)
    else:
        _server_sql(db, 'DROP DATABASE IF EXISTS %s' % where)


def run_in_tree(tree, script, spec, here):
    """Run ``script`` (``python -c``, argv: ``spec`` as JSON and ``here``,
    this directory) with ``tree`` on the path, from a neutral directory;
    return the JSON it prints, after checking that it imported that tree's
    relstorage (its ``relstorage`` key)."""
    out = subprocess.run([sys.executable, '-c', script, json.dumps(spec), here],
                         env=dict(os.environ, PYTHONPATH=tree), capture_output=True,
                         check=True, cwd='/tmp').stdout
    result = json.loads(out)
    if not result['relstorage'].startswith(tree):
        raise SystemExit('%s ran %s' % (tree, result['relstorage']))
    return result
