"""Transaction ids from times: a tid is a ZODB TimeStamp of the moment it
names (UTC), read as a big-endian integer."""
import time

from ZODB.TimeStamp import TimeStamp


def tid_of_time(t):
    """The tid of time ``t`` (seconds since the epoch)."""
    return int.from_bytes(TimeStamp(*time.gmtime(t)[:5] + (t % 60,)).raw(), 'big')
