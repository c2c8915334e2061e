"""What a run saves and loads: the sharded, verified checkpoints (checkpointer, with their files and
manifest), light snapshots between them, and the Hugging Face and GGUF formats a model comes from or goes to
(hf_config, hf_weights, model_source, gguf_export)."""
