"""The PostgreSQL adapter (psycopg 3 or psycopg2)."""


def __getattr__(name):
    # ``from relstorage.adapters.postgresql import PostgreSQLAdapter``, as earlier releases
    # documented it for storages built in Python; imported on first use,
    # so that importing the package stays cheap.
    if name == 'PostgreSQLAdapter':
        from .adapter import PostgreSQLAdapter
        return PostgreSQLAdapter
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
