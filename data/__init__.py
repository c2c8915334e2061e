"""Trilith's training-time data path: indexed token shards, packed GPT samples, blending, DP loading.

Stands alone: imports only numpy, torch and the standard library, and is told its rank and sizes.
Submodules are imported on use, so the offline tools can read/write shards without importing torch.
"""
