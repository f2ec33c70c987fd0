"""Error messages that must fit on one line (console scripts, log lines,
exceptions that wrap a driver's multi-line message)."""


def one_line(exc):
    """The first line of an exception's message, or its type's name when
    it has none."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
