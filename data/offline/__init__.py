"""The offline pipeline's library, run by the programs in tools/ before training: reading corpora, cleaning
(quality heuristics, PII, near-duplicates, benchmark contamination), tokenizing in parallel and writing the
indexed shards that data/ reads. It imports nothing of engine/ or parallel/."""
