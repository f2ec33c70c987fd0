"""Every RelStorage option in one place: name, default, type and a one-line doc.

This module is the single source of truth. ``component.xml`` declares the same
options as ZConfig keys (a test keeps the two in step), and
``docs/configuration.rst`` contains the table printed by::

    python -m relstorage.options --rst

An option whose ``active`` flag is false is accepted (so existing
configuration files keep parsing) but the feature behind it is not built
yet. An option with ``replaced_by`` is a key of an earlier RelStorage
release that no longer applies: it is accepted, ignored, and
``replaced_by`` says what took its place. :meth:`Options.log_notices`, called
once for each storage opened, logs both kinds, whichever way the options
were given (ZConfig, zodburi or Python).

Keys are spelled with dashes or underscores alike everywhere
(``keep-history``, ``keep_history``).
"""

import logging
import re
import sys

__all__ = ['Option', 'Options', 'redact_secrets', 'password_not_encoded']


class Option:
    """Description of one option.

    ``name`` is the dashed spelling used in configuration files
    (``keep-history``); ``attribute`` is the Python spelling
    (``keep_history``). ``datatype`` names a ZConfig datatype. ``choices``,
    when given, lists the only accepted values.
    """

    __slots__ = ('name', 'attribute', 'default', 'datatype', 'doc', 'active',
                 'choices', 'aliases', 'replaced_by', 'valid')

    def __init__(self, name, default, datatype, doc, active=False,
                 choices=None, aliases=None, replaced_by=None, valid=None):
        self.name = name
        self.attribute = name.replace('-', '_')
        self.default = default
        self.datatype = datatype
        self.doc = doc
        self.active = active
        self.choices = tuple(choices) if choices else None
        # Values earlier releases accepted -> the choice that means the same.
        self.aliases = dict(aliases) if aliases else {}
        self.replaced_by = replaced_by
        #: None, or (predicate, what the predicate demands) for a value.
        self.valid = valid

    @property
    def legacy(self):
        """True for a key of an earlier release that no longer applies."""
        return self.replaced_by is not None

    def convert(self, value):
        """Return *value* with an alias replaced by what it stands for;
        raise ValueError, naming the option, if it is not allowed."""
        if value is None and self.default is None:
            return None
        value = self.aliases.get(value, value)
        if self.choices and value not in self.choices:
            raise ValueError(
                '%s: %r is not one of %s' % (
                    self.name, value,
                    ', '.join(map(repr, self.choices + tuple(self.aliases)))))
        if self.valid is not None and value is not None:
            check, demand = self.valid
            try:
                ok = check(value)
            except ValueError as exc:
                # (A check that says itself what is wrong.)
                text = str(exc)
                if not text.startswith(self.name):
                    text = '%s: %s' % (self.name, text)
                raise ValueError(text) from None
            if not ok:
                raise ValueError('%s: %r %s' % (self.name, value, demand))
        return value

    @property
    def config_default(self):
        """The default as it is written in a configuration file, or None."""
        return format_config_value(self.default)

    def __repr__(self):
        return '<Option %s default=%r%s>' % (
            self.name, self.default, '' if self.active else ' inactive')


def format_config_value(value):
    if value is None:
        return None
    if isinstance(value, bool):
        return 'true' if value else 'false'
    return str(value)


_POSITIVE = (lambda v: v > 0, 'must be greater than 0')
_NOT_NEGATIVE = (lambda v: v >= 0, 'must not be negative')
_FRACTION = (lambda v: 0 < v <= 1, 'must be greater than 0 and at most 1')
# (NaN compares false: refused too.)
_SECONDS = (lambda v: v >= 0, 'must be a number of seconds, 0 or more')


def _check_cache_servers(value):
    """Its syntax, when the configuration is parsed (no server contacted):
    a helper agent's check found a bad entry refused only at open, after
    the database's schema was created."""
    if not value.strip():
        return True         # (no shared cache, as a templated empty value means)
    from .cache.shared import check_servers
    check_servers(value)
    return True


