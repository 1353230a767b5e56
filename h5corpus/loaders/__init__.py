"""Training-side reading: padding-free ``VarlenBatch``es from a stored corpus (sliding windows or
best-fit packed documents), partitioned over DDP ranks and DataLoader workers, plus the varlen
attention and loss helpers. Imports only :mod:`h5corpus.storage` (and torch). See
``docs/READING.md`` and ``docs/PACKING.md``.
"""
