"""Small tokenizers built like the real families' (same pre-tokenizers, post-processors and
tokenizer_config.json roles), trained locally on a few sentences: no hub access."""
import json
from pathlib import Path

TEXTS = ["def f(x):\n    return x + 1\n", "Hello world! It's 2024, isn't it?  3.14159 and 42.\n",
         "café naïve — “quotes” 日本語 😀\ttab", "self.assertEqual(foo[0], {'k': [1, 2]})  # c\n" * 2]
# The pre-tokenizer regexes of the Llama 3 and Qwen2 tokenizer.json files.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
FAMILIES = {
    # Llama-3-Instruct: documents end with <|eot_id|> although <|end_of_text|> is in the vocabulary too.
    "llama3-instruct": dict(split=LLAMA3_SPLIT, specials=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                            bos_post="<|begin_of_text|>",
                            config={"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                                    "eos_token": "<|eot_id|>", "model_max_length": 131072}),
    "qwen2.5-instruct": dict(split=QWEN2_SPLIT, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             config={"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                                     "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace"}),
    "smollm2-instruct": dict(split=None, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             config={"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>",
                                     "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                                     "unk_token": "<|endoftext|>"}),
    "gpt2": dict(split=None, specials=["<|endoftext|>"],
                 config={"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                         "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}),
}


def build_family(name: str, directory: Path, vocab_size: int = 400, texts=None) -> Path:
    """Write tokenizer.json + tokenizer_config.json of one family, trained on `texts` (default: TEXTS), into
    `directory`; returns it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    spec = FAMILIES[name]
    tok = Tokenizer(models.BPE())
    if spec["split"]:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=spec["specials"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS * 3 if texts is None else texts, trainer)
    if spec.get("bos_post"):
        bos = spec["bos_post"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(spec["config"], indent=2))
    return directory
