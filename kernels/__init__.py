"""Fast paths as pure tensor functions, each with a pure-PyTorch fallback. No torch.distributed here."""
