"""zodbpack: pack the storages named in a ZConfig file (made for cron).

    zodbpack [-d DAYS] [--prepack | --use-prepack-state | --check-refs-only] CONFIG

CONFIG holds one or more storage sections (``%import relstorage`` for
``<relstorage>``), bare or wrapped in ``<zodb>`` (or Zope's ``<zodb_db>``)
sections as in the application's own configuration; or it is a whole
zope.conf, of which the RelStorage databases are packed.  Each storage is
packed to DAYS days ago (default 1, as with every earlier release's
zodbpack; 0, or a negative number as earlier releases took it: now), with
garbage collection as its ``pack-gc`` option says.
A RelStorage pack runs beside a live site: see docs/pack.rst.

On a terminal, each phase shows its progress; otherwise (cron) the only
output is a one-line summary per storage.  Any error ends with a one-line
message and a non-zero exit status (2 for a bad command line or
configuration, 1 otherwise; 1 as well when --check-refs-only finds a
missing object).
"""
import argparse
import io
import logging
import os
import re
import shutil
import sys
import time
import urllib.parse

import ZConfig
from ZODB.serialize import referencesf

from .messages import config_error
from .messages import one_line as _one_line
from .options import redact_secrets

# <zodb> is ZODB's database section; <zodb_db> is Zope's (zope.conf), whose
# other keys (mount-point, cache-size, ...) mean nothing to a pack.
SCHEMA = """
<schema>
  <import package="ZODB"/>
  <sectiontype name="zodb_db" implements="ZODB.database">
    <section type="ZODB.storage" name="*" attribute="storage" required="yes"/>
    <key name="+" attribute="ignored"/>
  </sectiontype>
  <multisection type="ZODB.storage" attribute="storages" name="*"/>
  <multisection type="ZODB.database" attribute="databases" name="*"/>
</schema>
"""

log = logging.getLogger('zodbpack')

#: The longest history -d accepts (a pack time before ZODB's timestamps
#: begin, 1900, is not one).
MAX_DAYS = 36500

#: History kept without -d: a day, as every earlier release's zodbpack
#: kept, so that an unchanged crontab line removes no more than it did.
DEFAULT_DAYS = 1.0

PACING_HELP = """\
A RelStorage pack runs beside a live site.  Its analysis takes no lock a
commit needs; its deletions run in short batches, each holding the commit
lock briefly, with pauses between them.  Options of the <relstorage>
section set the pace:
  pack-duty-cycle         share of the time the pack may hold the commit
                          lock (default 0.5); lower it to make the pack
                          gentler on a busy site, and slower
  pack-max-delay          longest pause between two batches, in seconds
                          (default 20)
  pack-batch-timeout      longest a batch may hold the commit lock, in
                          seconds (default 1.0)
  pack-commit-busy-delay  wait when the commit lock is busy, in seconds
                          (default 5.0)
  pack-gc                 false: remove old revisions only, no garbage
                          collection
Example crontab line, packing every night to one day ago:
  30 2 * * * zodbpack -d 1 /etc/zodb/pack.conf
"""


def make_parser():
    parser = argparse.ArgumentParser(
        prog='zodbpack',
        description='Pack the ZODB storages of a ZConfig file: remove old revisions '
                    'and (with pack-gc, the default) unreachable objects.',
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=PACING_HELP)
    parser.add_argument('config', metavar='CONFIG',
                        help='ZConfig file with <relstorage> (or other storage) '
                             'sections, bare or inside <zodb> / <zodb_db> sections; '
                             'or a zope.conf (its RelStorage databases)')
    parser.add_argument('-d', '--days', type=float, default=None,
                        help='keep the history of the last DAYS days (a number, '
                             'fractions allowed; default 1; 0 or a negative '
                             'number: pack to now)')
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument('--prepack', action='store_true',
                      help='only analyse: report what a pack would remove (objects, '
                           'revisions, bytes, blobs) and remove nothing '
                           '(= pack-prepack-only)')
    mode.add_argument('--use-prepack-state', action='store_true',
                      help='skip the analysis and remove what the last --prepack '
                           'found, re-checking every candidate against commits '
                           'made since (= pack-skip-prepack)')
    mode.add_argument('--check-refs-only', action='store_true',
                      help='report references to objects that do not exist (OID, '
                           'referencing OID and TID); exit 1 if any; remove nothing')
    parser.add_argument('-q', '--quiet', action='store_true',
                        help='no progress display and no summary; errors only')
    parser.add_argument('-v', '--verbose', action='store_true',
                        help='log what the pack does (INFO)')
    return parser


