"""zodbconvert: copy the contents of one ZODB storage into another.

Usage: ``zodbconvert [options] CONFIG``, where CONFIG is a ZConfig file with
two storage sections named ``source`` and ``destination``::

    %import relstorage
    <filestorage source>
      path /var/zodb/Data.fs
      blob-dir /var/zodb/blobs
    </filestorage>
    <relstorage destination>
      keep-history false
      <sqlite3>
        data-dir /var/zodb/sqlite
      </sqlite3>
    </relstorage>

Any ZODB storage may stand on either side.  The source is opened read-only.
See docs/zodbconvert.rst for the options, the exit codes and how resuming
works.

Exit codes: 0 success, 1 failure (including refusals because of what the
destination holds, and a failed --verify), 2 usage or configuration error.
"""
import argparse
import contextlib
import logging
import os
import sys
import time

from ZODB.loglevels import TRACE
from ZODB.POSException import POSKeyError
from ZODB.utils import oid_repr
from ZODB.utils import p64
from ZODB.utils import tid_repr
from ZODB.utils import u64

from relstorage.messages import config_error
from relstorage.messages import one_line as _one_line
from relstorage.options import redact_secrets
from relstorage.storage import copy

log = logging.getLogger('zodbconvert')

SCHEMA = """
<schema>
  <import package="ZODB"/>
  <section type="ZODB.storage" name="source" attribute="source" required="yes">
    <description>The storage to copy from (opened read-only).</description>
  </section>
  <section type="ZODB.storage" name="destination" attribute="destination"
           required="yes">
    <description>The storage to copy into.</description>
  </section>
</schema>
"""

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad arguments or configuration: exit code 2."""


class Failure(Exception):
    """The conversion failed or was refused: exit code 1."""


# ----------------------------------------------------------------------
# Progress and messages


def _size(n):
    for unit in ('B', 'KB', 'MB', 'GB'):
        if abs(n) < 1024 or unit == 'GB':
            return ('%d %s' % (n, unit)) if unit == 'B' else ('%.1f %s' % (n, unit))
        n /= 1024.0
    return '%.1f TB' % n  # pragma: no cover


def _duration(seconds):
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return '%d:%02d:%02d' % (h, m, s)


class Progress:
    """One self-rewriting status line on a terminal (stderr).

    ``fraction`` (a callable taking the stats) estimates how much is done, for
    the remaining-time estimate; None when unknown.
    """

    interval = 0.5

    def __init__(self, stream, label, fraction=None, enabled=True):
        self.stream = stream
        self.label = label
        self.fraction = fraction
        self.enabled = enabled
        self._last = 0.0
        self._width = 0

    def __call__(self, stats, force=False):
        if not self.enabled:
            return
        now = time.time()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        elapsed = stats.elapsed
        line = '%s: %d txn, %d records, %s' % (
            self.label, stats.transactions, stats.records, _size(stats.bytes + stats.blob_bytes))
        line += ' | %.0f records/s, %s/s' % (stats.records / elapsed,
                                              _size((stats.bytes + stats.blob_bytes) / elapsed))
        fraction = self.fraction(stats) if self.fraction is not None else None
        if fraction and 0 < fraction <= 1:
            remaining = elapsed * (1 - fraction) / fraction
            line += ' | %3.0f%%, %s left' % (fraction * 100, _duration(remaining))
        pad = max(self._width - len(line), 0)
        self._width = len(line)
        self.stream.write('\r' + line + ' ' * pad)
        self.stream.flush()

    def finish(self):
        if self.enabled and self._width:
            self.stream.write('\n')
            self.stream.flush()
            self._width = 0


def _summary(stats, verb):
    elapsed = stats.elapsed
    text = '%s %d transactions, %d records, %s' % (
        verb, stats.transactions, stats.records, _size(stats.bytes))
    if stats.blobs:
        text += ', %d blobs (%s)' % (stats.blobs, _size(stats.blob_bytes))
    text += ' in %s (%.0f records/s, %s/s)' % (
        _duration(elapsed), stats.records / elapsed,
        _size((stats.bytes + stats.blob_bytes) / elapsed))
    return text


# ----------------------------------------------------------------------
# Configuration and storages


def load_config(path):
    import ZConfig
    schema = ZConfig.loadSchemaFile(_StringIO(SCHEMA))
    if not os.path.exists(path):
        raise UsageError('configuration file %s does not exist' % path)
    try:
        config, _ = ZConfig.loadConfig(schema, path)
    except ZConfig.ConfigurationError as exc:
        text = config_error(exc, named=path)
        if 'no matching section' in text:
            # (A helper agent's check: a misnamed section's error did not
            # say which names were expected.)
            # (And one left unclosed, whose next section is then taken
            # for one inside it, gave the same hint, which did not help.)
            text += ('; zodbconvert reads a section named source and one named destination, '
                     'each closed before the next begins')
        raise UsageError('configuration error in %s: %s' % (path, text)) from exc
    except Exception as exc:  # ImportError of a %import, ...
        raise UsageError('cannot read configuration %s: %s' % (path, _one_line(exc))) from exc
    return config.source, config.destination


def _StringIO(text):
    import io
    return io.StringIO(text)


def _make_read_only(factory):
    """Ask the section factory for a read-only storage, where it can.

    Returns a function that undoes the change, or None when the storage type
    has no read-only setting."""
    options = getattr(factory, 'options', None)
    if options is not None and hasattr(options, 'read_only') and hasattr(options, 'copy'):
        factory.options = options.copy(read_only=True)     # <relstorage>
        return lambda: setattr(factory, 'options', options)
    section = getattr(factory, 'config', None)
    if section is not None and hasattr(section, 'read_only'):
        before = section.read_only
        section.read_only = True                          # filestorage, zeoclient, ...
        return lambda: setattr(section, 'read_only', before)
    base = getattr(section, 'base', None) if section is not None else None
    if base is not None and hasattr(base, 'open'):
        # A wrapper (<zlibstorage>, <before>) of the storage in its section:
        # that one, read-only (a helper agent's check: a RelStorage 4.x
        # database inside <zlibstorage> was refused as a source).
        return _make_read_only(base)
    return None


def open_storage(factory, role, read_only=False):
    if read_only and _make_read_only(factory) is None:
        log.warning('The %s storage type cannot be opened read-only.', role)
    try:
        return factory.open()
    except Exception as exc:
        raise Failure('cannot open the %s storage: %s' % (role, _one_line(exc))) from exc


def _name(storage):
    try:
        name = storage.getName()
        if copy.reads_relstorage(storage):
            name = '%s (%s, %s)' % (name, storage.adapter.describe(),
                                    'history-preserving' if storage.adapter.keep_history
                                    else 'history-free')
        return redact_secrets(name)
    except Exception:  # pylint:disable=broad-except
        return type(storage).__name__


def _close(storage):
    if storage is not None:
        try:
            storage.close()
        except Exception:  # pylint:disable=broad-except
            log.debug('error closing %r', storage, exc_info=True)


# ----------------------------------------------------------------------
# The conversion


def _thresholds_text():
    from .adapters.base import Adapter
    from .adapters.sqlite.adapter import Sqlite3Adapter
    parts = []
    for kind, label in (('file', 'a FileStorage'), ('zeo', 'ZEO'),
                        ('relstorage', 'a history-preserving RelStorage')):
        text = 'from %s %g' % (label, Adapter.copy_fast_path_thresholds[kind])
        for other in (Sqlite3Adapter,):
            value = other.copy_fast_path_thresholds[kind]
            if value != Adapter.copy_fast_path_thresholds[kind]:
                text += ' (%g into %s)' % (value, other.display_name)
        parts.append(text)
    return ', '.join(parts)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='zodbconvert',
        description='Copy the contents of the ZODB storage named "source" in '
                    'CONFIG into the one named "destination".')
    parser.add_argument('config', metavar='CONFIG',
                        help='ZConfig file with <... source> and <... destination> '
                             'storage sections')
    parser.add_argument('--dry-run', action='store_true',
                        help='read the source and report what would be copied; '
                             'write nothing')
    parser.add_argument('--clear', action='store_true',
                        help='empty the destination (a RelStorage) before copying')
    parser.add_argument('--incremental', action='store_true',
                        help="copy only the source transactions after the destination's "
                             "last one (also resumes an interrupted copy)")
    parser.add_argument('--verify', action='store_true',
                        help='afterwards, re-read both sides and compare every record '
                             'and blob. Alone, on a destination that is not empty: '
                             'only compare the two sides, writing nothing')
    parser.add_argument('--strategy', choices=('auto', copy.REPLAY, copy.CURRENT),
                        default='auto',
                        help='how to fill an empty history-free RelStorage destination: '
                             '"replay" every transaction, or copy only the "current" '
                             'record of each object (record_iternext). "auto" (the '
                             'default) estimates the records per object in the source '
                             '(FileStorage, ZEO: its size against a sample of current '
                             'records; RelStorage: row counts) and copies the current '
                             'records from this many on: %s; otherwise it replays. '
                             'Resuming with --incremental always replays.'
                             % _thresholds_text())
    group = parser.add_mutually_exclusive_group()
    group.add_argument('--progress', dest='progress', action='store_true', default=None,
                       help='show a progress line even when stderr is not a terminal')
    group.add_argument('--no-progress', dest='progress', action='store_false',
                       help='never show the progress line')
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument('--debug', action='store_true',
                           help='log debugging information and show tracebacks')
    # Earlier releases' zodbconvert had it: scripts still pass it.
    verbosity.add_argument('--trace', action='store_true',
                           help='as --debug, with ZODB\'s TRACE level (5) too')
    args = parser.parse_args(argv)
    if args.trace:
        args.debug = True
    if args.dry_run and args.clear:
        parser.error('--clear cannot be combined with --dry-run (a dry run writes nothing)')
    if args.clear and args.incremental:
        parser.error('--clear and --incremental contradict each other')
    return args


def main(argv=None, stdout=None, stderr=None):
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            args = parse_args(argv)
    except SystemExit as exc:        # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=stderr, format='zodbconvert: %(levelname)s: %(message)s',
                            level=(TRACE if args.trace else logging.DEBUG) if args.debug
                            else logging.WARNING)
    try:
        Converter(args, stdout, stderr).run()
    except UsageError as exc:
        stderr.write('zodbconvert: error: %s\n' % redact_secrets(str(exc)))
        return EXIT_USAGE
    except (Failure, copy.CopyError, copy.VerifyError) as exc:
        if args.debug:
            log.exception('failure')
        stderr.write('zodbconvert: %s\n' % redact_secrets(str(exc)))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        # (A new line after a progress line on a terminal; none in a log:
        # a helper agent's check saw the file begin with an empty line.)
        tty = hasattr(stderr, 'isatty') and stderr.isatty()
        stderr.write('%szodbconvert: interrupted. Every transaction copied so far is '
                     'complete; run again with --incremental to resume.\n'
                     % ('\n' if tty else ''))
        return EXIT_FAILURE
    except Exception as exc:  # pylint:disable=broad-except
        if args.debug:
            log.exception('failure')
        stderr.write('zodbconvert: failed: %s: %s\n'
                     % (type(exc).__name__, redact_secrets(_one_line(exc))))
        return EXIT_FAILURE
    return EXIT_OK


class Converter:

    def __init__(self, args, stdout, stderr):
        self.args = args
        self.stdout = stdout
        self.stderr = stderr
        show = args.progress
        if show is None:
            show = hasattr(stderr, 'isatty') and stderr.isatty()
        self.show_progress = show

    def say(self, text):
        self.stdout.write(text + '\n')
        self.stdout.flush()

    def run(self):
        args = self.args
        source_factory, dest_factory = load_config(args.config)
        self.dest_factory = dest_factory
        source = dest = None
        try:
            source = open_storage(source_factory, 'source', read_only=True)
            _check_blob_dirs_apart(source, dest_factory)
            if args.dry_run:
                dest = self._open_dest_read_only(dest_factory)
                self._check_strategy(source, dest)
            elif args.verify and not (args.clear or args.incremental):
                # --verify alone: a filled destination is only compared.
                dest = self._open_filled_read_only(dest_factory)
            if dest is None and not args.dry_run:
                dest = open_storage(dest_factory, 'destination')
                self._check_strategy(source, dest)
                _check_not_same(source, dest)
                if args.clear:
                    dest = self._clear(dest_factory, dest)
            self.say('Source:      %s' % _name(source))
            self.say('Destination: %s' % (_name(dest) if dest is not None
                                           else '(does not exist yet)'))
            self.convert(source, dest)
        finally:
            _close(dest)
            _close(source)

    def _history_free(self, dest):
        """Whether the destination is (or, not made yet, will be) a
        history-free RelStorage, and its adapter's class.  (A helper
        agent's check: a dry run into a history-free destination not made
        yet planned a replay of every transaction, and refused --strategy
        current, where the run copies the current records.)"""
        if dest is not None:
            if copy.is_history_free(dest):
                return True, type(dest.adapter)
            return False, None
        factory = self.dest_factory
        for _ in range(10):
            options = getattr(factory, 'options', None)
            section = getattr(factory, 'config', None)
            adapter = getattr(section, 'adapter', None)
            if options is not None and adapter is not None:
                break
            # A wrapper's section (<zlibstorage>, <before>): the storage in
            # it (a review finding: a dry run into <zlibstorage> around a
            # history-free RelStorage not made yet planned a replay).
            factory = getattr(section, 'base', None)
            if factory is None or not hasattr(factory, 'open'):
                return False, None
        if options is None or adapter is None or options.keep_history:
            return False, None
        return True, adapter.adapter_class()

    def _check_strategy(self, source, dest):
        # Before --clear empties anything (a helper agent's check: a source
        # that cannot list its current records was refused once the
        # destination had been emptied).
        if self.args.strategy != copy.CURRENT:
            return
        if not self._history_free(dest)[0]:
            raise UsageError('--strategy current needs a history-free RelStorage '
                             'destination; %s is not one' % (
                                 _name(dest) if dest is not None
                                 else 'the destination (which does not exist yet)'))
        try:
            copy.choose_strategy(source, None, copy.CURRENT)
        except copy.CopyError as exc:
            raise UsageError(str(exc)) from exc

    def _open_filled_read_only(self, factory):
        """The destination opened read-only if it holds something, else None
        (and the factory as it was, to open it for copying)."""
        undo = _make_read_only(factory)
        if undo is None:
            return None
        try:
            dest = factory.open()
        except Exception:  # pylint:disable=broad-except
            # Typically it does not exist yet (no file, no schema).
            log.debug('cannot open the destination read-only', exc_info=True)
            return None
        finally:
            undo()
        if _holds_data(dest):
            return dest
        _close(dest)
        return None

    def _open_dest_read_only(self, factory):
        if _make_read_only(factory) is None:
            raise UsageError('--dry-run: the destination storage type cannot be opened '
                             'read-only, so a dry run could write to it')
        try:
            dest = factory.open()
        except Exception as exc:  # pylint:disable=broad-except
            # Typically it does not exist yet (no file, no schema).
            self.say('Dry run: the destination cannot be opened read-only (%s); '
                     'treating it as empty.' % redact_secrets(_one_line(exc)))
            return None
        from .storage.earlier import EarlierReleaseStorage
        if isinstance(dest, EarlierReleaseStorage):
            # Read-only, it opens; for the copy it would be refused.
            _close(dest)
            raise Failure('the destination %s holds the schema of an earlier RelStorage '
                          'release, which this release does not write to; copy into a '
                          'new database' % redact_secrets(dest.adapter.describe()))
        return dest

    def _clear(self, factory, dest):
        if not copy.is_relstorage(dest):
            _close(dest)
            raise UsageError('--clear works only with a RelStorage destination; %s '
                             'is a %s' % (_name(dest), type(dest).__name__))
        if not dest.options.create_schema:
            _close(dest)
            raise UsageError('--clear needs create-schema true in the destination '
                             'section (the schema is dropped and created again)')
        self.say('Clearing %s' % _name(dest))
        adapter = dest.adapter
        options = dest.options
        dest.close()
        try:
            adapter.drop_all()
        except Exception as exc:
            if adapter.refusal(exc) is None:
                raise
            refused = _one_line(adapter.refusal(exc))
        else:
            refused = None
        if refused is not None:
            # (A helper agent's check: the driver's bare "must be owner of
            # table blob_chunk".)
            raise Failure('cannot clear %s: %s (--clear drops and creates RelStorage\'s '
                          'tables: run it as a user that may, such as the schema\'s owner)'
                          % (redact_secrets(adapter.describe()), refused))
        if options.blob_dir:
            # Its blobs went with the database, which the directory was
            # bound to (a review finding: the new database, with a key of
            # its own, was refused the directory; a helper agent's check:
            # so was a cache's, which names its database too).
            if options.shared_blob_dir:
                from relstorage.blobs.shared import clear_directory
            else:
                from relstorage.blobs.cached import clear_directory
            clear_directory(options.blob_dir)
        return open_storage(factory, 'destination')

    # ------------------------------------------------------------------

    def convert(self, source, dest):
        args = self.args
        source_last = u64(source.lastTransaction())
        dest_last = u64(dest.lastTransaction()) if dest is not None else 0
        if dest is not None and _holds_data(dest) and not args.incremental:
            if args.verify and not args.clear:
                self.verify_only(source, dest, source_last, dest_last)
                return
            raise Failure(
                'the destination is not empty (last transaction %s). Nothing was '
                'written. Use --incremental to copy only the newer transactions '
                '(this also resumes an interrupted copy), or --clear to empty a '
                'RelStorage destination first.' % _tid(dest_last))
        if dest_last:
            self._check_incremental(source, dest, source_last, dest_last)
        history_free, adapter_class = self._history_free(dest)
        bulk = False
        if args.strategy == copy.CURRENT and dest_last:
            raise UsageError(
                '--strategy current copies into an empty destination only; resuming '
                "with --incremental replays the transactions after the destination's "
                'last one (leave --strategy out)')
        if history_free and not dest_last and source_last > dest_last:
            try:
                strategy, why, _ = copy.choose_strategy(source, adapter_class, args.strategy)
            except copy.CopyError as exc:
                raise UsageError(str(exc)) from exc
            bulk = strategy == copy.CURRENT
            self.say('History-free destination: %s: %s.' % (
                'copying only the current records' if bulk
                else 'replaying the transactions', why))
        stats = copy.Stats()
        verb = 'Would copy' if args.dry_run else 'Copied'
        if source_last <= dest_last:
            self.say('Nothing to copy: the destination is up to date (last transaction %s).'
                     % _tid(dest_last))
            marked = None if args.dry_run else copy.relstorage_under(dest)
            # (Not a destination opened read-only, to verify it: a helper
            # agent's check saw "ReadOnlyError" instead of the verification.)
            if marked is not None and not marked.isReadOnly():
                # (A copy killed after its last batch, before it said it
                # had finished: packs wait for that.)
                marked.mark_copy(None)
        elif bulk:
            self.say('%s the current objects as of %s (history-free destination: '
                     'no history, no transaction metadata)'
                     % ('Would copy' if args.dry_run else 'Copying', _tid(source_last)))
            total = {}
            progress = Progress(self.stderr, 'copying', enabled=self.show_progress,
                                fraction=lambda s: s.records / total['n'] if total.get('n')
                                else None)
            try:
                copy.copy_current(source, dest, source_last, progress=progress,
                                  dry_run=args.dry_run, stats=stats,
                                  on_scan=lambda n: total.__setitem__('n', n))
            finally:
                progress.finish()
            self.say(_summary(stats, verb).replace('transactions', 'transaction ids'))
        else:
            start = p64(dest_last + 1) if dest_last else None
            if dest_last:
                self.say('%s the transactions after %s' % (
                    'Would copy' if args.dry_run else 'Copying', _tid(dest_last)))
            progress = Progress(self.stderr, 'copying', enabled=self.show_progress,
                                fraction=_tid_fraction(source, dest_last, source_last))
            try:
                # Up to the source's last transaction when it was opened:
                # a FileStorage's iterator reads on into what a writer
                # appends meanwhile, which --verify, comparing with the
                # source as opened, then found newer in the destination (a
                # helper agent's check, a live site's cron copy).  Not a
                # history-free RelStorage's: its iterator reads one
                # snapshot, where an object changed since the open is
                # listed under its new transaction only, after that last
                # one (a helper agent's check: such objects were never
                # copied, and the copy referred to missing objects).
                last = None if copy.is_history_free(source) else p64(source_last)
                copy.copy_transactions(source, dest, start, progress=progress,
                                       dry_run=args.dry_run, stats=stats, last=last)
            finally:
                progress.finish()
            self.say(_summary(stats, verb))
            if stats.renumbered:
                self.say('Warning: %d source transactions were out of order and were '
                         'given new ids; --incremental cannot resume past them.'
                         % stats.renumbered)
        if args.dry_run:
            self.say('Dry run: nothing was written.')
            if args.verify:
                self.say('--verify skipped: a dry run copies nothing.')
            return
        if source_last > dest_last:
            _refresh_statistics(dest)
        if args.verify:
            self.verify(source, dest)

    def _check_incremental(self, source, dest, source_last, dest_last):
        if dest_last > source_last:
            raise Failure(
                "the destination's last transaction %s is newer than the source's "
                "(%s): it was not copied from this source, or was written to since. "
                "Use --clear to start over." % (_tid(dest_last), _tid(source_last)))
        if copy.is_history_free(source):
            # A history-free source lists only the tids of current objects, so
            # an older tid may have vanished from it; nothing to check.
            return
        first = None
        differs = None
        iterator = source.iterator(p64(dest_last), p64(dest_last))
        try:
            for txn in iterator:
                first = txn.tid
                differs = _first_difference(
                    txn, dest, source if copy.is_history_free(dest) else None)
                break
        finally:
            close = getattr(iterator, 'close', None)
            if close is not None:
                close()
        if first != p64(dest_last):
            raise Failure(
                "the destination's last transaction %s is not in the source, so "
                "--incremental cannot tell what is missing (a different source, or one "
                "packed since). Use --clear to copy everything again." % _tid(dest_last))
        if differs is not None:
            raise Failure(
                "the destination's last transaction %s is not the source's transaction "
                "of that id (object %s %s): the destination was written to since it was "
                "copied, or comes from another source. --incremental would skip the "
                "source's transaction. Use --clear to copy everything again."
                % (_tid(dest_last), oid_repr(differs[0]), differs[1]))

    def verify_only(self, source, dest, source_last, dest_last):
        """--verify on a destination that is not empty: compare, write nothing."""
        self.say('The destination is not empty (last transaction %s): comparing it '
                 'with the source; nothing is written.' % _tid(dest_last))
        self.verify(source, dest)
        if source_last > dest_last:
            raise Failure(
                "the source has transactions after the destination's last one (%s): "
                "the destination is behind. Run with --incremental to copy them."
                % _tid(dest_last))

    def verify(self, source, dest):
        as_of = u64(dest.lastTransaction())
        progress = Progress(self.stderr, 'verifying', enabled=self.show_progress)
        try:
            if copy.is_history_free(dest) or copy.is_history_free(source):
                # Only current objects are comparable.
                stats = copy.verify_current(source, dest, as_of, progress=progress)
                what = 'objects'
                count = stats.records
            else:
                stats = copy.verify_history(source, dest, progress=progress,
                                            stop=p64(as_of))
                what = 'transactions (%d records)' % stats.records
                count = stats.transactions
        finally:
            progress.finish()
        text = 'Verified: %d %s identical' % (count, what)
        if stats.blobs:
            text += ', %d blobs' % stats.blobs
        self.say(text + ' (%s).' % _duration(stats.elapsed))


def _refresh_statistics(dest):
    """After a copy into a RelStorage: fresh statistics for its planner
    (see Adapter.refresh_statistics).  Only a help: a failure (a user who
    may not, a server refusing) is logged, not the copy's."""
    refresh = getattr(dest, 'refresh_statistics', None)
    if refresh is None:
        return
    try:
        refresh()
    except Exception as exc:  # pylint:disable=broad-except
        log.info("Could not refresh the destination's planner statistics: %s",
                 _one_line(exc))


