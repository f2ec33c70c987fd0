"""Pack and zodbpack cases, run by make_suite for every database factory.

A factory used here also provides ``zconfig_adapter()``: the adapter
section of a ZConfig file reaching its database (zodbpack reads one).
"""
import os
import shutil
import tempfile
import time

import transaction
import ZODB
from persistent.mapping import PersistentMapping

from relstorage import zodbpack
from relstorage.options import Options

from .core_cases import FactoryCase

#: Tables whose rows are the data a pack may remove.
DATA_TABLES_HP = ('object_state', 'current_object', 'transaction_log', 'blob_chunk')
DATA_TABLES_HF = ('object_state', 'blob_chunk')


class PackCase(FactoryCase):
    """Helpers: a config file for zodbpack, a populated database, row counts."""

    def setUp(self):
        super().setUp()
        self.tmp = tempfile.mkdtemp(prefix='relstoragetest_pack_')
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def write_config(self, storage_options='', wrap_zodb=False):
        body = '<relstorage>\n  keep-history %s\n%s%s</relstorage>\n' % (
            'true' if self.keep_history else 'false',
            ''.join('  %s\n' % line for line in storage_options.splitlines() if line),
            self.factory.zconfig_adapter())
        if wrap_zodb:
            body = '<zodb main>\n%s</zodb>\n' % body
        path = os.path.join(self.tmp, 'pack-%d.conf' % len(os.listdir(self.tmp)))
        with open(path, 'w') as f:
            f.write('%import relstorage\n' + body)
        return path

    def db(self, **kw):
        db = ZODB.DB(self.storage(**kw))
        self.addCleanup(db.close)
        return db

    def populate(self, db):
        """History and garbage: 'keep' changed twice, 'drop' unlinked, and
        'child' reachable only through an old revision of 'keep'."""
        with db.transaction() as conn:
            conn.root()['keep'] = PersistentMapping(v=1)
            conn.root()['drop'] = PersistentMapping(v=1)
            conn.root()['keep']['child'] = PersistentMapping(v='child')
        with db.transaction() as conn:
            conn.root()['keep']['v'] = 2
            child = conn.root()['keep'].pop('child')
            del conn.root()['drop']
        with db.transaction() as conn:
            conn.root()['keep']['v'] = 3
        return child._p_oid

    def row_counts(self):
        tables = DATA_TABLES_HP if self.keep_history else DATA_TABLES_HF
        adapter = self.factory.make_adapter(Options(keep_history=self.keep_history))
        conn = adapter.open_load()
        try:
            return {table: conn.query_value('SELECT COUNT(*) FROM %s' % table)
                    for table in tables}
        finally:
            conn.close()
            adapter.close()

    def zodbpack(self, *args):
        return zodbpack.main(['-q'] + list(args))


class PrepackDeletesNothingTests(PackCase):

    def test_zodbpack_prepack_deletes_nothing(self):
        # Regression: --prepack removed data (43 -> 11 rows).
        self.populate(self.db())
        before = self.row_counts()
        self.assertEqual(self.zodbpack('--prepack', self.write_config()), 0)
        self.assertEqual(self.row_counts(), before)

    def test_pack_prepack_only_option_deletes_nothing(self):
        db = self.db(pack_prepack_only=True)
        self.populate(db)
        before = self.row_counts()
        db.pack(time.time() + 1)
        self.assertEqual(self.row_counts(), before)
        # The same database packs for real without the option.
        self.assertEqual(self.zodbpack(self.write_config()), 0)
        self.assertLess(self.row_counts()['object_state'], before['object_state'])


ALL = (PrepackDeletesNothingTests,)


def hf_variants():
    return tuple(type(c.__name__ + 'HF', (c,), {'keep_history': False}) for c in ALL)


CASES = ALL + hf_variants()
