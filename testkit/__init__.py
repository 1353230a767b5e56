"""Test and bench support for h5corpus (not part of the package): :mod:`.corpora`, :mod:`.clusters`."""