# How many records of the destination's last transaction --incremental
# compares with the source's (a different commit that got the same tid
# differs in its first records; a resume need not read a huge one whole).
COMPARED_RECORDS = 1000


def _first_difference(txn, dest, history_free_from=None):
    """(oid, what) of the first record of the source's transaction ``txn``
    that the destination does not hold as it, or None.  Two commits get
    the same tid where clocks lag behind the last tid (a source written
    by a clock ahead of time, then a commit to the destination: a helper
    agent's check found --incremental then skipped the source's
    transaction, leaving a reference to an object never copied)."""
    for count, record in enumerate(txn):
        if count >= COMPARED_RECORDS:
            break
        if record.data is None:
            continue            # (an undone creation: nothing to load)
        try:
            data = dest.loadSerial(record.oid, record.tid)
        except POSKeyError:
            if history_free_from is not None and _replaced(history_free_from, record):
                # A history-free destination holds a record of this
                # transaction only while it is current; one copied with
                # --strategy current and interrupted, not those a later
                # source transaction replaced (a helper agent's check: the
                # resume was refused).
                continue
            return record.oid, 'is missing there'
        if data != record.data:
            return record.oid, 'differs'
    return None


def _replaced(source, record):
    """Whether the source has a revision of the record's object after it."""
    try:
        return source.getTid(record.oid) != record.tid
    except POSKeyError:
        return True


