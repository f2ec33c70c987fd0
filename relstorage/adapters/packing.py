"""The adapter verbs of a pack (storage/pack.py decides when to call them).

Everything that grows with the database stays in the database: references
in ``object_ref``, reachability in temporary tables expanded by
``INSERT ... SELECT`` joins, candidates in ``pack_object`` (see sql.py).
The client holds one batch of rows at a time.
"""
import logging
import re
import struct
import time

from ..interfaces import PermissionDeniedError
from ..interfaces import RelStorageError
from .connections import as_bytes
from ..messages import one_line as _one_line

log = logging.getLogger(__name__)

#: What a refusal to create a temporary table asks for (commits and packs
#: use them; MySQL's error names the database, not the privilege).
TEMP_TABLE_PRIVILEGE = ("the privilege to create temporary tables (PostgreSQL: TEMP "
                        "on the database; MySQL: CREATE TEMPORARY TABLES)")

#: Greater than every tid: "all revisions" as a ``below`` bound.
ALL_REVISIONS = (1 << 63) - 1

#: Revisions the pack's analysis reads in one snapshot (iter_revisions):
#: a fraction of a second of its work.
REVISIONS_PAGE = 20000
#: The first page's length in tids: a tenth of a second of commits (tids
#: count 2**32 a minute), which a bulk import may fill with thousands of
#: revisions; the next pages grow or shrink from there.
PAGE_FIRST_SPAN = (1 << 32) // 600
#: The longest page in tids (an hour): after a quiet stretch, the first
#: busy one is read in pages of this length at most.
PAGE_MAX_SPAN = 60 << 32


