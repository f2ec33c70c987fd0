"""What an application user allowed rows, but not the schema, can do.

The vendor modules (test_postgresql.py, test_mysql.py) provide a class
``PrivilegeTests(PackPrivilegeCases, unittest.TestCase)`` that makes a
database and a user of its own, and:

- ``db(owner)``: a ``ZODB.DB`` on that database through ZConfig, as the
  owner (who may create the schema) or as the application user
  (``create-schema false``);
- ``grant(temporary=True)``: give the application user the rows of every
  table there (and the sequences... the vendor needs), and the right to
  create temporary tables unless ``temporary`` is false.
"""
import time

from persistent.mapping import PersistentMapping

from relstorage.interfaces import RelStorageError


class PackPrivilegeCases:
    """A helper agent's check: the pack created its tables at every run
    (CREATE ... IF NOT EXISTS, which PostgreSQL refuses without the
    privilege to create, and CREATE INDEX without the table's ownership;
    MySQL without CREATE), so such a user could never pack, even once the
    first pack had made every table."""

    def db(self, owner):
        raise NotImplementedError

    def grant(self, temporary=True):
        raise NotImplementedError

    def garbage_and_pack(self, db):
        with db.transaction() as conn:
            conn.root()['x'] = PersistentMapping(v=1)
        with db.transaction() as conn:
            del conn.root()['x']
        db.pack(time.time() + 1)

    def test_pack_by_an_application_user(self):
        # The owner made the schema and its first pack made the pack's
        # tables: the application user packs with rights on rows only.
        owner = self.db(True)
        try:
            self.garbage_and_pack(owner)
        finally:
            owner.close()
        self.grant()
        app = self.db(False)
        try:
            before = len(app.storage)
            self.garbage_and_pack(app)
            self.assertEqual(len(app.storage), before)
        finally:
            app.close()

    def test_a_new_process_commits_changes_with_the_least_rights(self):
        # A helper agent's check (PostgreSQL, USAGE on the OID sequence):
        # the first commit of a process that only changed objects failed
        # ("permission denied for sequence zoid_seq"): it read the
        # sequence to be sure no OID it stored was ahead of it.
        owner = self.db(True)
        try:
            with owner.transaction() as conn:
                conn.root()['x'] = PersistentMapping(v=1)
        finally:
            owner.close()
        self.grant()
        for value in (2, 3):
            app = self.db(False)
            try:
                with app.transaction() as conn:
                    conn.root()['x']['v'] = value
                    if value == 3:
                        conn.root()['y'] = PersistentMapping(v=value)
                with app.transaction() as conn:
                    self.assertEqual(conn.root()['x']['v'], value)
            finally:
                app.close()

    def test_a_user_without_rights_is_told_which_database_refused(self):
        # A helper agent's check: a user that may log in, with no right on
        # the tables, got the driver's bare error at open, naming neither
        # the database nor the user.
        # (MySQL refuses such a user the database at connect, as clearly.)
        self.db(True).close()
        with self.assertRaises(RelStorageError) as raised:
            self.db(False).close()
        message = str(raised.exception)
        self.assertIn(self.dbname, message)
        self.assertIn(self.app_user, message)
        self.assertIn('rights to read and write' if self.refused_per_statement
                      else 'Access denied', message)

    def test_first_pack_by_an_application_user_says_what_it_needs(self):
        self.db(True).close()
        self.grant()
        app = self.db(False)
        try:
            with self.assertRaises(RelStorageError) as raised:
                self.garbage_and_pack(app)
            message = str(raised.exception)
            self.assertIn('cannot create its table object_ref', message)
            self.assertIn("the schema's owner", message)
        finally:
            app.close()

    def test_commit_without_temporary_tables_says_what_it_needs(self):
        # A helper agent's check: MySQL refused with "Access denied for
        # user ... to database ...", which names no privilege, to a user
        # that had every right on the rows.
        self.db(True).close()
        self.grant(temporary=False)
        app = self.db(False)
        try:
            with self.assertRaises(RelStorageError) as raised:
                with app.transaction() as conn:
                    conn.root()['x'] = PersistentMapping(v=1)
            message = str(raised.exception)
            self.assertIn('cannot create its temporary tables', message)
            self.assertIn('CREATE TEMPORARY TABLES', message)
        finally:
            app.close()
        owner = self.db(True)
        try:
            with owner.transaction() as conn:
                self.assertNotIn('x', conn.root())
        finally:
            owner.close()
