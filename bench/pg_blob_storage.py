"""PostgreSQL: large objects versus chunked bytea for blob bytes.

    .venv/bin/python -m bench.pg_blob_storage [--mb 256] [--chunk-mb 1]

Writes and reads the same data both ways with psycopg2 in a scratch
database (relstoragebench_blobs, dropped afterwards) and prints MB/s and
the client's peak RSS.  The result and the choice it led to are in
docs/design.rst ("Blobs").
"""
import argparse
import os
import resource
import time

import psycopg2

DSN = os.environ.get('RS_PG_DSN', 'host=127.0.0.1 user=postgres')
DB = 'relstoragebench_blobs'


def admin(sql):
    conn = psycopg2.connect(DSN + ' dbname=postgres')
    conn.autocommit = True
    conn.cursor().execute(sql)
    conn.close()


def bytea_round_trip(conn, data_chunks):
    cur = conn.cursor()
    cur.execute("CREATE TABLE chunks (zoid BIGINT, tid BIGINT, num INT, chunk BYTEA, "
                "PRIMARY KEY (zoid, tid, num))")
    conn.commit()
    t0 = time.time()
    for num, chunk in enumerate(data_chunks()):
        cur.execute("INSERT INTO chunks VALUES (1, 1, %s, %s)", (num, psycopg2.Binary(chunk)))
    conn.commit()
    write = time.time() - t0
    t0 = time.time()
    cur.execute("SELECT COUNT(*) FROM chunks WHERE zoid = 1 AND tid = 1")
    count = cur.fetchone()[0]
    size = 0
    for num in range(count):
        cur.execute("SELECT chunk FROM chunks WHERE zoid = 1 AND tid = 1 AND num = %s", (num,))
        size += len(cur.fetchone()[0])
    conn.commit()
    return write, time.time() - t0, size


def bytea_binary_round_trip(data_chunks):
    """The same with psycopg 3, which sends bytea as binary parameters."""
    import psycopg
    conn = psycopg.connect(DSN + ' dbname=' + DB)
    cur = conn.cursor()
    cur.execute("CREATE TABLE chunks3 (zoid BIGINT, tid BIGINT, num INT, chunk BYTEA, "
                "PRIMARY KEY (zoid, tid, num))")
    conn.commit()
    t0 = time.time()
    for num, chunk in enumerate(data_chunks()):
        cur.execute("INSERT INTO chunks3 VALUES (1, 1, %s, %b)", (num, chunk))
    conn.commit()
    write = time.time() - t0
    t0 = time.time()
    cur.execute("SELECT COUNT(*) FROM chunks3")
    count = cur.fetchone()[0]
    size = 0
    for num in range(count):
        cur.execute("SELECT chunk FROM chunks3 WHERE zoid = 1 AND tid = 1 AND num = %s",
                    (num,), binary=True)
        size += len(cur.fetchone()[0])
    conn.commit()
    conn.close()
    return write, time.time() - t0, size


def lobject_round_trip(conn, data_chunks, chunk_size):
    t0 = time.time()
    lob = conn.lobject(0, 'wb')
    loid = lob.oid
    for chunk in data_chunks():
        lob.write(chunk)
    lob.close()
    conn.commit()
    write = time.time() - t0
    t0 = time.time()
    lob = conn.lobject(loid, 'rb')
    size = 0
    while True:
        data = lob.read(chunk_size)
        if not data:
            break
        size += len(data)
    lob.close()
    conn.commit()
    return write, time.time() - t0, size


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--mb', type=int, default=256)
    parser.add_argument('--chunk-mb', type=int, default=1)
    args = parser.parse_args()
    chunk_size = args.chunk_mb << 20
    block = os.urandom(chunk_size)

    def data_chunks():
        for i in range(args.mb // args.chunk_mb):
            yield i.to_bytes(8, 'big') + block[8:]

    admin('DROP DATABASE IF EXISTS %s' % DB)
    admin('CREATE DATABASE %s' % DB)
    try:
        conn = psycopg2.connect(DSN + ' dbname=' + DB)
        for name, func in (('chunked bytea', lambda: bytea_round_trip(conn, data_chunks)),
                           ('bytea, binary', lambda: bytea_binary_round_trip(data_chunks)),
                           ('large object', lambda: lobject_round_trip(conn, data_chunks,
                                                                       chunk_size))):
            write, read, size = func()
            assert size == args.mb << 20, (name, size)
            print('%-15s write %6.1f MB/s  read %6.1f MB/s  (%d MB, chunks of %d MB)'
                  % (name, args.mb / write, args.mb / read, args.mb, args.chunk_mb))
        conn.close()
        print('peak client RSS: %d MB'
              % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024))
    finally:
        admin('DROP DATABASE IF EXISTS %s' % DB)


if __name__ == '__main__':
    main()
