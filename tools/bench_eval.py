"""Evaluation tokens/s of tools/evaluate.py against a plain transformers forward of the same requests, and the
time of a few short documents whatever the model's max_position_embeddings.

A Hugging Face directory of SmolLM2-135M's shape (random weights; a byte-level BPE tokenizer trained here on
the Python standard library's source) is scored two ways on the same machine in the same run:
  - throughput: documents of the standard library's source (many longer than the window) as rolling windows
    through Trilith's Scorer (`--batch` windows per forward, padded to the longest) and through transformers'
    LlamaForCausalLM, one unpadded window per forward; both sums of nats are printed, and must agree;
  - nine short documents through the whole tool (loading included) with the config's max_position_embeddings
    set to each of `--contexts`: the time must not grow with the context.

    python tools/bench_eval.py [--device cpu] [--window 1024] [--documents 16] [--chars 6000] [--contexts 512 8192]
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoint.model_source import ModelSource  # noqa: E402
from engine.evaluate.scoring import rolling_windows  # noqa: E402
from engine.evaluate.text_tokenizer import TextTokenizer  # noqa: E402
from tools import evaluate as evaluate_tool  # noqa: E402

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "tie_word_embeddings": True, "rope_theta": 100000.0, "rms_norm_eps": 1e-5}


def source_texts(count: int, chars: int) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return [f.read_text(encoding="utf-8", errors="replace")[:chars] for f in files[:count]]


def make_model(directory: Path, texts: list[str], context: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=4096, max_position_embeddings=context, **SMOLLM2_135M)) \
        .save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": None}))


def transformers_nats(directory: Path, requests: list, device) -> float:
    """Each request alone through LlamaForCausalLM: the plain forward the Scorer is measured against."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    total = 0.0
    with torch.no_grad():
        for ids, scored in requests:
            logp = model(torch.tensor([ids[:-1]], device=device)).logits[0, -scored:].float().log_softmax(-1)
            total -= logp.gather(1, torch.tensor(ids[-scored:], device=device)[:, None]).sum().item()
    return total


def synchronized(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--documents", type=int, default=16, help="standard-library files scored for throughput")
    ap.add_argument("--chars", type=int, default=6000, help="at most this many characters of each")
    ap.add_argument("--batch", type=int, default=8, help="windows per Trilith forward")
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 8192])
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        texts = source_texts(max(args.documents, 9), args.chars)
        short = [text[:400] for text in texts[:9]]
        texts = texts[:args.documents]
        make_model(model, texts + short, max(args.contexts + [args.window]))
        tokenizer = TextTokenizer(model / "tokenizer.json")
        eod = tokenizer.prefix_id(0)
        requests = [r for text in texts for r in rolling_windows(tokenizer.encode_as_harness(text, eod), eod,
                                                                 args.window)]
        tokens = sum(scored for _, scored in requests)
        source = ModelSource(model)
        scorer = evaluate_tool.build(source, 1, 1, 0, 1, args.device, torch.float32, args.batch, args.window)
        source.close()
        scorer.total_nll(requests[:args.batch])  # warm-up
        synchronized(args.device)
        start = time.perf_counter()
        ours = scorer.total_nll(requests)
        synchronized(args.device)
        trilith_s = time.perf_counter() - start
        transformers_nats(model, requests[:2], args.device)  # warm-up
        start = time.perf_counter()
        theirs = transformers_nats(model, requests, args.device)
        synchronized(args.device)
        plain_s = time.perf_counter() - start
        print(f"{len(texts)} documents, {tokens} tokens in {len(requests)} windows of {args.window} on {args.device}")
        print(f"  Trilith (batch {args.batch}): {tokens / trilith_s:,.0f} tokens/s, {ours:.4f} nats")
        print(f"  transformers, one window per forward: {tokens / plain_s:,.0f} tokens/s, {theirs:.4f} nats")
        print(f"  ratio {plain_s / trilith_s:.2f}x; nats differ by {abs(ours - theirs) / abs(theirs):.1e} relative")
        short_file = Path(tmp) / "short.jsonl"
        short_file.write_text("".join(json.dumps({"text": text}) + "\n" for text in short))
        for context in args.contexts:
            config = json.loads((model / "config.json").read_text())
            config["max_position_embeddings"] = context
            (model / "config.json").write_text(json.dumps(config))
            start = time.perf_counter()
            got = evaluate_tool.evaluate(str(model), [str(short_file)], device=args.device)["all"]
            print(f"  {len(short)} short documents ({got['tokens']} tokens), max_position_embeddings {context}: "
                  f"{time.perf_counter() - start:.2f} s, bits per byte {got['bits_per_byte']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
