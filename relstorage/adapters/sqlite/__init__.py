"""The SQLite adapter: the embedded default, one host, no server."""


def __getattr__(name):
    # ``from relstorage.adapters.sqlite import Sqlite3Adapter``, as the
    # other adapters' packages give theirs (earlier releases documented
    # that for storages built in Python); imported on first use, so that
    # importing the package stays cheap.
    if name == 'Sqlite3Adapter':
        from .adapter import Sqlite3Adapter
        return Sqlite3Adapter
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
