"""What the vendor driver modules share: reading a configured driver name."""
from ..interfaces import RelStorageError


def canonical_name(names, name, database):
    """The canonical spelling of driver ``name`` among ``names`` (canonical
    name -> other accepted spellings; case is ignored)."""
    name = (name or 'auto').strip()
    for canonical, aliases in names.items():
        if name.lower() in [n.lower() for n in (canonical,) + aliases]:
            return canonical
    raise RelStorageError(
        "Unknown %s driver %r; choose one of: %s" % (database, name, ', '.join(names)))


def first_importable(classes, label='package'):
    """(an instance of the first of ``classes`` whose module imports, the
    failures before it); (None, failures) when none does.  A failure reads
    ``<cls.label> (<ImportError>)``, for the caller's message."""
    problems = []
    for cls in classes:
        try:
            return cls(), problems
        except ImportError as exc:
            problems.append('%s (%s)' % (getattr(cls, label), exc))
    return None, problems
