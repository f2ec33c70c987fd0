"""zodbpack from the command line, on SQLite."""
import io
import os
import sys
import shutil
import tempfile
import threading
import unittest
from contextlib import redirect_stderr
from contextlib import redirect_stdout
from unittest import mock

import zodbpickle.pickle
import ZODB
import ZODB.config
from persistent.mapping import PersistentMapping
from ZODB.POSException import POSKeyError
from ZODB.serialize import referencesf
from ZODB.utils import p64

from relstorage import zodbpack

CONFIG = """
%%import relstorage
<relstorage main>
  pack-gc %s
  <sqlite3>
    data-dir %s
  </sqlite3>
</relstorage>
"""


#: A zope.conf as a Plone buildout writes it (abridged).
ZOPE_CONF = """\
%define INSTANCEHOME /srv/plone/parts/instance
%import a_package_only_the_application_has
instancehome $INSTANCEHOME
%define CLIENTHOME /srv/plone/var
clienthome $CLIENTHOME
debug-mode off
security-policy-implementation C
verbose-security off
default-zpublisher-encoding utf-8
<environment>
    CHAMELEON_CACHE /srv/plone/var/cache
</environment>
<eventlog>
  level INFO
  <logfile>
    path /srv/plone/var/log/instance.log
    level INFO
  </logfile>
</eventlog>
<zodb_db main>
    # Main database
    cache-size 30000
    %import relstorage
    <relstorage>
        keep-history false
        pack-gc true
        <sqlite3>
            data-dir $CLIENTHOME/data
        </sqlite3>
    </relstorage>
    mount-point /
</zodb_db>
<zodb_db temporary>
    # Temporary storage database (for sessions)
    <temporarystorage>
      name temporary storage for sessioning
    </temporarystorage>
    mount-point /temp_folder
    container-class Products.TemporaryFolder.TemporaryContainer
</zodb_db>
python-check-interval 1000
"""


