"""The config.json fields of real Hugging Face models, for tests."""

# The shipped config.json of each model, sizes scaled (hidden 64, 4 layers, vocabulary 256, special ids
# inside it); every other field and value as published.
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 250,
    "eos_token_id": 251, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 256}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.041666666666666664,
    "intermediate_size": 160, "is_llama_config": True, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2, "pad_token_id": 0,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None,
    "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
    "use_cache": True, "vocab_size": 256}
TINYLLAMA_1_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 176,
    "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.35.0", "use_cache": True, "vocab_size": 256}
LLAMA_1_7B = {  # huggyllama/llama-7b: multi-head attention, no rope_theta (10000), legacy max_sequence_length
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 176, "max_position_embeddings": 2048,
    "max_sequence_length": 2048, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 4,
    "pad_token_id": 0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.28.0.dev0", "use_cache": True, "vocab_size": 256}
# Llama 2 extended to 16k by linear interpolation (LongChat / Vicuna-16k style, legacy "type" key)
LLAMA_2_LINEAR = {**TINYLLAMA_1_1B, "num_key_value_heads": 4, "max_position_embeddings": 4096,
                  "rope_scaling": {"factor": 4.0, "type": "linear"}, "transformers_version": "4.31.0"}
# Mistral-7B-v0.1 with its window scaled to the test's sequence, and Mistral-Nemo's explicit head_dim
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 224, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 8, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 256}
MISTRAL_NEMO = {**MISTRAL_7B, "head_dim": 32, "rope_theta": 1000000.0, "sliding_window": None,
                "max_position_embeddings": 1024000, "transformers_version": "4.43.0.dev0"}
# Qwen2.5-0.5B (one KV head below TP=2: the replicated-KV path with biases), and its documented YaRN extension
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 255, "eos_token_id": 255,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
    "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 4,
    "num_hidden_layers": 4, "num_key_value_heads": 1, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
    "vocab_size": 256}
QWEN2_5_YARN = {**QWEN2_5_0_5B, "num_key_value_heads": 2, "rope_scaling": {
    "factor": 4.0, "original_max_position_embeddings": 16, "type": "yarn"}}
