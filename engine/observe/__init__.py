"""Watching a run: metrics records and trackers, the per-step monitors and probes, stragglers and the
pre-flight's rank sniff, GPU and host health, profiling, replica checks, loss-spike rollback and the
generation diary."""