class ZodbpackTests(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix='relstoragetest_')
        self.data_dir = os.path.join(self.tmp, 'data')

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def write_config(self, gc=True):
        path = os.path.join(self.tmp, 'pack.conf')
        with open(path, 'w') as f:
            f.write(CONFIG % ('true' if gc else 'false', self.data_dir))
        return path

    def test_pack_removes_history_and_garbage(self):
        conf = self.write_config()
        db = ZODB.DB(ZODB.config.storageFromFile(open(conf)))
        with db.transaction() as conn:
            conn.root()['keep'] = PersistentMapping(v=1)
            conn.root()['drop'] = PersistentMapping(v=1)
        with db.transaction() as conn:
            conn.root()['keep']['v'] = 2
            dropped_oid = conn.root()['drop']._p_oid
            first_serial = conn.root()['keep']._p_serial
            del conn.root()['drop']
        storage = db.storage
        keep_oid = None
        with db.transaction() as conn:
            keep_oid = conn.root()['keep']._p_oid
        old = [h['tid'] for h in storage.history(keep_oid, 10)]
        self.assertEqual(len(old), 2)
        db.close()

        # Without -d, a day of history is kept, as earlier releases kept
        # it (a helper agent's check: an unchanged crontab line packed to
        # now and left nothing to undo).
        self.assertEqual(zodbpack.main(['-q', conf]), 0)
        storage = ZODB.config.storageFromFile(open(conf))
        try:
            self.assertEqual(len(storage.history(keep_oid, 10)), 2)
            storage.load(dropped_oid)
        finally:
            storage.close()
        # A negative number packs to now, as earlier releases took it.
        self.assertEqual(zodbpack.main(['-q', '-d', '-1', conf]), 0)

        storage = ZODB.config.storageFromFile(open(conf))
        try:
            self.assertEqual(len(storage.history(keep_oid, 10)), 1)
            with self.assertRaises(POSKeyError):
                storage.load(dropped_oid)
            self.assertEqual(len(storage), 2)     # root and 'keep'
        finally:
            storage.close()

    def test_progress_on_a_terminal_that_reports_no_size(self):
        # A helper agent's check: on a pty of 0 rows and columns, the
        # phases showed only blank lines (tqdm draws nothing on a screen of
        # 0 rows).
        import pty
        import subprocess
        conf = self.write_config()
        db = ZODB.DB(ZODB.config.storageFromFile(open(conf)))
        with db.transaction() as conn:
            conn.root()['g'] = PersistentMapping({i: PersistentMapping() for i in range(50)})
        with db.transaction() as conn:
            del conn.root()['g']
        db.close()
        main, child = pty.openpty()         # a new pty: 0 x 0
        try:
            proc = subprocess.Popen(
                [sys.executable, '-c', 'import sys; from relstorage.zodbpack import main; '
                 'sys.exit(main(["-d", "0", sys.argv[1]]))', conf],
                stdin=child, stdout=child, stderr=child, close_fds=True)
            os.close(child)
            child = None
            output = b''
            while True:
                try:
                    chunk = os.read(main, 4096)
                except OSError:         # (the child closed its side)
                    break
                if not chunk:
                    break
                output += chunk
            self.assertEqual(proc.wait(60), 0, output)
        finally:
            os.close(main)
            if child is not None:
                os.close(child)
        self.assertIn(b'analysing references', output)
        self.assertIn(b'deleting', output)

    def test_bad_config_is_a_usage_error(self):
        path = os.path.join(self.tmp, 'bad.conf')
        with open(path, 'w') as f:
            f.write(CONFIG.replace('pack-gc', 'pack-gcc') % ('true', self.data_dir))
        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(zodbpack.main([path]), 2)
        self.assertIn('pack-gcc', err.getvalue())
        self.assertFalse(os.path.exists(self.data_dir))

    def test_bad_value_in_a_zodb_section_is_one_line(self):
        # A helper agent's check: a bad value in a plain <zodb> file was
        # preceded by "... is not a file of storages only (...); packing
        # the RelStorage databases of its <zodb_db> sections", as if it
        # were a zope.conf.
        path = os.path.join(self.tmp, 'bad.conf')
        for line in ('pack-duty-cycle 2', 'pack-dutycycle 0.5'):
            with self.subTest(line=line):
                with open(path, 'w') as f:
                    f.write('%%import relstorage\n<zodb main>\n <relstorage>\n  %s\n'
                            '  <sqlite3>\n   data-dir %s\n  </sqlite3>\n </relstorage>\n'
                            '</zodb>\n' % (line, self.data_dir))
                err = io.StringIO()
                with redirect_stderr(err):
                    self.assertEqual(zodbpack.main([path]), 2)
                self.assertEqual(len(err.getvalue().strip().splitlines()), 1, err.getvalue())
                self.assertIn(line.split()[0], err.getvalue())
                self.assertNotIn('not a file of storages only', err.getvalue())

    def test_a_zope_conf_whose_storage_comes_through_include(self):
        # A helper agent's check: a <zodb_db> whose <relstorage> came in
        # through %include (and <zodb_db> sections in an included file)
        # were left out without a word: zodbpack packed the others, exit 0.
        os.mkdir(os.path.join(self.tmp, 'var'))
        os.mkdir(os.path.join(self.tmp, 'etc'))
        storage_conf = os.path.join(self.tmp, 'etc', 'main-storage.conf')
        text = ZOPE_CONF.replace('/srv/plone', self.tmp)
        start = text.index('    %import relstorage')
        end = text.index('    mount-point /\n')
        with open(storage_conf, 'w') as f:
            f.write(text[start:end])
        main_db = text.replace(text[start:end], '    %include etc/main-storage.conf\n')
        section = '<sqlite3>\n data-dir %s\n</sqlite3>' % os.path.join(self.tmp, 'var', 'data')
        databases = os.path.join(self.tmp, 'databases.conf')
        db_start = main_db.index('<zodb_db main>')
        db_end = main_db.index('python-check-interval')
        with open(databases, 'w') as f:
            f.write(main_db[db_start:db_end].replace('etc/main-storage.conf',
                                                     'file://' + storage_conf))
        with_define = ('%%define ETC %s\n' % os.path.join(self.tmp, 'etc')) + main_db.replace(
            '%include etc/main-storage.conf', '%include $ETC/main-storage.conf')
        for name, content in (('zope.conf', main_db),
                              ('zope-top.conf', main_db[:db_start] + '%include databases.conf\n'
                               + main_db[db_end:]),
                              # (A review finding: a path with a %define'd name.)
                              ('zope-define.conf', with_define)):
            with self.subTest(name):
                conf = os.path.join(self.tmp, name)
                with open(conf, 'w') as f:
                    f.write(content)
                dropped = self._commit_garbage(section)
                out = io.StringIO()
                with redirect_stdout(out), redirect_stderr(io.StringIO()):
                    self.assertEqual(zodbpack.main(['-d', '0', conf]), 0)
                self.assertIn('removed 1 objects', out.getvalue())
                self._assert_gone(section, dropped)

    def _commit_garbage(self, section):
        db = ZODB.config.databaseFromString(
            '%%import relstorage\n<zodb>\n<relstorage>\nkeep-history false\n%s\n'
            '</relstorage>\n</zodb>\n' % section)
        try:
            with db.transaction() as conn:
                conn.root()['drop'] = PersistentMapping(v=1)
            with db.transaction() as conn:
                dropped = conn.root()['drop']._p_oid
                del conn.root()['drop']
        finally:
            db.close()
        return dropped

    def _assert_gone(self, section, oid):
        db = ZODB.config.databaseFromString(
            '%%import relstorage\n<zodb>\n<relstorage>\nkeep-history false\n%s\n'
            '</relstorage>\n</zodb>\n' % section)
        try:
            with self.assertRaises(POSKeyError):
                db.storage.load(oid)
        finally:
            db.close()

    def test_a_whole_zope_conf(self):
        # A helper agent's check: zodbpack stopped at zope.conf's first
        # Zope key ("'instancehome' is not a known key name"), while its
        # help says the application's configuration will do.  Of such a
        # file, the RelStorage databases are packed.
        conf = os.path.join(self.tmp, 'zope.conf')
        os.mkdir(os.path.join(self.tmp, 'var'))
        with open(conf, 'w') as f:
            f.write(ZOPE_CONF.replace('/srv/plone', self.tmp))
        section = '<sqlite3>\n data-dir %s\n</sqlite3>' % os.path.join(self.tmp, 'var', 'data')
        dropped = self._commit_garbage(section)
        out = io.StringIO()
        with redirect_stdout(out):
            self.assertEqual(zodbpack.main(['-d', '0', conf]), 0)
        self.assertIn('removed 1 objects', out.getvalue())
        self._assert_gone(section, dropped)
        # A database that cannot be opened is named by its <zodb_db>
        # section (a helper agent's check: "cannot open storage (unnamed)").
        with open(conf, 'w') as f:
            f.write(ZOPE_CONF.replace('/srv/plone', self.tmp).replace(
                'keep-history false', 'keep-history true'))
        err = io.StringIO()
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            self.assertEqual(zodbpack.main(['-d', '0', conf]), 1)
        self.assertIn('cannot open storage main:', err.getvalue())
        # A mistake in its RelStorage section is still reported as such.
        with open(conf, 'w') as f:
            f.write(ZOPE_CONF.replace('/srv/plone', self.tmp).replace(
                'keep-history false', 'keep-histroy false'))
        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(zodbpack.main([conf]), 2)
        self.assertIn('keep-histroy', err.getvalue())
        # After a word on the rest of the file; a bad value is reported on
        # the file's own line.
        self.assertIn('is not a file of storages only', err.getvalue())
        with open(conf, 'w') as f:
            f.write(ZOPE_CONF.replace('/srv/plone', self.tmp).replace(
                'keep-history false', 'keep-history maybe'))
        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(zodbpack.main([conf]), 2)
        line = ZOPE_CONF.splitlines().index('        keep-history false') + 1
        self.assertIn('line %d' % line, err.getvalue())
        # A helper agent's checks: <relstorag> misspelt there was reported
        # as "'instancehome' is not a known key name"; in a plain <zodb>
        # file, in two lines; an unknown key, without its line.
        for text, expected in (
                (ZOPE_CONF.replace('<relstorage>', '<relstorag>').replace(
                    '</relstorage>', '</relstorag>'),
                 'no <zodb_db> section holds a <relstorage> section (they hold <relstorag>'),
                ('%import relstorage\n<zodb>\n <relstorag>\n </relstorag>\n</zodb>\n',
                 "unknown type name: 'relstorag' (line 3 of %s)" % conf),
                # (A review finding: an error inside a database section
                # that holds no <relstorage> is its own.)
                ('<zodb>\n <filestorage>\n  path %s/x.fs\n  bogus-key 1\n </filestorage>\n'
                 '</zodb>\n' % self.tmp,
                 "'bogus-key' is not a known key name (line 4 of %s)" % conf),
                ('%%import relstorage\n<relstorage>\n keep-histroy false\n<sqlite3>\n'
                 'data-dir %s\n</sqlite3>\n</relstorage>\n' % self.data_dir,
                 "'keep-histroy' is not a known key name (line 3 of %s)" % conf)):
            with self.subTest(expected=expected):
                with open(conf, 'w') as f:
                    f.write(text.replace('/srv/plone', self.tmp))
                err = io.StringIO()
                with redirect_stderr(err):
                    self.assertEqual(zodbpack.main(['-q', conf]), 2)
                self.assertEqual(len(err.getvalue().strip().splitlines()), 1, err.getvalue())
                self.assertIn(expected, err.getvalue())
        # (A review finding: a file of Latin-1 text was a traceback.)
        with open(conf, 'wb') as f:
            f.write(b'# caf\xe9\n<zodb>\n</zodb>\n')
        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(zodbpack.main(['-q', conf]), 2)
        self.assertIn('%s is not UTF-8 text' % conf, err.getvalue())

    def usage_error(self, *argv):
        err = io.StringIO()
        with redirect_stderr(err), self.assertRaises(SystemExit) as raised:
            zodbpack.main(list(argv))
        self.assertEqual(raised.exception.code, 2)
        return err.getvalue()

    def test_a_read_only_storage_is_named_as_such(self):
        # A helper agent's check: "zodbpack: <name>: ReadOnlyError", the
        # bare class name.
        conf = self.write_config()
        ZODB.config.storageFromFile(open(conf)).close()     # (the schema)
        with open(conf) as f:
            text = f.read()
        with open(conf, 'w') as f:
            f.write(text.replace('  pack-gc', '  read-only true\n  pack-gc'))
        for extra in ([], ['--prepack']):
            err = io.StringIO()
            with redirect_stderr(err), redirect_stdout(io.StringIO()):
                self.assertEqual(zodbpack.main(['-q'] + extra + [conf]), 1)
            self.assertIn('read-only true', err.getvalue())

    def test_days_out_of_range_are_usage_errors(self):
        # A helper agent's check: 1e9, nan and inf got past the command
        # line and failed later (exit 1) with the time library's words.
        conf = self.write_config()
        for days in ('1e9', 'nan', 'inf'):
            with self.subTest(days=days):
                self.assertIn('--days must be a number up to',
                              self.usage_error('-d', days, conf))
        self.assertFalse(os.path.exists(self.data_dir))

    def test_days_with_the_prepack_state_are_refused(self):
        # The pack time is the --prepack analysis's: -d was ignored.
        conf = self.write_config()
        self.assertIn('does not apply to --use-prepack-state',
                      self.usage_error('--use-prepack-state', '-d', '3', conf))

    def test_help_tells_the_pacing_options(self):
        out = io.StringIO()
        with redirect_stdout(out), self.assertRaises(SystemExit):
            zodbpack.main(['--help'])
        for key in ('pack-duty-cycle', 'pack-max-delay', 'pack-batch-timeout',
                    'pack-commit-busy-delay', 'crontab'):
            self.assertIn(key, out.getvalue())


