"""Command-line arguments of the tiny workload the CLI tests run (a few seconds on 2 CPU cores).

Documents of 12-20 blocks and a 24-block GPU pool: a document asked for again after another one
was read is no longer on the GPU; the CPU tier (32 rows) holds about two documents, so it serves
some of those and the fs tier the others. Each test module adds the clients, sessions, pacing and
timeout it needs.
"""

TINY_WORKLOAD = [
    "--workload",
    "documents",
    "--turns",
    "2",
    "--document-tokens",
    "256",
    "--num-documents",
    "4",
    "--turn-tokens",
    "16",
    "--output-tokens",
    "3",
    "--num-layers",
    "2",
    "--head-size",
    "16",
    "--gpu-blocks",
    "24",
    "--max-num-seqs",
    "3",
    "--max-num-batched-tokens",
    "64",
    "--cpu-bytes",
    "128KiB",
]
