"""Figures of the incumbent, RelStorage 4.3, measured on machines of the
same kind as ours with the same zodbshootout settings (ms per 1000 objects,
one process, history-free unless marked), and our targets relative to
them."""

INCUMBENT = 'RelStorage 4.3'
#: The object count the incumbent's phase figures were taken with.
OBJECTS = 1000

#: Phase targets: this many times faster than the incumbent.
PHASE_SPEEDUP = 1.3
#: Conversion target: this many times the incumbent's records/s.
CONVERT_SPEEDUP = 2.0

#: (database, history mode) -> {phase: ms}; the driver each was taken with.
PHASES = {
    ('postgresql', 'history-free'): dict(
        add=60, update=74, cold=115, prefetch_cold=29, warm=232,
        readCurrent=29, new_oid=17, conflicts=44),
    ('postgresql', 'history-preserving'): dict(add=121, update=114, cold=198),
    ('mysql', 'history-free'): dict(
        add=71, update=88, cold=108, prefetch_cold=23, warm=184,
        readCurrent=760, new_oid=8, conflicts=44),
    ('sqlite', 'history-free'): dict(
        add=37, update=32, cold=24, prefetch_cold=18, warm=60,
        readCurrent=4.3, new_oid=2.8, conflicts=18),
}
DRIVERS = {'postgresql': 'psycopg2', 'mysql': 'mysqlclient',
           'sqlite': 'sqlite3'}

#: (database, history mode) -> records/s of zodbconvert.
CONVERT = {
    ('postgresql', 'history-free'): 14000,
    ('postgresql', 'history-preserving'): 5400,
    ('mysql', 'history-free'): 14000,
    ('sqlite', 'history-free'): 30000,
}

DATABASE_LABELS = {'postgresql': 'PostgreSQL', 'mysql': 'MariaDB',
                   'sqlite': 'SQLite'}


def phase_reference(database, mode, phase):
    return PHASES.get((database, mode), {}).get(phase)


def phase_target(database, mode, phase):
    ref = phase_reference(database, mode, phase)
    return None if ref is None else ref / PHASE_SPEEDUP


def convert_reference(database, mode):
    return CONVERT.get((database, mode))
