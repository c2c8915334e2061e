"""Loss, perplexity and bits per byte of a model on text, from a Trilith checkpoint or a Hugging Face directory.

    # one process
    python tools/evaluate.py --model runs/x/checkpoints --data held_out.jsonl --output eval.json
    # at a layout (TP × CP × PP × DP over the ranks), with any launcher that sets the usual rank variables
    torchrun --nproc-per-node 4 tools/evaluate.py --model runs/x/checkpoints --tensor 2 --pipeline 2 \\
        --data demo_out/data/stdlib_text_document
    # long windows split over 2 context-parallel ranks (parallel/context.py; --context-attention as in training)
    torchrun --nproc-per-node 2 tools/evaluate.py --model runs/x/checkpoints --context 2 --data held_out.jsonl

--model: a checkpoint (full or light, saved at any layout), a checkpoints directory (its `latest`) or a
Hugging Face directory. --data: JSONL files (one document per line, its text under --text-key) or token
dataset prefixes (.bin/.idx or .arrow/.idx from tools/preprocess_data.py), in any mix.

Every document is scored as lm-evaluation-harness's rolling log-likelihood scores it: windows of --window
predictions (default: the training seq_length of a Trilith checkpoint; a Hugging Face directory's
max_position_embeddings, at most 8192), the first after the prefix token, each later one after the tokens
before it (a short last window too sees a whole window of them), so every token is predicted once.
--prefix harness (the default) is the harness's prefix token: the tokenizer's declared BOS, else its
end-of-document token; --prefix eod is always the end-of-document token. JSONL text is encoded as the
harness encodes it (the tokenizer's own special tokens, e.g. a Llama tokenizer's BOS).
  loss = nats summed over the text's tokens / tokens;  perplexity = exp(loss);
  bits per byte = nats summed / ln 2 / UTF-8 bytes of the text.
The bytes of a JSONL document are its text's; those of a token-dataset document are the text its tokens
decode to (with --tokenizer or the checkpoint's data.tokenizer; special tokens decode to nothing, and a
trailing end-of-document token is not scored). Bits per byte divides by bytes, not tokens, so models with
different tokenizers compare. A forward costs the tokens of its windows, padded to the longest of them, not
the model's whole context.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.checkpoint.files import CheckpointError  # noqa: E402
from engine.checkpoint.model_source import ModelSource  # noqa: E402
from engine.evaluate.scoring import Scorer, rolling_windows  # noqa: E402
from engine.evaluate.text_tokenizer import TextTokenizer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The default window of a Hugging Face directory is its max_position_embeddings (what lm-evaluation-harness
# uses) up to this: beyond it a long document's windows hold attention and activations of a length few
# evaluation machines want by default (a Llama 3.x config says 131072); --window sets any other.
HF_WINDOW_CAP = 8192


class EvaluationError(ValueError):
    """Bad input to tools/evaluate.py: one line naming the file or option and the fix."""


def read_documents(path: str, tokenizer: TextTokenizer | None, text_key: str, eod_id: int, prefix: int,
                   limit: int = 0) -> list[tuple[list[int], int]]:
    """(tokens, UTF-8 bytes) of each document of a JSONL file (encoded as the harness does, with `prefix`
    its prefix token) or token dataset prefix."""
    docs = []
    if path.endswith((".jsonl", ".json")):
        if tokenizer is None:
            raise EvaluationError(f"{path}: text needs a tokenizer; pass --tokenizer tokenizer.json")
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise EvaluationError(f"{path} is not a readable UTF-8 JSONL file ({exc})") from exc
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[text_key]
            except (ValueError, KeyError, TypeError):
                text = None
            if not isinstance(text, str):
                raise EvaluationError(f"{path} line {number}: not a JSON object with a text string under "
                                      f"{text_key!r} (choose the key with --text-key)")
            docs.append((tokenizer.encode_as_harness(text, prefix), len(text.encode("utf-8"))))
            if limit and len(docs) == limit:
                break
        return docs
    from data.indexed import IndexedDataset
    try:
        data = IndexedDataset(path)
    except (OSError, ValueError) as exc:
        raise EvaluationError(f"--data {path}: {exc}") from exc
    if tokenizer is None:
        raise EvaluationError(f"{path}: bits per byte of a token dataset needs its tokenizer to count the bytes; "
                              f"pass --tokenizer tokenizer.json")
    bounds = data.document_indices
    for d in range(len(bounds) - 1):
        tokens = [int(t) for s in range(bounds[d], bounds[d + 1]) for t in data[s]]
        if tokens and tokens[-1] == eod_id:
            tokens = tokens[:-1]
        if tokens:
            docs.append((tokens, len(tokenizer.decode(tokens).encode("utf-8"))))
        if limit and len(docs) == limit:
            break
    return docs


def default_window(source: ModelSource) -> int:
    """A Trilith checkpoint's training seq_length; a Hugging Face directory's max_position_embeddings, capped."""
    return source.model.seq_length if source.metadata is not None else min(source.model.seq_length, HF_WINDOW_CAP)


def check_window(source: ModelSource, window: int) -> None:
    context = source.model.max_position_embeddings or source.model.seq_length
    if not 1 <= window <= context:
        raise EvaluationError(f"--window {window}: the model's context is {context} positions (its "
                              f"max_position_embeddings, else its training seq_length); choose 1 to {context}")


def summarize(nats: float, tokens: int, n_bytes: int) -> dict:
    loss = nats / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 100.0)), "bits_per_byte": nats / math.log(2) / n_bytes,
            "tokens": tokens, "bytes": n_bytes, "nats": nats}


def build(source: ModelSource, tensor: int, pipeline: int, rank: int, world: int, device, dtype, batch: int,
          window: int, context: int = 1, context_attention: str = "allgather") -> Scorer:
    """This rank's Scorer of `window`-token windows at the layout TP × CP × PP × (world / TP·CP·PP)."""
    from engine.config.schema import Config, validate
    from engine.train import build_model_chunks
    from parallel.context import ContextParallel
    from parallel.p2p import PipelineComm
    from parallel.tensor import TensorParallel
    from parallel.topology import Layout, Topology
    # a micro-batch is padded to a multiple of 2c (Scorer), so the configured length is the window rounded so
    seq_length = -(-window // (2 * context)) * 2 * context if context > 1 else window
    cfg = Config(model=dataclasses.replace(source.model, seq_length=seq_length))
    cfg.parallel.tensor, cfg.parallel.pipeline, cfg.data.mock = tensor, pipeline, True
    cfg.parallel.context, cfg.parallel.context_attention = context, context_attention
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, max(world // (tensor * context * pipeline), 1)
    validate(cfg, world)
    topo = Topology(Layout.for_world(world, tensor, pipeline, cp=context), rank)
    cp = ContextParallel.from_topology(topo, context_attention)
    chunks = build_model_chunks(cfg, topo, TensorParallel.from_topology(topo), cp)
    source.fill(chunks, topo.tp_size, topo.tp_rank)
    for chunk in chunks:
        chunk.to(device=device, dtype=dtype).eval()
    pipe = PipelineComm.for_model(topo, cfg.model, batch, False, dtype, device) if pipeline > 1 else None
    return Scorer(chunks, window, device, pipe, topo.dp_group, topo.dp_rank, topo.dp_size, batch,
                  context=cp if context > 1 else None)


def evaluate(model: str, data: list[str], tokenizer: str = "", tensor: int = 1, pipeline: int = 1, rank: int = 0,
             world: int = 1, device="cpu", dtype=torch.float32, text_key: str = "text", limit: int = 0,
             batch: int = 8, progress: bool = False, window: int = 0, prefix: str = "harness", context: int = 1,
             context_attention: str = "allgather") -> dict:
    """{"model", "step", "window", "prefix_token", "datasets": {path: summary}, "all": summary}; the same on
    every rank. window 0: the model's default (default_window); prefix "harness" or "eod"."""
    source = ModelSource(model)
    try:
        eod = source.eod_id
        if eod is None:
            raise EvaluationError(f"{model}: no end-of-document token is known (no data.eod_token_id, no tokenizer "
                                  f"with one); pass --tokenizer with an end-of-document token")
        text = TextTokenizer(tokenizer or source.tokenizer, "--tokenizer") if (tokenizer or source.tokenizer) \
            else None
        prefix_id = text.prefix_id(eod) if text is not None and prefix == "harness" else eod
        window = window or default_window(source)
        check_window(source, window)
        scorer = build(source, tensor, pipeline, rank, world, device, dtype, batch, window, context,
                       context_attention)
    finally:
        source.close()
    out, total = {}, [0.0, 0, 0]
    for path in data:
        docs = read_documents(path, text, text_key, eod, prefix_id, limit)
        if not docs:
            raise EvaluationError(f"--data {path} holds no documents")
        requests = [r for tokens, _ in docs for r in rolling_windows(tokens, prefix_id, window)]
        requests.sort(key=lambda r: -len(r[0]))  # longest first, so that each forward's windows are alike
        nats = 0.0
        step = 8 * batch * scorer.dp_size  # windows per progress update
        with tqdm(total=len(requests), desc=Path(path).name, unit="window", disable=not progress) as bar:
            for start in range(0, len(requests), step):
                nats += scorer.total_nll(requests[start:start + step])
                bar.update(len(requests[start:start + step]))
        tokens, n_bytes = sum(len(t) for t, _ in docs), sum(b for _, b in docs)
        out[path] = summarize(nats, tokens, n_bytes)
        total = [total[0] + nats, total[1] + tokens, total[2] + n_bytes]
    return {"model": str(source.path), "step": source.step, "window": window, "prefix_token": prefix_id,
            "datasets": out, "all": summarize(*total)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/evaluate.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint, checkpoints directory or Hugging Face directory")
    ap.add_argument("--data", required=True, nargs="+", help="JSONL files and/or token dataset prefixes")
    ap.add_argument("--tokenizer", default="", help="tokenizer.json (default: the model's own)")
    ap.add_argument("--text-key", default="text", help="JSONL field holding each document's text")
    ap.add_argument("--tensor", type=int, default=1, help="tensor-parallel size (under a launcher)")
    ap.add_argument("--pipeline", type=int, default=1, help="pipeline size (under a launcher)")
    ap.add_argument("--context", type=int, default=1,
                    help="context-parallel size: each window split over this many ranks (under a launcher)")
    ap.add_argument("--context-attention", choices=("allgather", "ring", "alltoall"), default="allgather",
                    help="how context-parallel ranks attend each other's keys (parallel.context_attention)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--limit", type=int, default=0, help="at most this many documents per dataset (0 = all)")
    ap.add_argument("--batch", type=int, default=8, help="windows per forward (per data-parallel rank)")
    ap.add_argument("--window", type=int, default=0,
                    help=f"predictions per window (default: a checkpoint's training seq_length, a Hugging Face "
                         f"directory's max_position_embeddings up to {HF_WINDOW_CAP})")
    ap.add_argument("--prefix", choices=("harness", "eod"), default="harness",
                    help="the token before a document: lm-evaluation-harness's (the tokenizer's BOS, else its "
                         "end-of-document token) or always the end-of-document token")
    ap.add_argument("--output", default="", help="write the JSON result here too")
    args = ap.parse_args(argv)
    from parallel.device import DeviceUnavailable
    from parallel.distributed import init_distributed, shutdown
    try:
        env = init_distributed(args.device, "auto")
    except DeviceUnavailable as exc:  # GPUs asked for, none usable: one line, not a traceback
        print(f"evaluate: {exc}", file=sys.stderr)
        return 2
    clean = False
    try:
        result = evaluate(args.model, args.data, args.tokenizer, args.tensor, args.pipeline, env.rank,
                          env.world_size, env.device, DTYPES[args.dtype], args.text_key, args.limit,
                          args.batch, progress=env.rank == 0, window=args.window, prefix=args.prefix,
                          context=args.context, context_attention=args.context_attention)
        clean = True
    except (ValueError, CheckpointError) as exc:  # EvaluationError, ConfigError, a bad tokenizer file
        print(f"evaluate: {exc}", file=sys.stderr)
        return 1
    finally:
        shutdown(clean)
    if env.rank == 0:
        text = json.dumps(result, indent=1)
        print(text)
        if args.output:
            Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    from parallel.distributed import exit_now
    exit_now(main())
