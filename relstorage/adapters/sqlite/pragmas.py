"""The PRAGMA settings SQLite documents, to check ``<pragmas>`` early.

A misspelt pragma is silently ignored by SQLite, and many take any word
as a value, so a typo in a configuration file would change nothing without
a word. Each name here maps to what its value may be: ``BOOL`` (1/0, on/off,
yes/no, true/false), ``INT`` (a signed integer), ``TEXT`` (a quoted string)
or a tuple of the keywords (and numbers) SQLite accepts. Only pragmas that
set something are listed; queries and actions (``integrity_check``,
``optimize``, ...) make no sense applied to every connection.
"""
import difflib
import re

BOOL = 'a boolean (on, off, true, false, yes, no, 1, 0)'
INT = 'an integer'
TEXT = 'a string'

_BOOL_WORDS = ('on', 'off', 'true', 'false', 'yes', 'no', '1', '0')
_ON_WORDS = ('on', 'true', 'yes', '1')

PRAGMAS = {
    'analysis_limit': INT,
    'application_id': INT,
    'auto_vacuum': ('none', 'full', 'incremental', '0', '1', '2'),
    'automatic_index': BOOL,
    'busy_timeout': INT,
    'cache_size': INT,
    'cache_spill': (BOOL, INT),
    'case_sensitive_like': BOOL,
    'cell_size_check': BOOL,
    'checkpoint_fullfsync': BOOL,
    'count_changes': BOOL,
    'default_cache_size': INT,
    'defer_foreign_keys': BOOL,
    'empty_result_callbacks': BOOL,
    'encoding': ('utf-8', 'utf-16', 'utf-16le', 'utf-16be'),
    'foreign_keys': BOOL,
    'full_column_names': BOOL,
    'fullfsync': BOOL,
    'hard_heap_limit': INT,
    'ignore_check_constraints': BOOL,
    'journal_mode': ('delete', 'truncate', 'persist', 'memory', 'wal', 'off'),
    'journal_size_limit': INT,
    'legacy_alter_table': BOOL,
    'locking_mode': ('normal', 'exclusive'),
    'max_page_count': INT,
    'mmap_size': INT,
    'page_size': INT,
    'query_only': BOOL,
    'read_uncommitted': BOOL,
    'recursive_triggers': BOOL,
    'reverse_unordered_selects': BOOL,
    'secure_delete': (BOOL, 'fast'),
    'short_column_names': BOOL,
    'soft_heap_limit': INT,
    'synchronous': ('off', 'normal', 'full', 'extra', '0', '1', '2', '3'),
    'temp_store': ('default', 'file', 'memory', '0', '1', '2'),
    'temp_store_directory': TEXT,
    'threads': INT,
    'trusted_schema': BOOL,
    'user_version': INT,
    'wal_autocheckpoint': INT,
    'writable_schema': (BOOL, 'reset'),
}

# Values written quoted in the PRAGMA statement.
_QUOTED = ('encoding',)

# Settings the storage cannot work with, whatever SQLite accepts: name ->
# (the values it needs, why).  A ZODB connection reads in a snapshot that
# stays open while other connections commit; only write-ahead logging lets
# a commit finish while a reader holds one (with a rollback journal, or
# with one connection holding the file exclusively, the commit waited
# commit-lock-timeout for the reader and failed in tpc_finish).
_REQUIRED = {
    'journal_mode': (('wal',), 'RelStorage keeps read snapshots open while other '
                     'connections commit, which SQLite allows only in WAL mode'),
    'locking_mode': (('normal',), 'the storage opens several connections to the '
                     'database (loads, commits, OIDs), which exclusive locking '
                     'keeps out'),
    # (A helper agent's check: on, the storage failed to open with
    # SQLite's bare "attempt to write a readonly database".)
    'query_only': (('off', 'false', 'no', '0'), 'even a read-only storage writes as '
                   'it opens (the OID counter, WAL mode); for a storage that '
                   'refuses commits use read-only true'),
    # (A helper agent's check: on, every commit failed, "SQL statements in
    # progress": each write then returns a row nobody reads.)
    'count_changes': (('off', 'false', 'no', '0'), 'with it every write statement '
                      'returns a row, and commits fail'),
}

