"""The Oracle adapter (python-oracledb, thin mode by default, or cx_Oracle)."""


def __getattr__(name):
    # ``from relstorage.adapters.oracle import OracleAdapter``, as earlier releases
    # documented it for storages built in Python; imported on first use,
    # so that importing the package stays cheap.
    if name == 'OracleAdapter':
        from .adapter import OracleAdapter
        return OracleAdapter
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
