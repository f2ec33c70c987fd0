"""Error messages that must fit on one line (console scripts, log lines,
exceptions that wrap a driver's multi-line message)."""


def one_line(exc):
    """The first line of an exception's message, or its type's name when
    it has none."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def config_error(exc, named=None):
    """One line for a ZConfig error: its message and where it is (``line
    N of PATH``; ``line N`` only when PATH is ``named``, the file the
    message names already).  ZConfig's own text puts the place on a second
    line for some errors, which one-line messages lost, and none at all
    for an unknown key."""
    message = getattr(exc, 'message', None) or one_line(exc)
    lineno = getattr(exc, 'lineno', None)
    if not lineno:
        return message
    url = getattr(exc, 'url', None) or ''
    if url.startswith('file://'):
        url = url[len('file://'):]
    import os
    if url and not (named and os.path.abspath(named) == os.path.abspath(url)):
        # (A file it %includes, for one.)
        return '%s (line %d of %s)' % (message, lineno, url)
    return '%s (line %d)' % (message, lineno)
