"""The stored corpus: the format contract (:mod:`.format`), the shard writer, the manifest, the
validator and the reader. Imports nothing else of h5corpus; everything else builds on it. The
contract itself is ``docs/FORMAT.md``.
"""
