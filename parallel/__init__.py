"""How the model is split: topology and process groups, tensor/sequence, pipeline and data parallelism."""
