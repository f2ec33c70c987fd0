"""The SQLite adapter: the embedded default, one host, no server."""
