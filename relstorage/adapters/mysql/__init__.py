"""The MySQL / MariaDB adapter (InnoDB), for mysqlclient or PyMySQL."""


def __getattr__(name):
    # ``from relstorage.adapters.mysql import MySQLAdapter``, as earlier releases
    # documented it for storages built in Python; imported on first use,
    # so that importing the package stays cheap.
    if name == 'MySQLAdapter':
        from .adapter import MySQLAdapter
        return MySQLAdapter
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