_CACHE_SERVERS = (_check_cache_servers, 'is not a list of servers')

OPTIONS = (
    # Identity and behaviour of the storage.
    Option('name', None, 'string',
           'Storage name reported by getName(); defaults to the section name '
           'or one derived from the database.', active=True),
    Option('read-only', False, 'boolean',
           'Refuse all writes.', active=True),
    Option('keep-history', True, 'boolean',
           'Keep old object revisions (history-preserving) so undo and '
           'time travel work; false stores only current revisions.',
           active=True),
    Option('create-schema', True, 'boolean',
           'Create the tables on first use if they are missing.', active=True),
    # Blobs.
    Option('blob-dir', None, 'dirpath',
           'Directory for blob files, created at open if missing (with its '
           'parents); blobs are disabled when unset.', active=True),
    Option('shared-blob-dir', False, 'boolean',
           'True if blob-dir is the only blob store (shared by all clients); '
           'false if it is a local cache of blobs kept in the database. Either '
           'belongs to one database (its file .relstorage-database, or '
           '.relstorage-blob-cache for a cache, names it): a storage of another '
           'database refuses it.', active=True),
    Option('blob-cache-size', None, 'byte-size',
           'Target size of the blob cache; unlimited when unset or 0. Pruned in the '
           'background to 90 % of it, sparing files used in the last 2 seconds: it may '
           'be over for a few seconds.', active=True,
           valid=_NOT_NEGATIVE),
    # (0, which earlier releases' configurations may hold, means the
    # default here and below: a helper agent's check.)
    Option('blob-cache-size-check', 10, 'integer',
           'Percentage of blob-cache-size written before checking the cache '
           'size (also checked when the storage opens); 0 means the default.',
           active=True, valid=_POSITIVE, aliases={0: 10}),
    Option('blob-cache-size-check-external', False, 'boolean',
           'Run the blob cache size check in a separate process.', active=True),
    Option('blob-chunk-size', 1048576, 'byte-size',
           'Size of the pieces a blob is split into in the database (64KB to '
           '512MB, 128MB on PostgreSQL: a value beyond is brought within, with a '
           'warning).', active=True,
           valid=_POSITIVE),
    # Replicas.
    Option('replica-conf', None, 'string',
           'File listing the database servers to use (host[:port] per line, '
           '# comments), first that answers; the next on a connection '
           'failure. Re-read when it changes.', active=True),
    Option('ro-replica-conf', None, 'string',
           'File listing read-only replicas (host[:port] per line) for load '
           'connections only; loads fall back to the primary when none '
           'answers.', active=True),
    Option('replica-timeout', 600.0, 'float',
           'Seconds to stay on a fallback server before trying the first '
           'of the list again.', active=True, valid=_SECONDS),
    Option('revert-when-stale', False, 'boolean',
           'On a read-only replica behind what a connection has seen, clear '
           'its caches and serve the older state instead of raising '
           'ReadConflictError.', active=True),
    # Packing.
    Option('pack-gc', True, 'boolean',
           'Remove unreachable objects when packing.', active=True),
    Option('pack-prepack-only', False, 'boolean',
           'Only analyse what a pack would remove and report it; delete '
           'nothing.', active=True),
    Option('pack-skip-prepack', False, 'boolean',
           'Skip the analysis and delete what an earlier pack-prepack-only '
           'run found, re-checking every candidate against later commits.',
           active=True),
    Option('pack-batch-timeout', 1.0, 'float',
           'Longest time, in seconds, one deletion batch of a pack holds the '
           'commit lock; 0 means the default.', active=True, valid=_POSITIVE,
           aliases={0: 1.0}),
    Option('pack-commit-busy-delay', 5.0, 'float',
           'Seconds a pack waits before trying again when the commit lock '
           'stays busy.', active=True, valid=_NOT_NEGATIVE),
    Option('pack-duty-cycle', 0.5, 'float',
           'Fraction of the deletion phase during which the pack may hold the '
           'commit lock (more than 0, at most 1); it sleeps the rest.',
           active=True, valid=_FRACTION),
    Option('pack-max-delay', 20.0, 'float',
           'Longest sleep, in seconds, between two deletion batches of a '
           'pack.', active=True, valid=_NOT_NEGATIVE),
    # Caching.
    Option('cache-servers', None, 'string',
           'Shared cache servers: memcached host:port entries, or Redis URLs '
           'redis://[:password@]host:port/db (rediss:// for TLS), separated '
           'by spaces (memcached entries by commas too).', active=True,
           valid=_CACHE_SERVERS),
    Option('cache-module-name', None, 'string',
           'Client of the shared cache: for memcached pymemcache (when unset) or '
           'pylibmc; redis (or unset) with redis:// URLs in cache-servers. The '
           'names earlier releases documented (memcache, '
           'relstorage.pymemcache_wrapper, relstorage.pylibmc_wrapper) select '
           'pymemcache.', active=True, choices=('pymemcache', 'pylibmc', 'redis'),
           aliases={'memcache': 'pymemcache',
                    'relstorage.pymemcache_wrapper': 'pymemcache',
                    'relstorage.pylibmc_wrapper': 'pymemcache'}),
    Option('cache-prefix', None, 'string',
           'Prefix for shared cache keys and the cache file name; defaults to '
           'a safe name derived from the database.', active=True),
    Option('cache-local-mb', 10, 'integer',
           'Megabytes the in-process cache of pickles may take (each '
           'entry counts its pickle and about 180 bytes of bookkeeping); 0 '
           'disables it.', active=True, valid=_NOT_NEGATIVE),
    Option('cache-local-dir', None, 'dirpath',
           'Directory to save the local cache to and load it from; created '
           'at open if missing (with its parents).',
           active=True),
    Option('cache-local-object-max', 16384, 'byte-size',
           'Largest pickle kept in the local cache.', active=True, valid=_NOT_NEGATIVE),
    Option('cache-local-compression', 'none', 'string',
           'Compression of pickles in the local cache: none or zlib (bz2, '
           'which earlier releases offered, means zlib).',
           choices=('none', 'zlib'), active=True, aliases={'bz2': 'zlib'}),
    Option('cache-delta-size-limit', 100000, 'integer',
           'Maximum number of objects tracked in the cache delta maps; 0 means '
           'the default.', active=True, valid=_POSITIVE, aliases={0: 100000}),
    # Locking.
    Option('commit-lock-timeout', 30, 'integer',
           'Seconds to wait for the commit lock before giving up.',
           active=True, valid=_NOT_NEGATIVE),
    Option('keep-locks-on-conflict', 0.0, 'float',
           'After a conflict found in vote, seconds the failed transaction '
           'keeps its row locks so that its retry on the same connection '
           'cannot lose to a third committer (0, the default, turns it off; '
           'not on SQLite). Only for sites that never join several databases '
           'in one transaction: there a held lock and another database\'s '
           'commit lock can wait for each other until the hold ends.',
           active=True, valid=_NOT_NEGATIVE),
    Option('session-pool-size', 7, 'integer',
           'Database sessions for committing kept per process and storage (a '
           'commit waits up to commit-lock-timeout when all are in use); idle '
           'load sessions are kept up to the same number.',
           active=True, valid=_POSITIVE),
    # Keys of earlier releases that no longer apply: accepted and ignored,
    # with a warning saying what replaced them.
    # (Earlier releases took fractions of a second.)
    Option('poll-interval', None, 'float',
           'Seconds between polls for changes.',
           replaced_by='changes are polled at the start of every transaction'),
    Option('pack-dry-run', None, 'boolean',
           'Analyse a pack without deleting anything.',
           replaced_by='pack-prepack-only, which a true value here sets'),
    Option('cache-local-dir-count', None, 'integer',
           'Number of cache files kept in cache-local-dir.',
           replaced_by='cache-local-dir, which keeps one file per storage'),
    Option('cache-local-dir-read-count', None, 'integer',
           'Number of cache files read at startup.',
           replaced_by='cache-local-dir, which keeps one file per storage'),
    Option('cache-local-dir-write-max-size', None, 'byte-size',
           'Largest cache file written.',
           replaced_by='cache-local-mb, which bounds the saved cache too'),
    Option('cache-local-dir-compress', None, 'boolean',
           'Compress the cache files.',
           replaced_by='cache-local-compression (the in-memory cache; the saved '
                       'cache file is not compressed)'),
    Option('cache-local-storage', None, 'string',
           'Class of the local cache (a dotted name).',
           replaced_by='the local cache of this release, sized by cache-local-mb'),
    # Configuration generators still write "commit-lock-id 0": only
    # another value is worth a warning.
    Option('commit-lock-id', 0, 'integer',
           'Identifier of the commit lock, for databases with named locks.',
           replaced_by="nothing: the commit lock is a row of the database's own "
                       "commit_lock table, which no other storage shares"),
    # Set from the adapter section, not a <relstorage> key.
    Option('driver', 'auto', 'string',
           'DB-API driver to use; set in the adapter section.', active=True),
)

