"""Published throughput the estimate is checked against (never fitted to,
but where ``docs/cost_model.md`` names a constant fitted to a row).

``REMOTE_CASES``: Graphcore's remote-variables tutorial (the seed table,
shared/seeds/003_1b019f863a240eaf.txt): the MNIST MLP 784-512-512-10 with
Adam, data parallelism 4, gradient accumulation 8, micro-batch 8; the
optimizer state in Streaming Memory, sharded above a threshold of elements,
or on chip.  Each row: (case, sharding threshold or None, on chip,
published samples per second).  ``benchmarks/fidelity.py`` and
``tutorials/replication`` reproduce it."""

REMOTE_CASES = [
    ("no sharding", int(1e10), False, 43_418.9),
    ("only state related to fc1.weight", 262_145, False, 50_909.2),
    ("all state related to weights", 1024, False, 67_403.4),
    ("all state", 512, False, 72_570.0),
    ("on-chip optimizer", None, True, 107_418.9),
]