def main(argv=None):
    parser = make_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format='%(asctime)s %(name)s %(levelname)s %(message)s')
    if args.use_prepack_state and args.days:
        parser.error('--days does not apply to --use-prepack-state, which packs to the '
                     'time of the --prepack analysis it uses')
    days = DEFAULT_DAYS if args.days is None else args.days
    if days < 0:
        # Earlier releases packed to now when told a negative number.
        days = 0.0
    if not 0 <= days <= MAX_DAYS:
        # (Also NaN, which no comparison holds.)
        parser.error('--days must be a number up to %d, not %s' % (MAX_DAYS, args.days))
    try:
        config = load_config(args.config, quiet=args.quiet)
    except ZConfig.ConfigurationError as exc:
        # (One line, with the place: a helper agent's check.)
        _error(config_error(exc))
        return 2
    except OSError as exc:
        _error('%s' % exc)
        return 2
    except UnicodeDecodeError as exc:
        # (A review finding: a traceback, where zodbconvert said it.)
        _error('%s is not UTF-8 text (byte %d)' % (args.config, exc.start))
        return 2
    sections = [(_section_name(section), section) for section in config.storages or ()]
    for database in config.databases or ():
        storage = getattr(database, 'config', database).storage
        name = _section_name(storage)
        if name == '(unnamed)':
            # (A zope.conf's <zodb_db catalog>: its storage has no name of
            # its own; a helper agent's check saw "(unnamed)".)
            name = _section_name(database)
        sections.append((name, storage))
    if not sections:
        _error('%s names no storage (a <relstorage> section, bare or inside <zodb>)'
               % args.config)
        return 2
    show_progress = not args.quiet and sys.stderr.isatty()
    progress = _progress_factory() if show_progress else None
    pack_time = time.time() - days * 86400
    status = 0
    for name, section in sections:
        storage = None
        try:
            try:
                storage = section.open()
            except Exception as exc:  # pylint:disable=broad-except
                _error('cannot open storage %s: %s' % (name, _one_line(exc)))
                status = 1
                continue
            name = storage.getName() or name
            status = max(status, _run(storage, name, args, pack_time, progress))
        except KeyboardInterrupt:
            # (A helper agent's check: Ctrl-C or SIGINT printed a traceback
            # of 25 lines.)  The batch under way was rolled back.
            if show_progress:
                sys.stderr.write('\n')
            _error('%s: interrupted. What was removed before stays removed and nothing '
                   'reachable was lost; run zodbpack again to finish.' % name)
            return 1
        except Exception as exc:  # pylint:disable=broad-except
            text = _one_line(exc)
            # (Not named twice: a helper agent's check saw "zodbpack:
            # RelStorage on <db>: A pack of <db> is already running.")
            adapter = getattr(storage, 'adapter', None)
            _error(text if adapter is not None and adapter.describe() in text
                   else '%s: %s' % (name, text))
            log.debug('zodbpack failed', exc_info=True)
            status = 1
        finally:
            if storage is not None:
                storage.close()
    return status


