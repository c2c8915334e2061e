"""The optimizer stack: AdamW on replicated (replicated) or ZeRO-sharded (zero) fp32 masters, host offload of
their state (offload, offload_overlap), and the learning-rate schedules (lr_schedule)."""
