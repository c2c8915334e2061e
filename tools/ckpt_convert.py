"""Convert checkpoints offline, in one plain process (no torch.distributed: it works on global tensors).

    # Trilith checkpoint (any layout) -> Hugging Face directory (Llama, Mistral or Qwen2: model.hf_model_type)
    python tools/ckpt_convert.py --load-dir runs/x/checkpoints --save-dir hf/x --to hf [--dtype bf16]
    # Hugging Face Llama / Mistral / Qwen2 directory -> Trilith checkpoint at a layout, for continued pretraining
    python tools/ckpt_convert.py --load-dir hf/llama --save-dir runs/y/checkpoints --from hf --tensor 2
    # Trilith checkpoint -> one GGUF file for llama.cpp / Ollama (llama architecture, tokenizer included)
    python tools/ckpt_convert.py --load-dir runs/x/checkpoints --save-dir gguf/x --to gguf [--dtype fp16]
    # Trilith layout A -> layout B (optimizer state included)
    python tools/ckpt_convert.py --load-dir runs/x/checkpoints --save-dir runs/z/checkpoints --tensor 4

`--load-dir` may be a checkpoint (`step_<8-digit step>/`) or a checkpoints directory (its `latest` is used), on disk
or in an object store (`s3://bucket/prefix`: copied to a temporary directory first, every file SHA-256-verified).
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.checkpoint.files import (TMP_PREFIX, CheckpointError, commit, read_latest, set_latest,  # noqa: E402
                                  step_dir_name, write_json, write_safetensors)
from engine.checkpoint.manifest import (FORMAT, KEYS, MANIFEST, METADATA, VERSION, CheckpointReader,  # noqa: E402
                                        global_shape, local_from_global, merge_entries, open_verified, rank_file,
                                        tensor_entry)
from data.offline.hf_tokenizer import export_tokenizer  # noqa: E402
from engine.checkpoint.hf_config import (hf_config_dict, import_transformers, model_from_hf, token_ids,  # noqa: E402
                                         v4_rope_fields)
from engine.config.schema import Config, ConfigError, ModelConfig, from_dict, to_dict, validate  # noqa: E402
from engine.model import CausalLM  # noqa: E402
from parallel.tensor import TensorParallel  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve(path: str | Path) -> Path:
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = read_latest(path)
    if latest is None:
        raise CheckpointError(f"{path} is neither a Trilith checkpoint (with {MANIFEST}) nor a checkpoints "
                              f"directory with a 'latest' file")
    return latest


def open_checkpoint(path: str | Path) -> CheckpointReader:
    """The checkpoint, verified as training verifies it before loading (sizes, SHA-256, the manifest's
    names and ranges): a corrupt checkpoint is refused, never converted into one that verifies."""
    return open_verified(resolve(path))


def layout_params(model: ModelConfig, tp_size: int, tp_rank: int) -> dict:
    """The parameters (with their TP attributes) that one TP rank holds; built on the meta device."""
    with torch.device("meta"):
        net = CausalLM(model, TensorParallel(size=tp_size, rank=tp_rank))
    return dict(net.named_parameters())


def stage_of(name: str, model: ModelConfig, pp: int) -> int:
    """Which pipeline stage's files hold a tensor (an even split; loading works by name, any split loads)."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match:
        return int(match.group(1)) * pp // model.num_layers
    return 0 if name.startswith("model.embed_tokens") else pp - 1


