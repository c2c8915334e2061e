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

# A Llama converted from a GGUF file, written by transformers itself: a tiny Trilith model exported with
# `ckpt_convert --to gguf` (a SentencePiece tokenizer: unk 0, eos 1, pad 2, no bos), read back with
# `AutoConfig.from_pretrained(dir, gguf_file=...)`, and `LlamaForCausalLM(config).save_pretrained(...)` — once with
# transformers 5.24.0 and once with 4.46.3. Verbatim: `_model_name_or_path` is the GGUF's general.name, bos 1 is
# LlamaConfig's default, rms_norm_eps went through float32.
GGUF_LLAMA_V5 = {
    "_model_name_or_path": "tri", "architectures": ["LlamaForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 1, "dtype": "float32", "eos_token_id": 1, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
    "max_position_embeddings": 64, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": 2, "pretraining_tp": 1,
    "rms_norm_eps": 9.999999747378752e-06, "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "transformers_version": "5.24.0", "unk_token_id": 0, "use_cache": True,
    "vocab_size": 320}
GGUF_LLAMA_V4 = {
    "_model_name_or_path": "tri", "_name_or_path": "/tmp/gg/w", "architectures": ["LlamaForCausalLM"],
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 1, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
    "max_position_embeddings": 64, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": 2, "pretraining_tp": 1,
    "rms_norm_eps": 9.999999747378752e-06, "rope_scaling": None, "rope_theta": 50000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "transformers_version": "4.46.3", "unk_token_id": 0, "use_cache": True,
    "vocab_size": 320}
# Everything transformers 4.46.3 keeps in a Llama config, generation defaults included: `LlamaConfig(vocab_size=256,
# hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4).to_dict()` (transformers 5
# writes fewer fields; tests read those from the installed classes).
LLAMA_TO_DICT_V4 = {
    "_attn_implementation_autoset": False, "_name_or_path": "", "add_cross_attention": False, "architectures": None,
    "attention_bias": False, "attention_dropout": 0.0, "bad_words_ids": None, "begin_suppress_tokens": None,
    "bos_token_id": 1, "chunk_size_feed_forward": 0, "cross_attention_hidden_size": None,
    "decoder_start_token_id": None, "diversity_penalty": 0.0, "do_sample": False, "early_stopping": False,
    "encoder_no_repeat_ngram_size": 0, "eos_token_id": 2, "exponential_decay_length_penalty": None,
    "finetuning_task": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "id2label": {0: "LABEL_0", 1: "LABEL_1"}, "initializer_range": 0.02,
    "intermediate_size": 128, "is_decoder": False, "is_encoder_decoder": False,
    "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "length_penalty": 1.0, "max_length": 20,
    "max_position_embeddings": 2048, "min_length": 0, "mlp_bias": False, "model_type": "llama",
    "no_repeat_ngram_size": 0, "num_attention_heads": 4, "num_beam_groups": 1, "num_beams": 1, "num_hidden_layers": 2,
    "num_key_value_heads": 4, "num_return_sequences": 1, "output_attentions": False, "output_hidden_states": False,
    "output_scores": False, "pad_token_id": None, "prefix": None, "pretraining_tp": 1, "problem_type": None,
    "pruned_heads": {}, "remove_invalid_values": False, "repetition_penalty": 1.0, "return_dict": True,
    "return_dict_in_generate": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
    "sep_token_id": None, "suppress_tokens": None, "task_specific_params": None, "temperature": 1.0,
    "tf_legacy_loss": False, "tie_encoder_decoder": False, "tie_word_embeddings": False, "tokenizer_class": None,
    "top_k": 50, "top_p": 1.0, "torch_dtype": None, "torchscript": False, "transformers_version": "4.46.3",
    "typical_p": 1.0, "use_bfloat16": False, "use_cache": True, "vocab_size": 256}
