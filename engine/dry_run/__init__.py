"""A large job's ranks simulated on one CPU: torch's fake process group at the real world size and rank, the
model on the meta device, one real training step per rank, its collectives recorded and checked.

    python -m engine.dry_run --config FILE --world-size N [--ranks all|cover|LIST] [overrides]

`rank_program` runs one rank, `ranks` chooses which, `schedule_check` proves the recorded schedules consistent
and free of deadlock, `report` holds memory and traffic against engine/memory_estimate.py and engine/plan/volumes.py.
"""
