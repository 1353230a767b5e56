"""Tokenizing: which tokenizer a build uses and how its text becomes ids.

Owns the tokenizer identity and loading (:mod:`.tokenizer`), the encoders that turn a batch of
texts into ids (:mod:`.encoders`, with the tiktoken BPE built from a ``tokenizer.json`` in
:mod:`.tiktoken_bpe`), and the proof that a fast encoder emits the reference tokenizer's ids on a
sample of the build's own documents before it is used (:mod:`.proof`).
"""