class PausesTests(unittest.TestCase):
    """The pauses between deletion batches (pack-duty-cycle): the pack's
    own work after a batch counts as pause, and what it took beyond the
    pause that batch asked for counts toward the next pauses, up to
    PAUSE_CREDIT_MAX, so that the pack holds the lock no more than the
    duty cycle allows, on average, and no less."""

    def run_batches(self, batches, duty=0.5):
        """``batches``: (held, own work after it) in seconds; returns the
        share of the time the lock was held, and each pause slept."""
        from relstorage.storage import pack
        from relstorage.options import Options
        clock = [1000.0]
        slept = []

        def sleep(seconds):
            slept.append(round(seconds, 6))
            clock[0] += seconds
        pauses = pack._Pauses(Options(pack_duty_cycle=duty))
        with mock.patch.object(pack.time, 'monotonic', lambda: clock[0]), \
                mock.patch.object(pack.time, 'sleep', sleep):
            for held, work in batches:
                clock[0] += held
                until = pauses.until(clock[0], held)
                clock[0] += work
                pauses.sleep(until)
        return sum(held for held, _ in batches) / (clock[0] - 1000.0), slept

    def test_own_work_counts_as_pause(self):
        share, slept = self.run_batches([(0.001, 0.0004)] * 3)
        self.assertEqual(slept, [0.0006] * 3)
        self.assertAlmostEqual(share, 0.5)

    def test_work_beyond_a_pause_shortens_the_next_ones(self):
        # After a batch followed by 10 ms of the pack's own work (SQLite:
        # what the batches removed leaves the pack's tables; a checkpoint),
        # the next batches need no pause until the 9 ms beyond are made up.
        share, slept = self.run_batches([(0.001, 0.010)] + [(0.001, 0.0)] * 12)
        self.assertEqual(slept, [0.001] * 3)
        self.assertAlmostEqual(share, 0.5)

    def test_credit_is_bounded(self):
        # A long stall (a slow disk) does not let the pack hold the lock
        # back to back for as long afterwards.
        from relstorage.storage import pack
        share, slept = self.run_batches([(0.001, 5.0)] + [(0.001, 0.0)] * 200)
        free = int(pack.PAUSE_CREDIT_MAX / 0.001)
        self.assertEqual(len(slept), 200 - free)
        self.assertLess(share, 0.5)

    def test_duty_cycle_one_never_pauses(self):
        share, slept = self.run_batches([(0.001, 0.0)] * 5, duty=1.0)
        self.assertEqual(slept, [])
        self.assertAlmostEqual(share, 1.0)