def _check_not_same(source, dest):
    """Refuse a destination that is the source itself (--clear would
    empty it before anything is read)."""
    if not (copy.reads_relstorage(source) and copy.is_relstorage(dest)):
        return
    from .adapters.base import same_database
    if same_database(source.adapter.database_identity(), dest.adapter.database_identity()):
        raise UsageError('the source and the destination are the same database (%s); '
                         'nothing was written' % _name(dest))


def _blob_dir_of(storage):
    """The real path of the directory ``storage`` keeps blob files in
    (a FileStorage's, ZODB's blob wrappers', RelStorage's; ZEO's cache), or
    None."""
    helper = getattr(storage, 'fshelper', None)
    path = getattr(helper, 'base_dir', None) or getattr(storage, 'blob_dir', None)
    return os.path.realpath(path) if isinstance(path, str) and path else None


def _check_blob_dirs_apart(source, dest_factory):
    """Refuse a destination whose blob-dir is the source's blob directory,
    or inside it, or holds it, before the destination is opened (a helper
    agent's check: with a FileStorage's blob-dir given to the destination
    as its shared blob-dir, --clear removed the source's blob files, and a
    copy wrote into the source's directory)."""
    theirs = _blob_dir_of(source)
    ours = getattr(getattr(dest_factory, 'config', None), 'blob_dir', None)
    if not theirs or not ours:
        return
    ours = os.path.realpath(ours)
    if theirs == ours or ours.startswith(theirs + os.sep) or theirs.startswith(ours + os.sep):
        raise UsageError('the destination\'s blob-dir %s %s the source\'s blob directory %s; '
                         'the source would be written to (and, with --clear, emptied): give '
                         'the destination a blob-dir of its own. Nothing was written.'
                         % (ours, 'is' if theirs == ours else 'overlaps', theirs))


def _holds_data(storage):
    return bool(u64(storage.lastTransaction())) or _has_objects(storage)


def _has_objects(storage):
    try:
        return len(storage) > 0
    except Exception:  # pylint:disable=broad-except
        return False


def _tid(tid_int):
    return tid_repr(p64(tid_int))


def _tid_fraction(source, first, last):
    """Progress estimate from the position of the tids in time (cheap, generic)."""
    if not last or last <= first:
        return None
    if not first:
        # A whole copy: start from the source's first transaction.
        iterator = source.iterator()
        try:
            for txn in iterator:
                first = u64(txn.tid)
                # (Not held when the iterator closes: a RelStorage's would
                # read its records, perhaps a large first import.)
                del txn
                break
        finally:
            close = getattr(iterator, 'close', None)
            if close is not None:
                close()
    span = float(last - first) or 1.0

    def fraction(stats):
        if stats.last_tid is None:
            return None
        return min(max((u64(stats.last_tid) - first) / span, 0.0), 1.0)
    return fraction


if __name__ == '__main__':
    sys.exit(main())