#: Options not written as keys of the <relstorage> section.
NOT_RELSTORAGE_KEYS = ('driver',)

log = logging.getLogger(__name__)

# Key names that suggest a secret; their values never appear in a repr.
_SECRET_NAME = re.compile(r'pass(?:word|wd)?|secret|token', re.I)

# password=value (quoted or not) in libpq/Oracle style strings, and the
# user:password@ part of URLs.
_SECRET_IN_TEXT = (
    (re.compile(r"""((?:password|passwd|pwd)\s*=\s*)('(?:[^'\\]|\\.)*'|"""
                r""""(?:[^"\\]|\\.)*"|[^\s;,]*)""", re.I), r'\1***'),
    # To the last @ of the word: a password may hold an @ or a / that
    # was not percent-encoded (a helper agent's check: the part after
    # the first @ was shown); what follows the @ may not be the host then,
    # but nothing of the password is left.
    # (The user part may hold an @ too: admin@srv:password@host.)
    (re.compile(r'(://[^:/\s]*:)\S*@'), r'\1***@'),
)


#: The bounds of the blob pieces kept in the database: blob-chunk-size
#: beyond them is brought within, with a warning (a helper agent's check:
#: a huge value, accepted at parse as earlier releases accept it, failed
#: every blob commit with OverflowError; 1 byte took seconds per 20 KB).
BLOB_CHUNK_MIN = 64 << 10
BLOB_CHUNK_MAX = 512 << 20


