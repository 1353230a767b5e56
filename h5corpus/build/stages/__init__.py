"""Stages: the units of work of a build and the state folder they share.

Owns the persisted build plan and the context a stage runs in (:mod:`.buildplan`), the state
folder and its records (:mod:`.state`, :mod:`.runmarker`), the read and finish stages
(:mod:`.tasks`, writing shards with :mod:`.shards`), the decide stage in memory (:mod:`.decide`)
or in buckets (:mod:`.buckets`, :mod:`.merge`), the commit (:mod:`.commit`, :mod:`.scores`,
:mod:`.explain`), and the one stage dispatcher (:mod:`.dispatch`) every executor calls.
"""
