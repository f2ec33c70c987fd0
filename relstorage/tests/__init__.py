# Leaked sessions and files of ours fail the tests (see leaks.py).
from . import leaks

leaks.install()