class ReferencesTests(unittest.TestCase):
    """The analysis reads references with ZODB's referencesf, or with a
    cheaper equivalent when that is the function it was given: the
    equivalent returns what ZODB's does for every form of reference."""

    def pickle_with(self, refs):
        class Ref:
            def __init__(self, pid):
                self.pid = pid

        class Writer(zodbpickle.pickle.Pickler):
            def persistent_id(self, obj):
                return obj.pid if isinstance(obj, Ref) else None

        out = io.BytesIO()
        writer = Writer(out, 3)
        writer.dump((PersistentMapping, None))
        writer.dump({'data': {i: Ref(pid) for i, pid in enumerate(refs)}})
        return out.getvalue()

    def test_same_references_as_zodb(self):
        from relstorage.storage import pack
        oid, other = p64(7), p64(0x1234567890)
        forms = [
            [],
            [oid],                                  # the OID alone
            [(oid, PersistentMapping)],             # with its class
            ['w', (oid,)],                          # a str, then a tuple
            [['w', (oid,)], ['m', ('other', oid, PersistentMapping)], ['n', ('other', oid)]],
            [oid.decode('latin-1')],                # an OID unpickled as str
            [(other, None), oid, ['w', (other,)]],
        ]
        reader = pack._reference_reader(referencesf)
        self.assertIsInstance(reader, pack._ZODBReferences)
        for refs in forms + forms[::-1]:
            with self.subTest(refs=refs):
                state = self.pickle_with(refs)
                self.assertEqual(pack._zodb_references(state), referencesf(state))
                # One reader for every state of an analysis: nothing of a
                # state read before shows in the next one.
                self.assertEqual(reader(state), referencesf(state))
        garbled = self.pickle_with([oid])[:-5]
        with self.assertRaises(Exception):
            referencesf(garbled)
        with self.assertRaises(Exception):
            pack._zodb_references(garbled)

    def test_damaged_state_without_a_reference_byte_stops_the_pack(self):
        # However little of a state is left, it is read whole: a damaged
        # state may have lost the very reference that keeps an object
        # alive (a skip of states without a persistent-id opcode byte,
        # tried and withdrawn, answered "no references" for these).
        from relstorage.storage import pack
        plain, with_ref, damaged = self.damaged_states()
        self.assertEqual(pack._references(pack._zodb_references, 5, 9, plain), ())
        reader = pack._reference_reader(referencesf)
        for state in damaged:
            with self.subTest(state=state):
                with self.assertRaisesRegex(pack.PackError, '0x5 at transaction 0x9'):
                    pack._references(pack._zodb_references, 5, 9, state)
                # The same with the reader of an analysis, which reads
                # the next state as if it were its first.
                self.assertEqual(pack._references(reader, 5, 8, with_ref), [7])
                with self.assertRaisesRegex(pack.PackError, '0x5 at transaction 0x9'):
                    pack._references(reader, 5, 9, state)
                self.assertEqual(pack._references(reader, 5, 10, with_ref), [7])

    def test_reference_of_another_length_stops_the_pack(self):
        # (u64 refused it; int.from_bytes would take it.)
        from relstorage.storage import pack
        state = self.pickle_with([b'abc'])
        with self.assertRaisesRegex(pack.PackError, '0x5 at transaction 0x9.*3 bytes'):
            pack._references(pack._zodb_references, 5, 9, state)

    def damaged_states(self):
        """(plain, with_ref, damaged states) for the tests of damage."""
        plain = self.pickle_with([])
        data = plain.find(b'.\x80') + 1
        with_ref = self.pickle_with([p64(7)])
        text = io.BytesIO()
        zodbpickle.pickle.Pickler(text, 3).dump((PersistentMapping, None))
        zodbpickle.pickle.Pickler(text, 3).dump({'data': {'host': 'www.example.org'}})
        text = text.getvalue()
        return plain, with_ref, [
            text[:text.index(b'www.') + 4],             # cut short just after a '.'
            with_ref.replace(b'Q', b'R'),               # its BINPERSID changed
            plain[:data] + b'\x80\x03\xff\xfe\xfd.',   # a known class, garbage after
            with_ref[:-1],                              # its last STOP lost
            plain[:data],                               # the class alone
        ]

    def test_states_read_in_one_pass_give_what_each_gives_alone(self):
        # The analysis reads a thousand states at a time from one stream
        # (_ZODBReferences.many): the same result for each as alone,
        # whatever comes before or after it.
        from relstorage.storage import pack
        oid = p64(7)
        forms = [[], [oid], [(oid, PersistentMapping)], [['w', (oid,)]],
                 [oid.decode('latin-1')], [(p64(0x1234567890), None), oid, ['w', (p64(3),)]]]
        states = [self.pickle_with(refs) for refs in forms]
        # A state with bytes after its second pickle reads alone (the
        # bytes are ignored): the same in one pass.
        states.append(states[1] + b'trailing')
        states = states + [None] + states[::-1]
        reader = pack._reference_reader(referencesf)
        self.assertEqual(reader.many(states),
                         [None if s is None else referencesf(s) for s in states])
        rows = [(i, 100 + i, state) for i, state in enumerate(states)]
        self.assertEqual(pack._references_of_rows(reader, rows),
                         [pack._references(pack._zodb_references, *row) for row in rows])
        self.assertEqual(pack._references_of_rows(referencesf, rows),
                         [pack._references(pack._zodb_references, *row) for row in rows])
        # States as a driver may give them: a memoryview (psycopg2), or
        # a type of its own that converts itself.

        class Blob:
            def __init__(self, data):
                self.data = data

            def __bytes__(self):
                return self.data
        for wrap in (memoryview, Blob):
            wrapped = [(oid, tid, None if state is None else wrap(state))
                       for oid, tid, state in rows]
            self.assertEqual(pack._references_of_rows(reader, wrapped),
                             [pack._references(pack._zodb_references, *row) for row in rows])
        # In several streams when the states are larger than one takes.
        with mock.patch.object(pack, 'JOINED_BYTES', 300):
            self.assertEqual(reader.many(states),
                             [None if s is None else referencesf(s) for s in states])

    def test_malformed_reference_read_in_one_pass_names_its_state(self):
        # A helper agent's review: a state that unpickles, but whose
        # persistent id is no reference, raised a bare error from the
        # joined read where alone it gave a PackError naming the state.
        from relstorage.storage import pack
        reader = pack._reference_reader(referencesf)
        good = self.pickle_with([p64(7)])
        for pid in [(), 5, (5, None), 'd\xe9j\xe0']:
            for state in (self.pickle_with([pid]), self.pickle_with([pid]) + b'trailing'):
                with self.subTest(pid=pid, state=state):
                    rows = [(1, 10, good), (2, 20, state), (3, 30, good)]
                    with self.assertRaisesRegex(pack.PackError, '0x2 at transaction 0x14'):
                        pack._references_of_rows(reader, rows)
                    with self.assertRaisesRegex(pack.PackError, '0x2 at transaction 0x14'):
                        pack._references(reader, *rows[1])
        # A value the driver gave that is no bytes at all.
        with self.assertRaisesRegex(pack.PackError, '0x2 at transaction 0x14'):
            pack._references_of_rows(reader, [(1, 10, good), (2, 20, 'text')])

    def test_damaged_state_read_in_one_pass_stops_the_pack(self):
        # A state cut short would read on into the next state in the
        # joined stream: it is named, not taken for part of the next one.
        from relstorage.storage import pack
        plain, with_ref, damaged = self.damaged_states()
        reader = pack._reference_reader(referencesf)
        for state in damaged:
            for before, after in (([], []), ([plain, with_ref], [with_ref, plain]),
                                  ([with_ref], [plain[:plain.find(b'.\x80') + 1] + with_ref])):
                with self.subTest(state=state, before=before, after=after):
                    rows = [(i, 50 + i, s) for i, s in enumerate(before + [state] + after)]
                    with self.assertRaisesRegex(
                            pack.PackError, '0x%x at transaction 0x%x' % (len(before),
                                                                        50 + len(before))):
                        pack._references_of_rows(reader, rows)
                    # The reader goes on reading the next batch.
                    self.assertEqual(pack._references_of_rows(reader, [(1, 2, with_ref)]), [[7]])

    def test_worker_waits_for_its_batch_through_an_interrupt(self):
        # The caller rolls back and closes the connection once join
        # returns: a batch still writing on it would commit half.
        from relstorage.storage import pack
        worker = pack._Worker('relstorage-test')
        self.addCleanup(worker.close)
        release = threading.Event()
        done = []

        def batch():
            release.wait(5)
            done.append(1)
            raise ValueError('the batch failed')
        worker.submit(batch)
        event = worker._done

        class Interrupted:
            waits = 0

            def wait(self):
                self.waits += 1
                if self.waits == 1:
                    release.set()
                    raise KeyboardInterrupt
                if self.waits == 2:
                    # Interrupted again, once the call ended: still waited
                    # for to the end, and its error not lost.
                    event.wait()
                    raise KeyboardInterrupt
                return event.wait()
        worker._done = interrupted = Interrupted()
        with self.assertRaises(KeyboardInterrupt):
            worker.join()
        self.assertEqual((done, interrupted.waits), ([1], 3))
        worker._done = event
        with self.assertRaisesRegex(ValueError, 'the batch failed'):
            worker.wait()
        worker.wait()

    def test_worker_raises_the_error_of_a_call_at_the_next(self):
        from relstorage.storage import pack
        worker = pack._Worker('relstorage-test')

        def fail():
            raise ValueError('the batch failed')
        worker.submit(fail)
        with self.assertRaisesRegex(ValueError, 'the batch failed'):
            worker.submit(print)
        worker.submit(lambda: None)
        worker.wait()
        thread = worker._thread
        worker.close()
        thread.join(5)
        self.assertFalse(thread.is_alive())

    def test_other_referencesf_is_used_as_given(self):
        from relstorage.storage import pack

        def mine(state):
            return []
        self.assertIs(pack._reference_reader(mine), mine)

    def test_other_referencesf_giving_no_oids_stops_the_pack(self):
        # What it returns is checked as ZODB's is: an error names the state.
        from relstorage.storage import pack

        def mine(state):
            return [5]
        with self.assertRaisesRegex(pack.PackError, '0x5 at transaction 0x9'):
            pack._references_of_rows(mine, [(5, 9, b'anything')])


def _test_suite():
    loader = unittest.defaultTestLoader
    return unittest.TestSuite([loader.loadTestsFromTestCase(ZodbpackTests),
                               loader.loadTestsFromTestCase(PausesTests),
                               loader.loadTestsFromTestCase(ReferencesTests)])


def test_suite():
    from . import leaks
    return leaks.checked(_test_suite(), __name__)
