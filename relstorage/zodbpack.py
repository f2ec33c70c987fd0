"""zodbpack: pack the storages named in a ZConfig file (for cron).

    zodbpack [-d DAYS] CONFIG

CONFIG holds one or more storage sections (``%import relstorage`` for
``<relstorage>``).  Each storage is packed to DAYS days ago (default 0:
now), with garbage collection as its ``pack-gc`` option says.
"""
import argparse
import logging
import sys
import time

import ZConfig
from ZODB.serialize import referencesf

from .options import redact_secrets

SCHEMA = """
<schema>
  <import package="ZODB"/>
  <multisection type="ZODB.storage" attribute="storages" name="*" required="yes"/>
</schema>
"""

log = logging.getLogger('zodbpack')


def main(argv=None):
    parser = argparse.ArgumentParser(prog='zodbpack', description=__doc__.splitlines()[0])
    parser.add_argument('config', metavar='CONFIG')
    parser.add_argument('-d', '--days', type=float, default=0.0,
                        help='keep the history of the last DAYS days (default 0)')
    parser.add_argument('--prepack', action='store_true',
                        help='accepted for compatibility; packing here has no separate '
                             'pre-pack phase')
    parser.add_argument('--use-prepack-state', action='store_true',
                        help='accepted for compatibility (see --prepack)')
    parser.add_argument('-q', '--quiet', action='store_true')
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format='%(asctime)s %(name)s %(levelname)s %(message)s')
    if args.days < 0:
        parser.error('--days must not be negative')
    if args.prepack or args.use_prepack_state:
        log.info('--prepack/--use-prepack-state are accepted but have no effect: '
                 'pack runs as a single phase')
    try:
        schema = ZConfig.loadSchemaFile(_string_io(SCHEMA))
        config, _ = ZConfig.loadConfig(schema, args.config)
    except (ZConfig.ConfigurationError, OSError) as exc:
        sys.stderr.write('zodbpack: %s\n' % redact_secrets(str(exc)))
        return 2
    pack_time = time.time() - args.days * 86400
    status = 0
    for section in config.storages:
        name = getattr(section, 'name', None) or section.config.getSectionName() or '(unnamed)'
        try:
            storage = section.open()
        except Exception as exc:  # pylint:disable=broad-except
            sys.stderr.write('zodbpack: cannot open storage %s: %s\n'
                             % (name, redact_secrets(str(exc))))
            status = 1
            continue
        try:
            started = time.time()
            before = len(storage)
            if args.prepack:
                storage._options = storage._options.copy(pack_prepack_only=True)
            storage.pack(pack_time, referencesf)
            log.info('Packed %s in %.1fs: %d objects before, %d after',
                     name, time.time() - started, before, len(storage))
        except Exception as exc:  # pylint:disable=broad-except
            sys.stderr.write('zodbpack: packing %s failed: %s\n'
                             % (name, redact_secrets(str(exc))))
            status = 1
        finally:
            storage.close()
    return status


def _string_io(text):
    import io
    return io.StringIO(text)


if __name__ == '__main__':
    sys.exit(main())
