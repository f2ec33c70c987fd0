"""Blob support: how blob files travel between ZODB, the database and disk.

Two modes, chosen by ``shared-blob-dir``:

- ``cached.CachedBlobs`` (shared-blob-dir false, the default, as in
  RelStorage 4.3): the bytes live in the database (``blob_chunk`` rows,
  committed with the object that owns them); ``blob-dir`` is only a local
  cache, bounded by ``blob-cache-size``.
- ``shared.SharedBlobs`` (shared-blob-dir true): ``blob-dir`` (often NFS)
  is the only copy, in ZODB's bushy layout; the database keeps no blob
  bytes.

Each storage instance gets its own ``BlobTransaction`` from the mode object
for the transaction being committed.
"""
import os
import tempfile

from ..directories import ensure_directory
from ..interfaces import RelStorageError


def make_blobs(options, adapter, shared=None):
    """The blob mode object for these options, or None without blob-dir.
    ``shared``: the shared state cache (memcached or Redis), if any, which
    also holds small blobs read from the database."""
    if not options.blob_dir:
        return None
    blob_dir = ensure_directory('blob-dir', options.blob_dir)
    if options.read_only and options.shared_blob_dir:
        # Only read (a zodbconvert source, a copy on read-only media, a
        # user who may not write there), as a read-only FileStorage reads
        # its blobs: a helper agent's check found it refused.
        return _open_read_only(blob_dir, options)
    try:
        os.makedirs(os.path.join(blob_dir, 'tmp'), exist_ok=True)
        # (A name of its own: two storages of one process opening at once
        # removed each other's probe, named by the process only.)
        with tempfile.NamedTemporaryFile(dir=os.path.join(blob_dir, 'tmp'),
                                         prefix='.writable-') as f:
            f.write(b'x')
    except OSError as exc:
        raise RelStorageError("blob-dir %s is not usable: %s" % (blob_dir, exc)) from exc
    if options.shared_blob_dir:
        from .shared import SharedBlobs
        return SharedBlobs(blob_dir, options)
    from .cached import CachedBlobs
    return CachedBlobs(blob_dir, options, shared, adapter=adapter)


def _open_read_only(blob_dir, options):
    from .shared import SharedBlobs
    try:
        return SharedBlobs(blob_dir, options)
    except OSError as exc:
        raise RelStorageError("blob-dir %s is not usable: %s" % (blob_dir, exc)) from exc