def blob_chunk_bytes(options, warn=True, limit=None, database=None):
    """The size of the pieces blobs are kept in, in the database, for
    ``options`` (blob-chunk-size within BLOB_CHUNK_MIN..BLOB_CHUNK_MAX, or
    ``limit``, the most ``database`` takes in one value)."""
    wanted = int(getattr(options, 'blob_chunk_size', None) or 1 << 20)
    top = min(BLOB_CHUNK_MAX, limit or BLOB_CHUNK_MAX)
    size = min(max(wanted, BLOB_CHUNK_MIN), top)
    if size != wanted and warn:
        # (A helper agent's check: on PostgreSQL, 200MB gave no warning
        # at open, and 1GB one that named 512MB, where 128MB was used.)
        log.warning("blob-chunk-size %d is outside %d to %d bytes%s: using %d",
                    wanted, BLOB_CHUNK_MIN, top,
                    (' (the most %s takes in one value)' % database
                     if top < BLOB_CHUNK_MAX and database else ''), size)
    return size


def redact_secrets(text):
    """Return *text* with anything that looks like a password replaced.

    Covers ``password=...`` (quoted or not) as in PostgreSQL and Oracle
    connection strings, and ``scheme://user:password@host`` URLs.
    """
    if not isinstance(text, str):
        return text
    for pattern, replacement in _SECRET_IN_TEXT:
        text = pattern.sub(replacement, text)
    return text