def write_trilith(save_root: Path, model: ModelConfig, read_global, keys_of, meta: dict, tp: int, pp: int) -> Path:
    """Write a checkpoint as the ranks of a (tp, pp, dp=1) layout would, committed atomically; `keys_of(name)`:
    the keys stored for a tensor (Muon's matrices keep `momentum`, the AdamW parameters their two moments)."""
    per_rank = [layout_params(model, tp, r) for r in range(tp)]
    name = step_dir_name(meta["step"])
    save_root.mkdir(parents=True, exist_ok=True)
    tmp = save_root / (TMP_PREFIX + name)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    files, entries = {}, []
    for stage in range(pp):
        tensors: list[dict] = [{} for _ in range(tp)]
        stage_entries: list[dict] = [{} for _ in range(tp)]
        for pname in [n for n in per_rank[0] if stage_of(n, model, pp) == stage]:
            keys = keys_of(pname)
            for key in keys:
                full = read_global(pname, key)
                for r in range(tp):
                    p = per_rank[r][pname]
                    if p.tp_dim is None and r > 0:
                        continue
                    local = local_from_global(full, p.full_shape, p.tp_dim, tp, r).reshape(-1).clone()
                    tensors[r][f"{key}/{pname}"] = local
                    entry = stage_entries[r].setdefault(pname, tensor_entry(p.full_shape, p.tp_dim, tp, p.valid_rows,
                                                                            keys))
                    if not entry["pieces"]:
                        entry["pieces"].append({"file": rank_file(r, stage, 0), "tp_rank": r if p.tp_dim is not None
                                                else 0, "start": 0, "end": local.numel()})
        for r in range(tp):
            sha, size = write_safetensors(tmp / rank_file(r, stage, 0), tensors[r], {"format": "pt"})
            files[rank_file(r, stage, 0)] = {"sha256": sha, "bytes": size}
            entries.append(stage_entries[r])
    sha, size = write_json(tmp / METADATA, meta)
    files[METADATA] = {"sha256": sha, "bytes": size}
    write_json(tmp / MANIFEST, {"format": FORMAT, "version": VERSION, "step": meta["step"],
                                "files": dict(sorted(files.items())), "tensors": merge_entries(entries)})
    commit(tmp, save_root / name)
    set_latest(save_root, name)
    return save_root / name


def retarget(cfg: Config, tp: int, pp: int) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg.parallel.tensor, cfg.parallel.pipeline, cfg.data.mock = tp, pp, True
    try:
        validate(cfg, tp * pp)
    except ConfigError as exc:
        raise SystemExit(f"ckpt_convert: layout TP={tp} PP={pp} does not fit this model: {exc}")
    return {"tensor": tp, "pipeline": pp, "data": 1, "world_size": tp * pp, "zero_stage": 0,
            "rank_order": cfg.parallel.rank_order}


# ---- Hugging Face ---------------------------------------------------------------------------------------
def hf_config(model: ModelConfig, tokens: dict):
    """The transformers config of the model's family (engine/checkpoint/hf_config.py), with the special ids: bos/eos/pad
    always (null when unknown), any other `*_token_id` (unk, sep, ...) when the import recorded one."""
    transformers = import_transformers()
    try:
        fields = hf_config_dict(model)
    except ConfigError as exc:
        raise SystemExit(f"ckpt_convert: {exc}")
    return transformers.AutoConfig.for_model(**fields, **{"bos_token_id": None, "eos_token_id": None,
                                                          "pad_token_id": None, **tokens})


def save_hf_config(config, model: ModelConfig, out: Path) -> None:
    """config.json for both transformers generations: transformers 5 writes `rope_parameters`; the top-level
    `rope_theta`/`rope_scaling` beside it are what transformers 4.x, llama.cpp and vLLM read."""
    config.save_pretrained(out)
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **v4_rope_fields(model)}, indent=2, sort_keys=True)
                    + "\n")


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?B?)", text.strip().upper())
    if not match:
        raise SystemExit(f"ckpt_convert: --max-shard-size {text!r} must look like 5GB, 500MB or a byte count")
    scale = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}[match[2]]
    return int(float(match[1]) * scale)


def save_hf_weights(tensors: dict[str, torch.Tensor], out: Path, max_bytes: int) -> list[str]:
    from safetensors.torch import save_file
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    return names


def export_tokens(meta: dict, tokenizer: str, out: Path, model: ModelConfig) -> dict:
    """The `*_token_id` fields for config.json: those a Hugging Face import recorded in the checkpoint's
    metadata (unk, sep, ...), with bos/eos/pad from the tokenizer when there is one (its files are written to
    `out`), and eos data.eod_token_id when set (what training ended documents with)."""
    eod = meta["config"]["data"].get("eod_token_id", -1)
    recorded = dict(meta.get("special_tokens") or {})
    if not tokenizer:
        return recorded | ({"eos_token_id": eod} if eod >= 0 else {})
    try:
        tokens = export_tokenizer(tokenizer, out, eod, model.max_position_embeddings or model.seq_length)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"ckpt_convert: {exc}; pass --tokenizer FILE (or --tokenizer '' for none)")
    # An imported model may stop on several ids (Llama 3 Instruct: end_of_text, eom, eot); keep that list.
    stops = recorded.get("eos_token_id")
    if eod < 0 and isinstance(stops, list) and tokens["eos_token_id"] in stops:
        tokens["eos_token_id"] = stops
    return recorded | tokens


