"""The optimizer stack: which parameter gets which optimizer (param_groups); AdamW on replicated (replicated) or
ZeRO-sharded (zero) fp32 masters; Muon's update (muon) and its whole-matrix Newton–Schulz at one owner rank per
matrix (muon_owners); host offload of AdamW's state (offload, offload_overlap); the learning-rate schedules
(lr_schedule)."""