def redact_password(text, password, shown=''):
    """redact_secrets(``text``), and the ``password`` itself wherever
    it appears, unless a message would then tell it: when it appears in
    ``shown`` (what the message says beside ``text``: a host, port or user
    name that the driver's text names too), or is shorter than
    MIN_MASKED (every such piece of text masked would spell it out).  A
    helper agent's check: a password that was also the port, or the user
    name, or part of the host, came out as "port ***", "user \"***\""."""
    if password and len(password) >= MIN_MASKED and password not in shown:
        text = text.replace(password, '***')
    return redact_secrets(text)


#: See redact_password.
MIN_MASKED = 4


def password_not_encoded(url):
    """Whether ``url`` (scheme://user:password@host/...) has an ``@``
    after the end of its authority: a password holding ``/``, ``?`` or
    ``#`` that was not percent-encoded, which ends the authority early (the
    rest of the password would be read as a host, port, path or query,
    and quoted in errors)."""
    scheme, sep, rest = url.partition('://')
    if not sep:
        return False
    authority = re.split(r'[/?#]', rest, maxsplit=1)[0]
    if '@' in authority or '@' not in rest or ':' not in authority:
        # (An @ in a path or a query of a URL without user:password, such
        # as user=alice@EXAMPLE.COM, is no password: a review finding.)
        return False
    # user:pa (the password cut short) or :pa, not host:port.
    return not authority.rsplit(':', 1)[1].isdigit()


#: The message for password_not_encoded.
PASSWORD_NOT_ENCODED = ("the URL's password holds '/', '?', '#' or '@': write them "
                        "percent-encoded (%2F, %3F, %23, %40)")


class Options:
    """The values of all options, as attributes named like ``keep_history``.

    Unknown names raise :exc:`TypeError`; a value outside an option's
    allowed choices raises :exc:`ValueError`. Both messages name the option.
    Names may be spelled with dashes too (``Options(**{'keep-history': 0})``).
    """

    OPTIONS = OPTIONS
    _by_attribute = {o.attribute: o for o in OPTIONS}

    def __init__(self, **kwargs):
        for option in self.OPTIONS:
            setattr(self, option.attribute, option.default)
        for key, value in kwargs.items():
            option = self._by_attribute.get(key.replace('-', '_'))
            if option is None:
                raise TypeError('Unknown RelStorage option: %r' % (key,))
            setattr(self, option.attribute, option.convert(value))
        if self.pack_dry_run:
            # What pack-dry-run meant: delete nothing.
            self.pack_prepack_only = True
        # Keys that only go together, checked as the file is parsed.
        if self.pack_prepack_only and self.pack_skip_prepack:
            raise ValueError('pack-prepack-only and pack-skip-prepack contradict each '
                             'other: the first only analyses, the second only deletes '
                             'what an earlier analysis found')
        if self.cache_servers and self.cache_servers.strip() and self.cache_module_name:
            from .cache.shared import check_servers
            check_servers(self.cache_servers, self.cache_module_name)

    @classmethod
    def from_config_names(cls, values):
        """Build from a mapping keyed by config names (``keep-history``).

        Attribute spellings (``keep_history``) are accepted too.
        """
        return cls(**values)

    @classmethod
    def option(cls, name):
        """Return the :class:`Option` called *name* (either spelling)."""
        try:
            return cls._by_attribute[name.replace('-', '_')]
        except KeyError:
            raise TypeError('Unknown RelStorage option: %r' % (name,)) \
                from None

    def as_dict(self):
        """Attribute name -> value for every option."""
        return {o.attribute: getattr(self, o.attribute) for o in self.OPTIONS}

    def copy(self, **changes):
        """Return a new instance with *changes* applied."""
        values = self.as_dict()
        new = type(self)()
        new.__dict__.update(values)
        for key, value in changes.items():
            option = self._by_attribute.get(key.replace('-', '_'))
            if option is None:
                raise TypeError('Unknown RelStorage option: %r' % (key,))
            setattr(new, option.attribute, option.convert(value))
        return new

    def log_notices(self, logger=log):
        """Log what the options ask for that this release does not do.

        A WARNING for each key of an earlier release that was given (it is
        ignored; the message says what replaced it), an INFO for each option
        set to a non-default value whose feature is not built yet. The
        storage calls this once when it is opened, so every way of giving
        options (ZConfig, zodburi, Python) gets the same notices.
        """
        for option in self.OPTIONS:
            value = getattr(self, option.attribute)
            if option.legacy:
                if option.name == 'pack-dry-run' and value:
                    # (It still has its effect: a helper agent's check
                    # found "no longer used" misleading.)
                    logger.warning('option pack-dry-run is from an earlier release; '
                                   'replaced by: %s (so nothing is deleted)',
                                   option.replaced_by)
                elif value is not None and value != option.default:
                    logger.warning(
                        'option %s is from an earlier release and no '
                        'longer used; replaced by: %s', option.name, option.replaced_by)
            elif not option.active and value != option.default:
                logger.info('option %s is accepted but not yet active',
                            option.name)
        if not self.blob_dir:
            # Blob options without a blob-dir (or an empty one: a %define
            # left empty, a helper agent's check): the storage keeps no blobs,
            # and the first blob committed fails with ZODB's "Storing Blobs
            # ... is not supported", which names no option.
            given = [option.name for option in self.OPTIONS
                     if option.name.startswith('blob-') and option.name != 'blob-dir'
                     and getattr(self, option.attribute) != option.default]
            if self.shared_blob_dir:
                given.insert(0, 'shared-blob-dir')
            if given:
                logger.warning('%s set without blob-dir: this storage keeps no blobs '
                               '(set blob-dir to store them)', ', '.join(given))

    def __eq__(self, other):
        if not isinstance(other, Options):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    __hash__ = None

    def __repr__(self):
        parts = []
        for option in self.OPTIONS:
            value = getattr(self, option.attribute)
            if value == option.default:
                continue
            if _SECRET_NAME.search(option.attribute):
                shown = '***'
            else:
                shown = repr(redact_secrets(value))
            parts.append('%s=%s' % (option.attribute, shown))
        return '%s(%s)' % (type(self).__name__, ', '.join(parts))


