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