#: page_size: what SQLite takes (it silently ignores any other value).
PAGE_SIZES = tuple(str(512 << n) for n in range(8))

#: Pragmas whose value is a number of bytes: a size with a unit (``1GB``,
#: ``64MB``, ``4KB``, as ZConfig's byte sizes and RelStorage 4.3's
#: configurations write them) is taken too (a helper agent's check: such
#: a 4.3 configuration did not load).  ``cache_size`` counts pages when
#: it is a plain number; a size with a unit is that many bytes, which
#: SQLite takes as a negative number of KiB.
BYTE_SIZED = ('mmap_size', 'soft_heap_limit', 'hard_heap_limit', 'journal_size_limit',
              'page_size', 'cache_size')
_SIZE_WITH_UNIT = re.compile(r'([0-9]+)\s*([kmgt])b?', re.I)
_UNITS = {'k': 1 << 10, 'm': 1 << 20, 'g': 1 << 30, 't': 1 << 40}


def _bytes_of(key, text):
    """``text`` as the plain number the pragma takes, if it is a size
    with a unit; else ``text``."""
    match = _SIZE_WITH_UNIT.fullmatch(text)
    if key not in BYTE_SIZED or match is None:
        return text
    size = int(match.group(1)) * _UNITS[match.group(2).lower()]
    return str(-(size // 1024) or -1) if key == 'cache_size' else str(size)


def _is_int(text):
    return re.fullmatch(r'[+-]?[0-9]+', text) is not None


def _matches(kind, text):
    if kind == BOOL:
        return text.lower() in _BOOL_WORDS
    if kind == INT:
        return _is_int(text)
    if kind == TEXT:
        return '\0' not in text
    return text.lower() == kind


def _describe(allowed):
    if isinstance(allowed, str):
        return allowed
    return 'one of ' + ', '.join(allowed)


def check_pragma(name, value):
    """Return ``(name, value)`` normalized (``journal-mode`` ->
    ``journal_mode``, the value stripped); raise ValueError naming the
    pragma if SQLite documents no such setting or not such a value."""
    key = str(name).strip().lower().replace('-', '_')
    allowed = PRAGMAS.get(key)
    if allowed is None:
        close = difflib.get_close_matches(key, PRAGMAS, n=1)
        raise ValueError('SQLite pragma %r is not a setting SQLite documents%s'
                         % (name, " (did you mean %r?)" % close[0] if close else ''))
    text = _bytes_of(key, str(value).strip())
    kinds = allowed if isinstance(allowed, tuple) else (allowed,)
    if not any(_matches(kind, text) for kind in kinds):
        raise ValueError('SQLite pragma %s: %r is not %s%s'
                         % (key, text, _describe(allowed),
                            ' (or a size with a unit, such as 64MB)'
                            if key in BYTE_SIZED else ''))
    if key == 'page_size' and text.lstrip('+') not in PAGE_SIZES:
        raise ValueError('SQLite pragma page_size: %r is not a power of two from 512 '
                         'to 65536, the page sizes SQLite takes' % text)
    if key in _REQUIRED and text.lower() not in _REQUIRED[key][0]:
        needed, why = _REQUIRED[key]
        raise ValueError('SQLite pragma %s: %r is not supported; it must be %s (%s)'
                         % (key, text, ' or '.join(needed), why))
    return key, text


def check_pragmas(pragmas):
    """Check every item of the mapping *pragmas*; return a new dict."""
    return dict(check_pragma(name, value) for name, value in (pragmas or {}).items())


def pragma_statement(name, value):
    """The SQL setting one checked pragma."""
    name, text = check_pragma(name, value)
    if name in _QUOTED or PRAGMAS[name] == TEXT:
        text = "'%s'" % text.replace("'", "''")
    return 'PRAGMA %s = %s' % (name, text)


def pragma_is_on(value):
    """Is a boolean pragma's value, as <pragmas> gives it (or None), on?"""
    return str(value).strip().lower() in _ON_WORDS