def rst_table(options=OPTIONS):
    """Return the reStructuredText tables documenting *options*: the
    current ones, then the keys of earlier releases and what replaced them."""
    lines = [
        '.. list-table::',
        '   :header-rows: 1',
        '   :widths: 25 12 12 51',
        '',
        '   * - Option',
        '     - Default',
        '     - Type',
        '     - Description',
    ]
    for option in options:
        # (driver goes in the adapter section, whose keys are documented
        # there: listed here, it read as a key of <relstorage>, which
        # refuses it; a helper agent's check.)
        if option.legacy or option.name in NOT_RELSTORAGE_KEYS:
            continue
        default = option.config_default
        doc = option.doc
        if not option.active:
            doc += ' *(Accepted; not active yet.)*'
        lines += [
            '   * - ``%s``' % option.name,
            '     - %s' % ('``%s``' % default if default is not None
                           else '(unset)'),
            '     - %s' % option.datatype,
            '     - %s' % doc,
        ]
    lines += [
        '',
        'Keys of earlier releases, accepted and ignored with a warning:',
        '',
        '.. list-table::',
        '   :header-rows: 1',
        '   :widths: 30 35 35',
        '',
        '   * - Key',
        '     - What it did',
        '     - Replaced by',
    ]
    for option in options:
        if option.legacy:
            lines += [
                '   * - ``%s``' % option.name,
                '     - %s' % option.doc,
                '     - %s' % option.replaced_by,
            ]
    return '\n'.join(lines) + '\n'


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv == ['--rst']:
        sys.stdout.write(rst_table())
        return 0
    if argv:
        sys.stderr.write('usage: python -m relstorage.options [--rst]\n')
        return 2
    for option in OPTIONS:
        doc = option.doc
        if option.legacy:
            doc = 'IGNORED (replaced by: %s)' % option.replaced_by
        print('%-32s %-10s %s' % (option.name, option.config_default, doc))
    return 0


if __name__ == '__main__':
    sys.exit(main())
