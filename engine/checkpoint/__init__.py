"""What a run saves and loads: the sharded, verified checkpoints (checkpointer, with their files and
manifest), their copies in other places (locations: directories and S3 stores, uploader, resume_plan,
s3_store, load_check), light snapshots between them, and the Hugging Face and GGUF formats a model comes
from or goes to (hf_config, hf_weights, model_source, gguf_export)."""