def to_hf(args) -> None:
    GenerationConfig = import_transformers().GenerationConfig
    reader = open_checkpoint(args.load_dir)
    model = ModelConfig(**reader.metadata["config"]["model"])
    out = Path(args.save_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer if args.tokenizer is not None else reader.metadata["config"]["data"]["tokenizer"]
    tokens = export_tokens(reader.metadata, tokenizer, out, model)
    config = hf_config(model, tokens)
    config.dtype = DTYPES[args.dtype]
    tensors = {n: reader.global_tensor(n, "master").to(DTYPES[args.dtype]) for n in reader.tensors}
    files = save_hf_weights(tensors, out, parse_size(args.max_shard_size))
    save_hf_config(config, model, out)
    generation = GenerationConfig.from_model_config(config)
    # transformers 5 keeps generation ids (forced_eos_token_id, ...) out of config.json: they go here
    generation.update(**{k: v for k, v in tokens.items() if hasattr(generation, k)})
    generation.save_pretrained(out)
    print(f"ckpt_convert: wrote {out} ({len(tensors)} tensors in {len(files)} file(s), step "
          f"{reader.metadata['step']})")


def read_safetensors(path: Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a file, or the given ones; a damaged file is a CheckpointError naming it."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            missing = sorted(set(keys or []) - set(f.keys()))
            if missing:
                raise CheckpointError(f"{path} lacks {missing[:5]}, which model.safetensors.index.json places there")
            return {k: f.get_tensor(k) for k in (f.keys() if keys is None else keys)}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc


def hf_weight_map(src: Path, index: Path) -> dict[str, list[str]]:
    """{file: tensor names} from an index; every file named must be a plain file inside `src`."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a readable index with a 'weight_map' ({exc})") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        parts = Path(file).parts
        if not parts or Path(file).is_absolute() or ".." in parts or not (src / file).is_file():
            raise CheckpointError(f"{index} places {name!r} in {file[:80]!r}, which is not a file inside {src} "
                                  f"(absolute paths and '..' are refused)")
        files.setdefault(file, []).append(name)
    return files


def load_hf_weights(src: Path) -> dict[str, torch.Tensor]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        return {k: v for f, keys in sorted(hf_weight_map(src, index).items())
                for k, v in read_safetensors(src / f, keys).items()}
    if (src / "model.safetensors").is_file():
        return read_safetensors(src / "model.safetensors")
    if (src / "pytorch_model.bin").is_file():
        return torch.load(src / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise SystemExit(f"ckpt_convert: {src} has no model.safetensors, model.safetensors.index.json or "
                     f"pytorch_model.bin")


def from_hf(args) -> None:
    src = Path(args.load_dir)
    if not (src / "config.json").is_file():
        raise SystemExit(f"ckpt_convert: {src} has no config.json; --from hf needs a Hugging Face model directory")
    try:
        hf = json.loads((src / "config.json").read_text())
        model = model_from_hf(hf, args.seq_length)
    except ValueError as exc:  # ConfigError, or not JSON
        raise SystemExit(f"ckpt_convert: {src / 'config.json'}: {exc}")
    weights = {k: v for k, v in load_hf_weights(src).items() if not k.endswith("rotary_emb.inv_freq")}
    if model.tie_embeddings:
        weights.pop("lm_head.weight", None)
    expected = {n: global_shape(p.full_shape, p.valid_rows) for n, p in layout_params(model, 1, 0).items()}
    missing, unknown = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    wrong = [f"{n}: {list(weights[n].shape)} vs {s}" for n, s in expected.items()
             if n in weights and list(weights[n].shape) != s]
    if missing or unknown or wrong:
        raise SystemExit(f"ckpt_convert: {src} does not match its config.json: missing {missing[:5]}, unexpected "
                         f"{unknown[:5]}, shape mismatches (file vs config) {wrong[:5]}")
    cfg = Config(model=model)
    meta = {"format": FORMAT, "step": 0, "consumed_samples": 0, "adam_step": 0, "scaler": None,
            "lr_schedule": {"step": 0}, "layout": retarget(cfg, args.tensor, args.pipeline),
            "config": to_dict(cfg), "source": str(src.resolve())}
    meta["config"]["parallel"].update(tensor=args.tensor, pipeline=args.pipeline)
    record_tokens(meta, hf, src)
    path = write_trilith(Path(args.save_dir), model, lambda n, k: weights[n].float(), lambda n: ("master",), meta,
                         args.tensor, args.pipeline)
    print(f"ckpt_convert: wrote {path} (TP={args.tensor}, PP={args.pipeline}, weights only: optimizer starts fresh)")


def record_tokens(meta: dict, hf: dict, src: Path) -> None:
    """Keep a Hugging Face model's special ids, every `*_token_id` of its config.json (and its tokenizer, as
    data.tokenizer), for the export back."""
    meta["special_tokens"] = token_ids(hf)
    tokenizer = next((src / n for n in ("tokenizer.json", "tokenizer.model") if (src / n).is_file()), None)
    if tokenizer is not None:
        meta["config"]["data"]["tokenizer"] = str(tokenizer.resolve())


def to_gguf(args) -> None:
    from engine.checkpoint.gguf_export import write_gguf
    reader = open_checkpoint(args.load_dir)
    config = reader.metadata["config"]
    tokenizer = args.tokenizer if args.tokenizer is not None else config["data"]["tokenizer"]
    if not tokenizer:
        raise SystemExit("ckpt_convert: --to gguf needs a tokenizer (a GGUF file carries it): pass --tokenizer "
                         "FILE or set data.tokenizer")
    out = Path(args.save_dir) if args.save_dir.endswith(".gguf") else Path(args.save_dir) / "model.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        ids = write_gguf(out, ModelConfig(**config["model"]), lambda n: reader.global_tensor(n, "master"), tokenizer,
                         config["data"].get("eod_token_id", -1), args.dtype, name=Path(reader.dir).parent.name)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"ckpt_convert: --to gguf: {exc}")
    print(f"ckpt_convert: wrote {out} (llama architecture, {args.dtype}, special ids {ids}, step "
          f"{reader.metadata['step']})")


def reshard(args) -> None:
    reader = open_checkpoint(args.load_dir)
    cfg = from_dict(reader.metadata["config"])
    meta = copy.deepcopy(reader.metadata)
    meta["layout"] = retarget(cfg, args.tensor, args.pipeline)
    meta["config"]["parallel"].update(tensor=args.tensor, pipeline=args.pipeline)
    def keys_of(name: str) -> list[str]:
        return [k for k in KEYS if k in reader.tensors[name]["keys"]]
    path = write_trilith(Path(args.save_dir), cfg.model, reader.global_tensor, keys_of, meta, args.tensor,
                         args.pipeline)
    print(f"ckpt_convert: wrote {path} at TP={args.tensor}, PP={args.pipeline} from {reader.dir}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tools/ckpt_convert.py", description=__doc__.split("\n")[0])
    parser.add_argument("--load-dir", required=True)
    parser.add_argument("--save-dir", required=True)
    direction = parser.add_mutually_exclusive_group()
    direction.add_argument("--to", choices=["hf", "gguf"], help="export a Trilith checkpoint (gguf: --save-dir is "
                                                                "a directory for model.gguf, or a .gguf path)")
    direction.add_argument("--from", dest="source", choices=["hf"], help="import into a Trilith checkpoint")
    parser.add_argument("--tensor", type=int, default=1, help="target tensor-parallel size (Trilith output)")
    parser.add_argument("--pipeline", type=int, default=1, help="target pipeline size (Trilith output)")
    parser.add_argument("--seq-length", type=int, default=0, help="--from hf: model.seq_length (default: "
                                                                  "max_position_embeddings)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="--to hf/gguf: weight dtype")
    parser.add_argument("--max-shard-size", default="5GB", help="--to hf: split weights above this size")
    parser.add_argument("--tokenizer", default=None, help="--to hf/gguf: tokenizer file (default: data.tokenizer)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ckpt_convert-") as scratch:
        try:
            if args.load_dir.startswith("s3://") and args.source != "hf":  # a verified local copy first
                from engine.checkpoint.locations import fetch_s3_checkpoint
                args.load_dir = str(fetch_s3_checkpoint(args.load_dir, Path(scratch)))
            return convert(args)
        except CheckpointError as exc:
            print(f"ckpt_convert: {exc}", file=sys.stderr)
            return 1


def convert(args) -> int:
    if args.to == "hf":
        to_hf(args)
    elif args.to == "gguf":
        to_gguf(args)
    elif args.source == "hf":
        from_hf(args)
    else:
        reshard(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