class PackRemovals:
    """What pack deletion batches removed, as pack_removed_list keeps it:
    ``garbage``, the 8-byte OIDs (big-endian, ZODB's own form) of objects
    removed entirely, end to end; ``trimmed``, 16 bytes per object whose
    older revisions went: its OID, then the tid below which they did.
    Every other process reads these lists at its next poll, as fast as
    the pack deletes: one value per batch, not a row per object (2,000 to
    3,000 rows a poll were a writer's main cost during a SQLite pack)."""

    __slots__ = ('garbage', 'trimmed')

    def __init__(self, garbage=b'', trimmed=b''):
        self.garbage = garbage
        self.trimmed = trimmed

    @classmethod
    def of(cls, removed, trimmed):
        """From OIDs (ints) removed and (oid, below) pairs trimmed."""
        flat = [value for pair in trimmed for value in pair]
        return cls(struct.pack('>%dQ' % len(removed), *removed),
                   struct.pack('>%dQ' % len(flat), *flat))

    @classmethod
    def joined(cls, lists):
        lists = list(lists)
        return cls(b''.join(g for g, _ in lists), b''.join(t for _, t in lists))

    def garbage_oids(self):
        """The OIDs removed entirely, as bytes."""
        g = self.garbage
        return [g[i:i + 8] for i in range(0, len(g), 8)]

    def garbage_ints(self):
        return struct.unpack('>%dQ' % (len(self.garbage) // 8), self.garbage)

    def trimmed_pairs(self):
        """(oid, below) of the objects trimmed."""
        flat = struct.unpack('>%dQ' % (len(self.trimmed) // 8), self.trimmed)
        return list(zip(flat[0::2], flat[1::2]))

    def __len__(self):
        return len(self.garbage) // 8 + len(self.trimmed) // 16


def next_step_size(size, seconds, target, low=50, high=20000):
    """The size of a pack's next step of work (rows), so that a step
    takes a quarter to a half of ``target`` seconds; the last one of
    ``size`` rows took ``seconds``."""
    if seconds > target / 2:
        return max(low, size // 2)
    if seconds < target / 4:
        return min(high, size * 2)
    return size


class PackLock:
    """The pack lock, held by a session of its own until ``close()``."""

    def __init__(self, raw, release=None):
        self._raw = raw
        self._release = release

    def close(self):
        if self._raw is not None:
            try:
                # Released explicitly: the server may notice a closed
                # session a moment after the next pack asks for the lock.
                if self._release:
                    cur = self._raw.cursor()
                    cur.execute(self._release)
                    cur.fetchall()
                    cur.close()
            except Exception:  # pylint:disable=broad-except
                pass
            finally:
                # (Closed even when interrupted: the lock lives with the
                # session, and a Ctrl-C there kept it, and every later pack
                # refused, as long as the traceback lived.)
                raw, self._raw = self._raw, None
                try:
                    raw.close()
                except Exception:  # pylint:disable=broad-except
                    pass


class PackVerbs:
    """Mixed into Adapter.  A vendor supplies ``pack_schema()``,
    ``pack_temp_tables()`` and, in its statements, ``TRY_PACK_LOCK``."""

    #: Whether the commit lock is the database's write lock (SQLite), so
    #: that a pack's deletions hold it from their first statement.
    #: Elsewhere a batch deletes first and takes the commit lock only to
    #: re-check the last commits and commit (storage/pack.py).
    pack_lock_is_write_lock = False
    #: Whether the pack's own tables (references, candidates, progress)
    #: are in a database file of their own (SQLite, whose commits hold
    #: the main file's single write lock), written without the lock
    #: commits wait for (begin_pack_write).  Every adapter keeps the
    #: pack's writes other than its deletions out of the commits' way.
    pack_tables_apart = False

    def pair_pack_tables(self, conn):
        """Called by each analysis once its snapshot is taken, before it
        records anything.  Where the pack's tables are in the database
        they describe, a restore carries them along: nothing to do (see
        the SQLite adapter, where they are not)."""

    def begin_pack_write(self, conn):
        """Begin a transaction that writes only the pack's own tables
        (references, candidates, pack_info): SQLite's are in a file of
        their own, whose lock no commit waits for."""
        self.begin_store_checked(conn)

    def pack_schema(self):
        """DDL creating the permanent pack tables if they are missing."""
        raise NotImplementedError

    def pack_temp_tables(self):
        """{name: DDL} of the pack's temporary work tables."""
        raise NotImplementedError

    # --- sessions -----------------------------------------------------------

    #: The connection purpose of the pack lock's session: 'store' where the
    #: lock is a row lock that lives as long as the session's transaction.
    pack_lock_purpose = 'oid'

    def prepare_pack_lock(self, raw):
        """Make what TRY_PACK_LOCK needs, on the lock's own session."""

    def acquire_pack_lock(self):
        """A PackLock, or None when another pack holds it.  The lock lives
        with a session, so a killed pack releases it.  TRY_PACK_LOCK
        answers a true first column, or false or no row when not had."""
        raw = self.connect(self.pack_lock_purpose)
        try:
            self.prepare_pack_lock(raw)
            cur = raw.cursor()
            cur.execute(self.sql.TRY_PACK_LOCK)
            row = cur.fetchone()
            cur.close()
        except BaseException:
            raw.close()
            raise
        if row is None or not row[0]:
            raw.close()
            return None
        return PackLock(raw, self.sql.RELEASE_PACK_LOCK)

    def open_pack(self):
        """A store connection with the pack tables (created on demand, so
        databases made before them get them) and its work tables.

        Only the missing tables are created: ``CREATE ... IF NOT EXISTS``
        still needs the privilege to create (PostgreSQL checks it, and
        the table's ownership for an index, before it sees the table;
        MySQL asks for CREATE), so an application user without it could
        never pack, even once the first pack had made every table (a
        helper agent's check)."""
        conn = self.open_store()
        try:
            existing = self.list_tables(conn)
            made = set()
            for stmt in self.pack_schema():
                table = _ddl_table(stmt)
                if table in existing and table not in made:
                    continue
                self._pack_ddl(conn, stmt, table)
                made.add(table)
            for name, stmt in self.pack_temp_tables().items():
                self._pack_ddl(conn, stmt, name, temporary=True)
            conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn

    def _pack_ddl(self, conn, stmt, table, temporary=False):
        try:
            conn.execute(stmt)
        except (self.driver.Error, PermissionDeniedError) as exc:
            # (Only a refusal: a lock wait or a deadlock is what it is.)
            refused = self.refusal(exc)
            if refused is None:
                raise
            if temporary:
                need = TEMP_TABLE_PRIVILEGE
            else:
                need = ("a user that may create tables (the schema's owner) for the first "
                        "pack, which makes the pack's tables; later packs need only "
                        "SELECT, INSERT, UPDATE and DELETE on them (on MySQL, a table "
                        "this user has no right on looks missing: grant them)")
            raise RelStorageError(
                "The pack cannot create its %stable %s at %s (%s): it needs %s."
                % ('work ' if temporary else '', table, self.describe(),
                   _one_line(refused), need)) from refused

    def clear_pack_temp(self, conn, name):
        conn.execute('DELETE FROM %s' % name)

    def _analyze_temp(self, conn, name):
        """Fresh planner statistics for table ``name``, where the vendor
        needs them (PACK_ANALYZE)."""
        stmt = getattr(self.sql, 'PACK_ANALYZE', None)
        if stmt:
            conn.execute(stmt.format(table=name))

    # --- progress kept in pack_info ---------------------------------------

    def pack_info(self, conn):
        return dict(conn.query_all(self.q(self.sql.PACK_INFO_GET)))

    def set_pack_info(self, conn, **values):
        upsert = self.sql.PACK_INFO_SET
        for name, value in values.items():
            if value is not None and upsert is not None:
                conn.execute(self.q(upsert), (name, value))
                continue
            conn.execute(self.q(self.sql.PACK_INFO_DELETE), (name,))
            if value is not None:
                conn.execute(self.q(self.sql.PACK_INFO_INSERT), (name, value))

    # --- references -----------------------------------------------------------

    def stream_query(self, conn, sql, params, batch=1000):
        """Yield the rows of ``sql`` without holding the whole result in
        client memory (vendors whose cursors buffer override this)."""
        conn.execute(sql, params)
        while True:
            rows = conn.cursor.fetchmany(batch)
            if not rows:
                break
            yield from rows

    def iter_revisions(self, conn, after_tid, upto_tid, kept_at=None, page=None):
        """(oid, tid, state) of every revision with after_tid < tid <=
        upto_tid, by tid, streamed from ``conn`` (a load connection in a
        snapshot, see begin_snapshot); with ``kept_at``
        (history-preserving), not those replaced by a revision of
        ``kept_at`` or before (PACK_REVISIONS_KEPT).

        Read in pages of whole tids (about ``page`` revisions,
        REVISIONS_PAGE by default; 0: all in the snapshot ``conn`` is in),
        each in a snapshot of its own on the same server.  One
        snapshot held for the whole analysis (minutes, at millions of
        objects) keeps the server from cleaning up after the site's
        commits meanwhile (PostgreSQL keeps every dead row version, InnoDB
        its undo log, SQLite cannot checkpoint its write-ahead log past
        the reader), and every commit of the site pays for that.  A
        revision of upto_tid or before does not change between pages;
        history-free, a commit after upto_tid may replace or delete it
        before its page is read, and it is then left out: what replaced it
        is newer than upto_tid."""
        if kept_at is not None and self.keep_history:
            stmt, extra = self.q(self.sql.PACK_REVISIONS_KEPT), (kept_at,)
        else:
            stmt, extra = self.q(self.sql.PACK_REVISIONS), ()
        if page is None:
            page = REVISIONS_PAGE
        # Pages are ranges of tids, sized from the last one's count (no
        # query finds where ``page`` revisions end: PostgreSQL would scan
        # and sort all the rest of the range to answer that).
        low = after_tid
        span = PAGE_FIRST_SPAN
        renew = False
        while low < upto_tid:
            if renew:
                self.renew_snapshot(conn, upto_tid)
            renew = True
            high = upto_tid
            if page:
                # Where the next revision is: a stretch of time without
                # commits costs no page.
                first = conn.query_value(self.q(self.sql.PACK_NEXT_TID), (low, upto_tid))
                if first is None:
                    return
                low = first - 1
                high = min(upto_tid, low + span)
            count = 0
            for row in self.stream_query(conn, stmt, (low, high) + extra):
                count += 1
                yield row
            if page:
                span = max(1, min(PAGE_MAX_SPAN,
                                  int(span * min(4.0, page / count if count else 4.0))))
            low = high

    def renew_snapshot(self, conn, upto_tid):
        """End the snapshot of ``conn`` and start another on the same
        server (not begin_snapshot's server chosen now: another replica
        may not have reached ``upto_tid`` yet); return its last tid."""
        conn.rollback()
        self.start_snapshot(conn)
        last = self.get_last_tid(conn)
        if last < upto_tid:
            raise RelStorageError(
                "%s went back in time during the pack's analysis: its last "
                "transaction is %x, the analysis had read up to %x."
                % (self.describe(), last, upto_tid))
        return last

    def count_revisions(self, conn, after_tid, upto_tid, kept_at=None):
        if kept_at is not None and self.keep_history:
            return conn.query_value(self.q(self.sql.PACK_COUNT_REVISIONS_KEPT),
                                    (after_tid, upto_tid, kept_at)) or 0
        return conn.query_value(self.q(self.sql.PACK_COUNT_REVISIONS_AFTER),
                                (after_tid, upto_tid)) or 0

    def pack_refs_tid(self, conn):
        """The tid up to which object_ref holds the references of every
        revision (0: none analysed).  Where object_ref can lose its rows
        on its own (PACK_REFS_MAY_VANISH), an empty object_ref with
        revisions said to be analysed means they were lost: everything is
        analysed again rather than a reachability computed without them
        (which would collect what they reached)."""
        info = self.pack_info(conn)
        done = info.get('refs_tid', 0)
        # (A helper agent's check: a database whose objects reference
        # nothing had its empty table taken for a lost one at every pack,
        # with a warning of a crash; the analysis now notes no_refs.)
        if done and self.sql.PACK_REFS_MAY_VANISH and not info.get('no_refs') and \
                not self.any_refs(conn):
            log.warning("The pack's recorded references in %s are gone (server crash "
                        "recovery or a promoted standby empties that table); "
                        "analysing every revision again.", self.describe())
            self.set_pack_info(conn, refs_tid=None, seed_base=None)
            return 0
        return done

    def any_refs(self, conn):
        """Whether object_ref holds a reference."""
        return conn.query_one(self.sql.PACK_ANY_REF) is not None

    def forget_refs_after(self, conn, tid):
        conn.execute(self.q(self.sql.PACK_REFS_FORGET_AFTER), (tid,))

    def add_refs(self, conn, oids, rows, seeds=False, fresh=False):
        """Record ``rows`` (zoid, tid, to_zoid) for the revisions of
        ``oids`` just analysed.  History-free, an object's earlier
        references go first: its new revision replaced the old one; with
        ``seeds``, where new garbage may be is recorded too (see
        record_seeds), and only the objects that had references are
        touched.  ``fresh``: object_ref held nothing when the analysis
        started (the first one), and history-free an analysis reads each
        object once: nothing to forget."""
        if not self.keep_history:
            if seeds:
                self.forget_refs_of(conn, sorted(self.record_seeds(conn, oids, rows)))
            elif not fresh:
                self.forget_refs_of(conn, sorted(oids))
        self.insert_refs(conn, rows)
        if self.sql.PACK_REFS_MAY_VANISH and (rows or fresh):
            # Whether object_ref is empty because nothing references
            # anything, not because it was lost (see pack_refs_tid).
            self.set_pack_info(conn, no_refs=None if rows or self.any_refs(conn) else 1)

    def record_seeds(self, conn, oids, rows):
        """Seeds of the next incremental reachability, from the new
        revisions of ``oids`` (references ``rows``) before their earlier
        references go: the targets of references a revision dropped (the
        only way an object that was reachable stops being so), objects
        without earlier references (new since the last analysis, or
        without any references: those add only themselves to the
        domain).  Returns the objects of ``oids`` that had references."""
        new = {}
        for zoid, _tid, to_zoid in rows:
            new.setdefault(zoid, set()).add(to_zoid)
        old = {}
        for zoid, to_zoid in self.refs_of(conn, oids):
            old.setdefault(zoid, set()).add(to_zoid)
        seeds = set()
        for oid in oids:
            refs = new.get(oid, ())
            before = old.get(oid)
            if not refs or not before:
                seeds.add(oid)
            if before:
                seeds.update(before.difference(refs))
        # The root is always reached (and in the domain, it would make the
        # reachability full).
        seeds.discard(0)
        self.add_seeds(conn, seeds)
        return old

    def add_seeds(self, conn, oids):
        """Add ``oids`` to pack_seed (one row each: the table has a key,
        which some servers require of every table)."""
        oids = sorted(oids)
        for stmt, params in self.oid_statements(self.sql.PACK_SEED_FORGET, oids):
            conn.execute(stmt, params)
        self._insert_values(conn, self.sql.PACK_SEED_INSERT, 1, [(o,) for o in oids])

    def refs_of(self, conn, oids):
        """(zoid, to_zoid) recorded for ``oids``."""
        result = []
        for stmt, params in self.oid_statements(self.sql.PACK_REFS_OF, sorted(oids)):
            result.extend(conn.query_all(stmt, params))
        return result

    def forget_refs_of(self, conn, oids):
        for stmt, params in self.oid_statements(self.sql.PACK_REFS_FORGET_OBJECTS, oids):
            conn.execute(stmt, params)

    def insert_refs(self, conn, rows):
        self._insert_values(conn, self.sql.PACK_REFS_INSERT, 3, rows)

    def _insert_values(self, conn, prefix, width, rows):
        """Multi-row INSERTs of ``rows`` (integers only).  With
        ``oid_lists_as_text`` the values are written into the text (see
        oid_statements): the analysis binds three per reference."""
        # (As text, no placeholder limit applies: max_in_list rows.)
        per_statement = (self.max_in_list if self.oid_lists_as_text
                         else max(1, (self.max_insert_values or self.max_in_list) // width))
        placeholders = '(' + ','.join(['%s'] * width) + ')'
        as_text = '(' + ','.join(['%d'] * width) + ')'
        for chunk in _chunks(rows, per_statement):
            if self.oid_lists_as_text:
                conn.execute(prefix + ','.join([as_text % tuple(r) for r in chunk]))
            else:
                conn.execute(self.q(prefix + ','.join([placeholders] * len(chunk))),
                             [value for r in chunk for value in r])

    # --- reachability -----------------------------------------------------------

    #: An incremental reachability gives up for a full one when its
    #: domain passes this share of the objects the last full one saw (or
    #: INCREMENTAL_MIN objects): the work left then costs about what a
    #: full one does.
    INCREMENTAL_SHARE = 1 / 3.0
    INCREMENTAL_MIN = 20000

    def compute_pack_candidates(self, conn, pack_tid, gc, snapshot_tid=None):
        """Fill pack_object with what a pack to ``pack_tid`` removes, from
        the references recorded so far (up to ``snapshot_tid``, the
        analysis's snapshot).  Returns (frontier steps, domain):
        domain is how many objects an incremental reachability examined,
        None when it examined them all.  Work happens in temporary tables;
        the writes to shared tables are short: pack_info and pack_seed at
        the start (_start_reachability), pack_object and pack_seed at the
        end.

        With GC, the reachability is incremental when the last pack with
        GC completed (pack_info ``seed_base``): new garbage
        can only be among what the seeds recorded since (pack_seed, see
        sql.py) reach, the domain; everything else is reached as it was
        then, through no reference that went.  Inside the domain, the
        reachability starts from the references that enter it from
        outside (the root is never in the domain: one that reaches it
        makes the reachability full) and from the objects of the domain
        changed after the pack time: the domain holds whatever its objects
        reference, so a path from the root to one of its objects enters it
        once, by one of those.  So what is found unreachable is
        unreachable whatever the seeds were; seeds that miss something
        only leave garbage for a full reachability.
        """
        sql = self.sql
        for name in self.pack_temp_tables():
            self.clear_pack_temp(conn, name)
        # The analysis may just have filled object_ref: without fresh
        # statistics the planner scans it whole for every join.
        self._analyze_temp(conn, 'object_ref')
        steps = 0
        domain = None
        seeded = gc
        base, seen, since = self._start_reachability(conn, seeded)
        if seeded:
            if base:
                limit = max(self.INCREMENTAL_MIN, int(seen * self.INCREMENTAL_SHARE))
                steps, domain = self._reach_in_domain(conn, pack_tid, since, limit)
                if domain is None:
                    log.info("The pack's incremental reachability of %s reached the "
                             "root or more than %d objects; computing it for every "
                             "object.", self.describe(), limit)
                    for name in self.pack_temp_tables():
                        self.clear_pack_temp(conn, name)
            if domain is None:
                more, objects = self._reach_all_in_two_stages(conn, pack_tid)
                steps += more
        else:
            conn.execute(self.q(sql.PACK_FILL_CURRENT), (pack_tid,))
            self._analyze_temp(conn, 'temp_pack_current')
        if gc:
            self._analyze_temp(conn, 'temp_pack_reach')
        conn.commit()
        self.begin_pack_write(conn)
        if seeded:
            # What the next pack must look at again (see _start_reachability).
            conn.execute(self.q(sql.PACK_SEED_SAVE))
            if domain is None:
                self.set_pack_info(conn, reach_objects=objects)
        conn.execute(self.q(sql.PACK_CLEAR_CANDIDATES))
        flag = 1 if gc else 0
        if self.keep_history:
            params = (flag, pack_tid, snapshot_tid or ALL_REVISIONS, flag)
        else:
            params = (flag,)
        large = domain is None and sql.PACK_LARGE_JOINS_BEGIN
        if large:
            conn.execute(sql.PACK_LARGE_JOINS_BEGIN)
        conn.execute(self.q(sql.PACK_CANDIDATES), params)
        if large:
            conn.execute(sql.PACK_LARGE_JOINS_END)
        # The deletion batches join ranges of it (merge joins on the keys
        # once the planner knows its size).
        self._analyze_temp(conn, 'pack_object')
        return steps, domain

    def _start_reachability(self, conn, seeded):
        """One short write transaction before the reachability.  The
        candidates of an earlier pre-pack stop counting (``prepared``):
        this one replaces them, and a pack stopped part way must leave
        nothing a later --use-prepack-state trusts.  With ``seeded``, the
        seeds move into temp_pack_dom when the pack with GC that consumed
        the previous ones completed (``seed_base``), and pack_seed is
        emptied either way.  Until this pack completes and sets
        ``seed_base`` again, packs compute the whole reachability: the
        garbage this one leaves if it stops is in no seed.
        History-preserving, a pack without GC makes the next one full: it
        removes the older revisions of every object, among them those
        the next one would compare with.  Returns (whether the seeds are
        usable, objects the last full reachability saw, pack time of the
        pack that made them usable)."""
        sql = self.sql
        conn.commit()
        # Only a pack writes these tables, and the pack lock is ours: the
        # seeds are copied before the write transaction, which on SQLite
        # holds the database's write lock (emptying a table is quick
        # there; copying a million rows is not).
        info = self.pack_info(conn)
        since = info.get('seed_tid', 0)
        # (History-preserving, the seeds are found from the base pack's
        # time on: it must be known.)
        base = seeded and bool(info.get('seed_base')) and (since or not self.keep_history)
        if base:
            conn.execute(self.q(sql.PACK_SEED_TAKE))
        conn.commit()
        self.begin_pack_write(conn)
        self.set_pack_info(conn, prepared=None, prepared_gc=None, deleted_upto=None)
        if not seeded and self.keep_history:
            self.set_pack_info(conn, seed_base=None)
        if seeded:
            conn.execute(self.q(sql.PACK_SEED_CLEAR))
            # From now on every analysis records seeds (add_refs).
            self.set_pack_info(conn, seed_base=None, seeds_armed=1)
        conn.commit()
        return base, info.get('reach_objects', 0), since

    def records_seeds(self, conn):
        """Whether an analysis records seeds for an incremental
        reachability (history-free, once the reachability of a pack with
        GC started)."""
        return not self.keep_history and bool(self.pack_info(conn).get('seeds_armed'))

    def seed_unreached(self, conn, oids):
        """Record as seeds those of ``oids`` (changed after the analysis)
        that this pack's reachability, still in the work tables, did not
        reach: a change made after PACK_LATE_ROOTS or PACK_LATE_DOM(_AT) ran
        keeps such an object out of the candidates, and no analysis seeds
        it again unless its references change."""
        if not oids:
            return
        for chunk in _chunks(sorted(oids), self.max_in_list):
            conn.execute(self.in_list(self.sql.PACK_SEED_UNREACHED, len(chunk)), chunk)

    def _reach_in_domain(self, conn, pack_tid, since, limit):
        """Reachability among what the seeds reach; (steps, size of the
        domain), or (steps, None) once the domain passes ``limit``.
        History-preserving, ``since`` is the pack time of the pack that
        made the seeds usable: the objects changed since add theirs."""
        sql = self.sql
        if self.keep_history:
            conn.execute(self.q(sql.PACK_FILL_CHANGED), (pack_tid, since, pack_tid))
            self._analyze_temp(conn, 'temp_pack_current')
            conn.execute(self.q(sql.PACK_SEED_DROPPED), (since,))
            conn.execute(self.q(sql.PACK_SEED_NEW), (since,))

        def reached_root():
            # The domain holds whatever its objects reference: with the
            # root, it holds every reachable object, and a full
            # reachability costs less (objects with references to their
            # parents lead there).
            return conn.query_one(self.q(sql.PACK_DOM_HAS_ROOT)) is not None

        conn.execute(self.q(sql.PACK_FRONTIER_FROM_DOM))
        if reached_root():
            return 0, None
        steps, added = self._expand(conn, sql.PACK_DOM_STEP, sql.PACK_DOM_FROM_NEXT,
                                    limit=limit - self._count(conn, 'temp_pack_dom'),
                                    stop=reached_root)
        if added is None:
            return steps, None
        self._analyze_temp(conn, 'temp_pack_dom')
        if self.keep_history:
            return steps + self._reach_in_domain_at(conn, pack_tid), \
                self._count(conn, 'temp_pack_dom')
        conn.execute(self.q(sql.PACK_FILL_CURRENT_DOM), (pack_tid,))
        # The domain's objects changed after the pack time are kept, and
        # are seeds of the next pack (whether or not any candidate is left).
        conn.execute(self.q(sql.PACK_LATE_DOM), (pack_tid,))
        if self._any(conn, 'temp_pack_current'):
            self._analyze_temp(conn, 'temp_pack_current')
            # First the references from outside the domain (the root is
            # outside: see reached_root) ...
            conn.execute(self.q(sql.PACK_DOM_ENTRIES))
            steps += self._expand(conn, sql.PACK_REACH_STEP_DOM)[0]
            # ... then what the late objects of the domain reference.
            conn.execute(self.q(sql.PACK_LATE_ENTRIES))
            steps += self._expand(conn, sql.PACK_REACH_STEP_DOM)[0]
        return steps, self._count(conn, 'temp_pack_dom')

    def _reach_in_domain_at(self, conn, pack_tid):
        """History-preserving part of _reach_in_domain: the objects
        changed since the base pack are in temp_pack_current; the domain
        is complete.  References count as of the pack time (those of each
        object's revision current then), and those of later revisions
        are followed in a second stage, as the full reachability does."""
        sql = self.sql
        conn.execute(self.q(sql.PACK_FILL_DOM), (pack_tid,))
        conn.execute(self.q(sql.PACK_REACH_OUTSIDE_DOM))
        self._analyze_temp(conn, 'temp_pack_current')
        self._analyze_temp(conn, 'temp_pack_reach')
        conn.execute(self.q(sql.PACK_DOM_ENTRIES_AT), (pack_tid, pack_tid))
        steps = self._expand(conn, sql.PACK_REACH_STEP)[0]
        conn.execute(self.q(sql.PACK_LATE_DOM_AT), (pack_tid,))
        conn.execute(self.q(sql.PACK_LATE_REFS), (pack_tid,))
        conn.execute(self.q(sql.PACK_NEXT_FROM_SEED))
        return steps + self._expand(conn, sql.PACK_REACH_STEP)[0]

    def _reach_all_in_two_stages(self, conn, pack_tid):
        """Reachability of every object: from the root, then from the
        objects changed after the pack time that the root does not reach
        (history-preserving, also from what their later revisions
        reference): those are kept, and are seeds of the next pack.
        Returns (steps, objects as of the pack time)."""
        sql = self.sql
        conn.execute(self.q(sql.PACK_FILL_CURRENT), (pack_tid,))
        objects = conn.cursor.rowcount
        if objects is None or objects < 0:
            objects = self._count(conn, 'temp_pack_current')
        self._analyze_temp(conn, 'temp_pack_current')
        conn.execute(self.q(sql.PACK_ROOT))
        steps = self._expand(conn, sql.PACK_REACH_STEP)[0]
        conn.execute(self.q(sql.PACK_LATE_ROOTS), (pack_tid,))
        if self.keep_history:
            conn.execute(self.q(sql.PACK_LATE_REFS), (pack_tid,))
        conn.execute(self.q(sql.PACK_NEXT_FROM_SEED))
        return steps + self._expand(conn, sql.PACK_REACH_STEP)[0], objects

    def _expand(self, conn, step, add=None, limit=None, stop=None):
        """Add temp_pack_next to the reached set (``add``: the statement
        doing so, PACK_REACH_ADD by default), follow it and the frontier
        by ``step`` (which reads temp_pack_frontier and writes
        temp_pack_next) until nothing new is found.  Returns (steps, rows
        added), rows None once they pass ``limit`` or ``stop()`` says so
        after a step.

        The two tables take turns: what a step found is the next step's
        frontier where it lies, and the statements are run with the names
        swapped every other step (copying a step's rows from one to the
        other cost a tenth of the reachability on MariaDB)."""
        sql = self.sql
        add = add or sql.PACK_REACH_ADD
        found_in, other = 'temp_pack_next', 'temp_pack_frontier'
        steps = added = 0
        while True:
            self._analyze_temp(conn, found_in)
            conn.execute(self._turn(add, found_in != 'temp_pack_next'))
            added += max(conn.cursor.rowcount, 0)
            if limit is not None and added > limit or steps and stop and stop():
                return steps, None
            if not steps:
                # A caller may have put a frontier of its own in
                # temp_pack_frontier: the first step follows it as well.
                conn.execute(self.q(sql.PACK_FRONTIER_FROM_NEXT))
                self.clear_pack_temp(conn, 'temp_pack_next')
                self._analyze_temp(conn, 'temp_pack_frontier')
                found_in, other = 'temp_pack_frontier', 'temp_pack_next'
            # The step reads found_in and writes other.
            conn.execute(self._turn(step, found_in == 'temp_pack_next'))
            found = conn.cursor.rowcount
            steps += 1
            self.clear_pack_temp(conn, found_in)
            if not found or found < 0 and not self._any(conn, other):
                return steps, added
            found_in, other = other, found_in

    def _turn(self, stmt, swapped):
        """``stmt`` (converted by q), with temp_pack_frontier and
        temp_pack_next swapped when ``swapped``."""
        if not swapped:
            return self.q(stmt)
        key = ('swapped', stmt)
        try:
            return self._q_cache[key]
        except KeyError:
            text = self.q(stmt).replace('temp_pack_frontier', '\0').replace(
                'temp_pack_next', 'temp_pack_frontier').replace('\0', 'temp_pack_next')
            self._q_cache[key] = text
            return text

    def _count(self, conn, name):
        return conn.query_value('SELECT COUNT(*) FROM %s' % name) or 0

    #: Seconds one write transaction of the pack may hold a single-writer
    #: database (every commit waits for all of it), as a share of
    #: pack-batch-timeout: 1.5 ms of deletions by default.  (5 ms made
    #: batches of about 7 ms with their commit, and the writer's p99 during
    #: a SQLite pack 13.5 ms; with 1.5 ms, 7.5-11 ms, for the same pack time.)
    PACK_WRITE_LOCK_SHARE = 1 / 667.0

    def writers_waiting(self):
        """Whether a write transaction waits for the write lock that a
        pack's deletion batch holds (where it is the commit lock:
        pack_lock_is_write_lock).  Without a way to know, yes: the pack
        then leaves every pause long enough for one."""
        return True

    def pack_write_lock_target(self):
        """How long one write of the pack should hold the commit lock."""
        timeout = float(getattr(self.options, 'pack_batch_timeout', 1.0) or 1.0)
        return timeout * (self.PACK_WRITE_LOCK_SHARE if self.pack_lock_is_write_lock else 1.0)

    def _any(self, conn, name):
        return conn.query_one('SELECT zoid FROM %s LIMIT 1' % name) is not None

    def pack_candidates_of(self, conn, oids):
        """(oid, keep_tid, garbage) of the analysis's candidates among
        ``oids`` (a --prepack's count of the blob files it would remove)."""
        rows = []
        for stmt, params in self.oid_statements(self.sql.PACK_CANDIDATES_OF, oids):
            rows.extend(conn.query_all(stmt, params))
        return rows

    def pack_candidate_stats(self, conn):
        """(objects, revisions, bytes, blob revisions) the candidates hold."""
        objects = conn.query_value(self.q(self.sql.PACK_COUNT_OBJECTS)) or 0
        revisions, size = conn.query_one(self.q(self.sql.PACK_COUNT_REVISIONS))
        blobs = 0
        if self.has_blob_chunk:
            blobs = conn.query_value(self.q(self.sql.PACK_COUNT_BLOBS)) or 0
        return objects, revisions or 0, int(size or 0), blobs

    # --- re-checking against later commits ------------------------------------

    def new_revisions(self, conn, after_tid, upto_tid):
        return conn.query_all(self.q(self.sql.PACK_NEW_REVISIONS), (after_tid, upto_tid))

    def rescue_candidates(self, conn, after_tid, referenced):
        """Keep the candidates changed after ``after_tid`` or in
        ``referenced`` (OIDs new revisions reference), and every candidate
        they reach through other candidates.  Returns how many were kept."""
        sql = self.sql
        self.clear_pack_temp(conn, 'temp_pack_frontier')
        self.clear_pack_temp(conn, 'temp_pack_next')
        conn.execute(self.q(sql.PACK_RESCUE_CHANGED), (after_tid,))
        if referenced:
            self._insert_values(conn, sql.PACK_NEXT_INSERT, 1, [(o,) for o in sorted(referenced)])
            conn.execute(self.q(sql.PACK_RESCUE_REFERENCED))
        kept = 0
        while True:
            # The next pack looks at them again.
            conn.execute(self.q(sql.PACK_SEED_RESCUED))
            conn.execute(self.q(sql.PACK_UNMARK))
            count = conn.cursor.rowcount
            kept += max(count, 0)
            if not count:
                break
            self.clear_pack_temp(conn, 'temp_pack_next')
            conn.execute(self.q(sql.PACK_RESCUE_STEP))
            if not conn.cursor.rowcount:
                break
            self.clear_pack_temp(conn, 'temp_pack_frontier')
            conn.execute(self.q(sql.PACK_FRONTIER_FROM_NEXT))
        return kept

    # --- deletion -----------------------------------------------------------

    def prepare_pack_deletion(self, conn, gc=True):
        """Before the deletion's first batch: the references between
        garbage candidates, by the object referenced (temp_pack_edges),
        from which each batch finds what must go with it
        (prepare_pack_batch).  Returns how many there are.  Without GC
        (``gc`` false) the only garbage is objects whose creation was
        undone, which reference nothing."""
        count = 0
        # (Where a batch holds the commit lock for all of its deletions:
        # see prepare_pack_batch.)
        conn.session_settings['pack_blob_budget'] = (
            self.pack_lock_is_write_lock and self.any_blob_chunk(conn))
        if gc:
            self.clear_pack_temp(conn, 'temp_pack_edges')
            conn.execute(self.q(self.sql.PACK_EDGES_FILL))
            count = self._count(conn, 'temp_pack_edges')
        if count:
            self._analyze_temp(conn, 'temp_pack_edges')
        conn.session_settings['pack_edges'] = count
        return count

    def delete_pack_batch(self, conn, after_oid, limit):
        """Delete the next ``limit`` candidates after ``after_oid`` and
        what must go with them (see prepare_pack_batch; the batch moves
        the pack mark on later, under the commit lock: see
        new_removal_mark).

        Returns (rows, extra, revisions, objects, blobs): rows are (oid,
        below, garbage) of the batch, empty when nothing is left; extra
        the OIDs that went with them."""
        # (The blob budget applies where a batch holds the commit lock, not
        # here: a batch ends with its last candidate.)
        rows, extra, _last = self.prepare_pack_batch(conn, after_oid, limit)
        if not rows:
            return rows, extra, 0, 0, 0
        return (rows, extra) + self.delete_prepared_batch(conn, extra)

    def prepare_pack_batch(self, conn, after_oid, limit):
        """Choose the next ``limit`` candidates after ``after_oid`` (into
        temp_pack_batch) and what must go with them (into
        temp_pack_extra); return (rows, extra, last): the rows (oid, below,
        garbage) of the candidates, the OIDs of the others, and the OID
        the batch reaches (the next one goes on after it).  It reads
        only the pack's tables, so a single-writer database runs it
        before taking the commit lock for delete_prepared_batch.

        What must go with a batch: every garbage candidate after it that
        references garbage of the batch, directly or through other such
        candidates.  Each batch is so upward-closed: once an object is
        removed, no garbage candidate that led to it is left.  A commit
        that links such a candidate again during the deletion (an
        application held it, or read it in a snapshot from before its
        last link went) is then either refused, the candidate being
        gone (Commit._check_not_removed), or keeps it with everything it
        reaches (rescue_candidates): never the candidate without the
        objects an earlier batch removed under it (a candidate with a
        higher OID than its child went in a later batch: a helper
        agent's check found it kept, its child gone).  Candidates before
        the batch are gone or rescued already, and those of the batch's
        range are in it: only those after it are looked for (through
        temp_pack_edges, made by prepare_pack_deletion)."""
        self.clear_pack_temp(conn, 'temp_pack_batch')
        conn.execute(self.q(self.sql.PACK_FILL_BATCH), (ALL_REVISIONS, after_oid, limit))
        partial = None
        if conn.session_settings.get('pack_blob_budget'):
            partial = self._within_blob_budget(conn)
        self._analyze_temp(conn, 'temp_pack_batch')
        rows = conn.query_all(self.q(self.sql.PACK_BATCH_ROWS))
        extra = self._upward_closure(conn, rows[-1][0]) if rows else []
        last = rows[-1][0] if rows else after_oid
        if partial is not None:
            # Its other revisions go with the next batch.
            last = partial - 1
        return rows, extra, last

    #: The most bytes of blob chunks one batch removes where a batch holds
    #: the commit lock for all of its deletions (SQLite): the batches are
    #: sized by the time the last one took, and a batch of objects with
    #: large blobs took seconds (a helper agent's check: 4.5 s for five
    #: 300 MB revisions; 1.5 GB of chunks is 375,000 pages to free).  A
    #: batch keeps its candidates up to the one that passes it (at least
    #: one: an object whose removed revisions alone hold more takes that
    #: long).  Its statements are the vendor's (SQLite's sql.py).
    PACK_BATCH_BLOB_BUDGET = 8 << 20

    def _within_blob_budget(self, conn):
        """Cut the batch in temp_pack_batch before the candidate whose
        blob chunks pass PACK_BATCH_BLOB_BUDGET.  When that is the first
        one, the batch is that candidate alone, and (history-preserving)
        only its oldest revisions whose chunks fit in (one at least): it
        keeps its newer ones, its current one above all, which a commit
        since the analysis may have linked again; returns its OID then
        (the next batch takes it again), else None."""
        total = 0
        rows = conn.query_all(self.q(self.sql.PACK_BATCH_BLOB_BYTES))
        for zoid, nbytes in rows:
            total += nbytes or 0
            if total <= self.PACK_BATCH_BLOB_BUDGET:
                continue
            first = conn.query_value(self.q(self.sql.PACK_BATCH_FIRST))
            if zoid != first:
                conn.execute(self.q(self.sql.PACK_BATCH_CUT_BEFORE), (zoid,))
                return None
            conn.execute(self.q(self.sql.PACK_BATCH_CUT), (zoid,))
            if not self.keep_history:
                return None
            return self._oldest_revisions_only(conn, zoid)
        return None

    def _oldest_revisions_only(self, conn, zoid):
        below = conn.query_value(self.q(self.sql.PACK_BATCH_BELOW), (zoid,))
        total = 0
        revisions = conn.query_all(self.q(self.sql.PACK_BLOB_BYTES_BY_REVISION), (zoid, below))
        for index, (tid, nbytes) in enumerate(revisions):
            total += nbytes or 0
            if total > self.PACK_BATCH_BLOB_BUDGET and index:
                # Revisions below this one go; this one and what follows
                # stay for the next batches.  Not as garbage: the object
                # stays (its removal is for the batch of its last revisions).
                conn.execute(self.q(self.sql.PACK_BATCH_LOWER), (tid, zoid))
                return zoid
        return None

    def _upward_closure(self, conn, last_oid):
        """The OIDs of the garbage candidates after ``last_oid`` that
        lead to garbage of the batch, into temp_pack_extra."""
        sql = self.sql
        if not conn.session_settings.get('pack_edges'):
            # (No garbage references other garbage, or no GC: nothing to
            # do per batch.)
            return []
        # (Emptied every time: a rollback may have brought back rows.)
        self.clear_pack_temp(conn, 'temp_pack_extra')
        self.clear_pack_temp(conn, 'temp_pack_next')
        # Those that reference the batch, by the batch's range of OIDs;
        # usually none.
        conn.execute(self.q(sql.PACK_EXTRA_FIRST), (last_oid,))
        if not self._found(conn, 'temp_pack_next'):
            return []
        if sql.PACK_EXTRA_CLOSURE:
            # Then all that leads to them, in one recursive statement: a
            # chain of garbage that references older garbage is as deep as
            # it is long (a step per level took 1.7 ms on PostgreSQL, 5 s
            # for a 3,000-object chain).
            self._analyze_temp(conn, 'temp_pack_next')
            for stmt in sql.PACK_CLOSURE_BEGIN:
                conn.execute(stmt)
            conn.execute(self.q(sql.PACK_EXTRA_CLOSURE), (last_oid,))
            # (After an error, the transaction's rollback undoes them.)
            for stmt in sql.PACK_CLOSURE_END:
                conn.execute(stmt)
        else:
            while True:
                conn.execute(self.q(sql.PACK_EXTRA_ADD))
                self.clear_pack_temp(conn, 'temp_pack_frontier')
                conn.execute(self.q(sql.PACK_FRONTIER_FROM_NEXT))
                self.clear_pack_temp(conn, 'temp_pack_next')
                conn.execute(self.q(sql.PACK_EXTRA_STEP), (last_oid,))
                if not self._found(conn, 'temp_pack_next'):
                    break
        self._analyze_temp(conn, 'temp_pack_extra')
        return [oid for (oid,) in conn.query_all(self.q(sql.PACK_EXTRA_ROWS))]

    def _found(self, conn, name):
        """Whether the INSERT just run into table ``name`` added rows."""
        found = conn.cursor.rowcount
        return bool(found) and (found > 0 or self._any(conn, name))

    def delete_prepared_batch(self, conn, extra=()):
        """Delete what prepare_pack_batch chose (with ``extra``, what it
        returned as such, the objects that go with it); returns
        (revisions, objects, blobs)."""
        sql = self.sql
        counts = self._delete_rows(conn, sql.PACK_BATCH_BLOBS, sql.PACK_DELETE_BLOBS,
                                   sql.PACK_DELETE_STATES, sql.PACK_DELETE_CURRENT,
                                   sql.PACK_DELETE_REFS)
        if extra:
            # (Blob records reference nothing, so none is taken along: their
            # rows are deleted all the same should one be.)
            more = self._delete_rows(conn, sql.PACK_EXTRA_BLOBS, sql.PACK_EXTRA_DELETE_BLOBS,
                                     sql.PACK_EXTRA_DELETE_STATES,
                                     sql.PACK_EXTRA_DELETE_CURRENT, sql.PACK_EXTRA_DELETE_REFS)
            counts = tuple(a + b for a, b in zip(counts, more))
        return counts

    def _delete_rows(self, conn, count_blobs, blobs, states, current, refs):
        """Run one set of deletion statements (of the batch, or of what
        goes with it); returns (revisions, objects, blobs)."""
        blob_count = 0
        if self.has_blob_chunk:
            blob_count = conn.query_value(self.q(count_blobs)) or 0
            conn.execute(self.q(blobs))
        conn.execute(self.q(states))
        revisions = objects = max(conn.cursor.rowcount, 0)
        if self.keep_history:
            conn.execute(self.q(current))
            objects = max(conn.cursor.rowcount, 0)
        if not self.pack_tables_apart:
            # (The batch's candidates stay: see PACK_CLEAR_DONE.)
            conn.execute(self.q(refs))
        return revisions, objects, blob_count

    #: Seconds between two removals, from the pack's tables where they are
    #: apart, of the references and candidates of what the deletion
    #: batches removed (each first waits for those batches to be on disk).
    FORGET_EVERY = 0.05

    def forget_deleted(self, conn, upto_oid, final=False):
        """After a deletion batch committed, where the pack's tables are
        apart (pack_tables_apart): every FORGET_EVERY seconds, and when
        ``final`` (the deletion is over), remove the references and
        candidates of what the batches removed, the candidates up to
        ``upto_oid`` (batches go by OID), in a write of those tables only
        (no commit waits for it), once those batches are on disk
        (sync_deleted).  Should the pack stop before, they stay: rows
        about objects and revisions that no longer exist, which no join
        of a pack follows (OIDs are never reused, and revisions are joined
        by their tid).  Elsewhere each batch removed the references, and
        the candidates all go when ``final``.  Returns whether it removed
        them this time."""
        if not self.pack_tables_apart:
            if not final:
                return False
            self.begin_pack_write(conn)
            conn.execute(self.q(self.sql.PACK_CLEAR_DONE))
            conn.commit()
            return True
        settings = conn.session_settings
        now = time.monotonic()
        if not final and now - settings.setdefault('forgotten', now) < self.FORGET_EVERY:
            return False
        after = settings.get('forgotten_upto', -1)
        if upto_oid is None or upto_oid <= after:
            return False
        # Else a power cut could undo the batches and not this: their
        # objects back, their references gone, and what those reference
        # free for a later pack to remove.
        self.sync_deleted(conn)
        self.begin_pack_write(conn)
        conn.execute(self.q(self.sql.PACK_DONE_REFS), (after, upto_oid, ALL_REVISIONS))
        conn.execute(self.q(self.sql.PACK_DONE_OBJECTS), (after, upto_oid))
        conn.commit()
        settings['forgotten'] = time.monotonic()
        settings['forgotten_upto'] = upto_oid
        return True

    def sync_deleted(self, conn):
        """Wait until the deletion batches committed so far are on disk
        (where they may commit without waiting for it)."""
        sync = self.deleted_sync(conn)
        if sync is not None:
            sync()

    def deleted_sync(self, conn):
        """sync_deleted as a function of no argument that does not use
        ``conn`` (another thread may call it), or None."""
        return None

    # --- what other processes drop from their caches ---------------------

    def new_removal_mark(self, conn):
        """Move the pack mark on for a deletion batch (in its transaction,
        which holds the commit lock); returns it.  The batch then lists
        what it removed under it (log_pack_removals), in the same
        transaction.  Under the lock, not before the deletions: a commit
        reads the mark once it holds the lock (advance_tid) and, where that
        read is a locking one (MySQL), would otherwise wait for a whole
        batch's deletions."""
        return self.bump_pack_mark(conn)

    def log_pack_removals(self, conn, mark, removed, trimmed):
        """List, under the deletion batch's ``mark``, the OIDs it removed
        and the (oid, below) of the objects it trimmed (in its
        transaction: whoever sees the deletions sees the list)."""
        lists = PackRemovals.of(removed, trimmed)
        conn.execute(self.q(self.sql.PACK_REMOVED_LOG),
                     (mark, self.binary(lists.garbage), self.binary(lists.trimmed)))

    def clear_pack_removals(self, conn):
        """Forget the removal lists of earlier packs (a process that did
        not read them yet drops its whole cache instead)."""
        conn.execute(self.q(self.sql.PACK_REMOVED_CLEAR))
        if 'pack_removed' in self.list_tables(conn):
            # Where development builds of 5.0 listed a row per object;
            # emptied, not dropped: their processes may still read it
            # (they find no list, and drop their whole cache).
            conn.execute('DELETE FROM pack_removed')

    _pack_removed_exists = False

    def pack_removals(self, conn, after_mark, upto_mark):
        """What the deletion batches with marks in (after_mark, upto_mark]
        removed (PackRemovals), as the snapshot of ``conn`` shows them.
        None when some mark of the range has no list (zap_all, a list
        already emptied, or a batch of a development build of 5.0,
        which listed elsewhere): anything may be gone."""
        if upto_mark <= after_mark:
            return PackRemovals()
        if not self._pack_removed_exists:
            # Asked only when the mark moved; the first pack creates the
            # table, and zap_all moves the mark without it.
            if 'pack_removed_list' not in self.list_tables(conn):
                return None
            self._pack_removed_exists = True
        rows = conn.query_all(self.q(self.sql.PACK_REMOVED_GET), (after_mark, upto_mark))
        if len(rows) != upto_mark - after_mark:
            return None
        return PackRemovals.joined((as_bytes(g) or b'', as_bytes(t) or b'') for g, t in rows)

    def any_garbage_candidate(self, conn, oids, after_oid=-1):
        """Is one of ``oids`` still a garbage candidate of the pack, among
        those after ``after_oid`` (the batches went through the others)?"""
        for chunk in _chunks(sorted(oids), self.max_in_list):
            if conn.query_all(self.in_list(self.sql.PACK_ANY_GARBAGE, len(chunk)),
                              (after_oid,) + tuple(chunk)):
                return True
        return False

    def mark_packed(self, conn, pack_tid):
        """History-preserving, as the deletion starts: transactions up to
        the pack time can no longer be undone.  Their older revisions are
        about to go: an undo during the deletion found some of them gone
        and committed an empty transaction, or part of the undo (a helper
        agent's check); it is now refused as packed away, as after the
        pack.  (An undo that read them before still has them all.)"""
        if self.keep_history:
            conn.execute(self.q(self.sql.PACK_MARK_PACKED), (True, pack_tid, True))

    def finish_pack(self, conn, pack_tid):
        """History-preserving: transactions up to the pack time (which
        mark_packed made packed) that are left without any state go."""
        if self.sql.PACK_REFS_MAY_VANISH:
            # The batches removed the references of what they removed:
            # perhaps all of them (see pack_refs_tid).
            self.set_pack_info(conn, no_refs=None if self.any_refs(conn) else 1)
        if self.keep_history:
            conn.execute(self.q(self.sql.DELETE_TRANSACTIONS_WITHOUT_STATES), (pack_tid, True))
            return max(conn.cursor.rowcount, 0)
        return 0

    def missing_references(self, conn):
        """(oid, tid, missing oid) of references from current revisions to
        objects that do not exist."""
        return conn.query_all(self.q(self.sql.PACK_MISSING_REFERENCES))


def _chunks(seq, size):
    seq = list(seq)
    for i in range(0, len(seq), size):
        yield seq[i:i + size]


def _ddl_table(stmt):
    """The table a pack schema statement creates, or indexes."""
    if re.match(r'\s*CREATE\s+(UNIQUE\s+)?INDEX', stmt, re.I):
        found = re.search(r'\bON\s+(\w+)', stmt)
    else:
        found = re.search(r'TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)', stmt, re.I)
    return found.group(1).lower() if found else None