def load_config(path, quiet=False):
    """The storages and databases of ``path``: a file of storage sections,
    bare or in <zodb> / <zodb_db> sections, or an application's whole
    zope.conf, whose other sections (instancehome, <eventlog>, <http-server>,
    a <temporarystorage>...) mean nothing here and need Zope's schema: of
    such a file, only its RelStorage databases are read."""
    schema = ZConfig.loadSchemaFile(io.StringIO(SCHEMA))
    try:
        config, _ = ZConfig.loadConfig(schema, path)
        return config
    except ZConfig.ConfigurationError as exc:
        with open(path, encoding='utf-8') as f:
            text = f.read()
        # (A helper agent's check: a <zodb_db> whose <relstorage> came in
        # through %include was left out without a word, and a cron job
        # never packed that database.)
        text = with_includes(text, os.path.dirname(os.path.abspath(path)))
        databases = relstorage_databases(text)
        if databases is None and _OPEN.search(text) and \
                getattr(exc, 'lineno', None) not in _database_lines(text):
            # A zope.conf whose databases hold no <relstorage> (a helper
            # agent's check: with <relstorag> misspelt there, the error
            # named Zope's first key, instancehome).  (An error inside
            # them is theirs: a review finding, a FileStorage's bad key
            # was reported as this.)
            raise ZConfig.ConfigurationError(
                '%s: no <zodb_db> section holds a <relstorage> section (they hold %s)'
                % (path, ', '.join(_inner_sections(text)) or 'none')) from None
        if databases is None or _keeps_every_line(text, databases):
            # (Nothing to leave out: the mistake is in the storage sections,
            # and said as it is, in one line.)
            raise
        # Said (but with --quiet), so that a mistake outside those sections
        # is not missed.
        if not quiet:
            _error('%s is not a file of storages only (%s); packing the RelStorage '
                   'databases of its <zodb_db> sections' % (path, _one_line(exc)))
    # (Relative %include paths and such resolve from the file's directory.)
    url = 'file://' + os.path.abspath(path)
    config, _ = ZConfig.loadConfigFile(schema, io.StringIO(databases), url=url)
    return config


def _database_lines(text):
    """The numbers of the lines of ``text`` inside its <zodb_db> / <zodb>
    sections."""
    lines, inside = set(), False
    for number, line in enumerate(text.splitlines(), 1):
        if _OPEN.match(line):
            inside = True
        if inside:
            lines.add(number)
        if _CLOSE.match(line):
            inside = False
    return lines


def _inner_sections(text):
    """``<type> (line N)`` for the first section inside each <zodb_db> /
    <zodb> section of ``text``."""
    found, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _OPEN.match(line):
            inside = True
        elif inside:
            match = re.match(r'\s*<\s*([^/\s>]+)', line)
            if match:
                found.append('<%s> (line %d)' % (match.group(1), number))
                inside = False
    return found


def _keeps_every_line(text, kept):
    """Whether ``kept`` (relstorage_databases of ``text``) left out no line
    but blanks and comments."""
    return all(line == ours or not line.strip() or line.lstrip().startswith('#')
               for line, ours in zip(text.splitlines(), kept.splitlines()))


_INCLUDE = re.compile(r'\s*%include\s+(\S+)\s*$', re.I)


_DEFINE = re.compile(r'\s*%define\s+([a-z_][a-z0-9_]*)\s*(.*?)\s*$', re.I)


def with_includes(text, directory, depth=0, defines=None):
    """``text`` with the files its %include lines name (local paths or
    file: URLs, relative ones from ``directory``, with the names %define
    gave substituted) put in their place, as ZConfig reads them, so that
    the sections they hold are seen; other lines as they are."""
    if '%include' not in text.lower() or depth > 20:
        return text
    import ZConfig.substitution
    defines = {} if defines is None else defines
    out = []
    for line in text.splitlines():
        define = _DEFINE.match(line)
        if define:
            try:
                defines[define.group(1).lower()] = ZConfig.substitution.substitute(
                    define.group(2), defines)
            except ZConfig.ConfigurationError:
                pass                # (ZConfig says what is wrong with it)
        match = _INCLUDE.match(line)
        name = match.group(1) if match else None
        if name is not None and '$' in name:
            # (A review finding: %include $INSTANCE/etc/db.conf.)
            try:
                name = ZConfig.substitution.substitute(name, defines)
            except ZConfig.ConfigurationError:
                name = None
        if name is not None and name.lower().startswith('file:'):
            name = urllib.parse.unquote(urllib.parse.urlsplit(name).path)
        if name is None or '://' in name:
            out.append(line)
            continue
        included = os.path.join(directory, os.path.expanduser(name))
        try:
            with open(included, encoding='utf-8') as f:
                inner = f.read()
        except OSError:
            out.append(line)        # (ZConfig says what is wrong with it)
            continue
        out.append(with_includes(inner, os.path.dirname(os.path.abspath(included)),
                                 depth + 1, defines).rstrip('\n'))
    return '\n'.join(out) + '\n'


_OPEN = re.compile(r'\s*<\s*(zodb_db|zodb)(\s|>)', re.I)
_CLOSE = re.compile(r'\s*<\s*/\s*(zodb_db|zodb)\s*>', re.I)


def relstorage_databases(text):
    """Of a zope.conf's text, its %define and %import lines and the
    <zodb_db> / <zodb> sections holding a <relstorage> section, the other
    lines left blank (so that an error names the file's own line); None
    when it has no such section."""
    kept, block, found = [], None, False
    for line in text.splitlines():
        if block is None:
            words = line.split()
            if words[:1] == ['%define'] or (words[:1] == ['%import'] and
                                            _importable(words[1:2])):
                kept.append(line)
            elif _OPEN.match(line):
                block = [line]
            else:
                kept.append('')
        else:
            block.append(line)
            if _CLOSE.match(line):
                if any(re.match(r'\s*<\s*relstorage[\s>]', part, re.I) for part in block):
                    kept.extend(block)
                    found = True
                else:
                    kept.extend([''] * len(block))
                block = None
    if not found:
        return None
    return '\n'.join(kept) + '\n'


def _importable(names):
    """Whether the package an %import names can be imported (a zope.conf
    may import what only the application has, e.g. tempstorage)."""
    import importlib.util
    try:
        return bool(names) and importlib.util.find_spec(names[0]) is not None
    except (ImportError, ValueError):
        return False


def _run(storage, name, args, pack_time, progress):
    run_pack = getattr(storage, 'run_pack', None)
    if run_pack is None:
        if args.prepack or args.use_prepack_state or args.check_refs_only:
            raise ValueError('--prepack, --use-prepack-state and --check-refs-only '
                             'need a RelStorage, not %s' % type(storage).__name__)
        started = time.time()
        storage.pack(pack_time, referencesf)
        _say(args, '%s: packed in %.1fs' % (name, time.time() - started))
        return 0
    if args.check_refs_only:
        started = time.time()
        missing = storage.check_references(referencesf, progress=progress)
        for oid, tid, to_oid in missing:
            print('%s: object 0x%x is missing, referenced by object 0x%x at '
                  'transaction 0x%x' % (name, to_oid, oid, tid))
        _say(args, '%s: %d references to missing objects (%.1fs)'
             % (name, len(missing), time.time() - started))
        return 1 if missing else 0
    report = run_pack(pack_time, referencesf,
                      prepack_only=True if args.prepack else None,
                      skip_prepack=True if args.use_prepack_state else None,
                      progress=progress)
    _say(args, '%s: %s' % (name, report.summary()))
    if report.orphan_blob_files:
        _say(args, '%s: %d blob files have no database row (first: %s)'
             % (name, len(report.orphan_blob_files), report.orphan_blob_files[0]))
    return 0


def _progress_factory():
    """A progress display per phase from tqdm, or None without it."""
    try:
        import tqdm
    except ImportError:
        return None

    # A terminal that reports no size (some ptys) would get empty bars, or
    # none at all: tqdm draws nothing on a screen of 0 rows (a helper
    # agent's check).  (Python 3.10's get_terminal_size gives the 0 back.)
    size = shutil.get_terminal_size((80, 24))

    def make(description, total, unit):
        return tqdm.tqdm(desc=description, total=total, unit=' ' + unit, leave=True,
                         file=sys.stderr, ncols=size.columns or 80, nrows=size.lines or 24)
    return make


def _section_name(section):
    """The name a section was given (a storage's factory, or a database's
    section itself), or '(unnamed)'."""
    for value in (getattr(section, 'config', None), section):
        getter = getattr(value, 'getSectionName', None)
        if getter is not None and getter():
            return getter()
    return getattr(section, 'name', None) or '(unnamed)'


def _say(args, text):
    if not args.quiet:
        print('zodbpack: ' + text)


def _error(text):
    sys.stderr.write('zodbpack: %s\n' % redact_secrets(text))


if __name__ == '__main__':
    sys.exit(main())
