"""dapo-jax: DAPO reinforcement learning for language models in JAX."""

import setuptools

setuptools.setup(
    name="dapo-jax",
    version="0.1.0",
    description="DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization) in JAX",
    packages=setuptools.find_packages(include=["dapo_jax", "dapo_jax.*"]),
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.10.2,<0.11",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "orbax-checkpoint>=0.12.8,<0.13",
        "transformers>=5.24,<6",
        "tokenizers>=0.22,<1",
        "datasets>=5.2,<6",
        "safetensors>=0.8,<0.9",
        "ml-collections>=1.1,<2",
        "tensorboardX>=2.6,<3",
        "absl-py>=2.1,<3",
        "numpy>=2.0,<3",
        "pyarrow>=17",
        "matplotlib>=3.9,<4",
        "tqdm>=4.66,<5",
    ],
    extras_require={
        # torch is only the reference implementation in parity tests; 2.13.0 is the CPU wheel.
        # wandb and tensorboard (the viewer of the event files that tensorboardX writes) are
        # in the test extra so that the wandb writer's test runs and `tensorboard --logdir`
        # works in the project's virtualenv; ruff is the linter (ruff.toml); pytest-xdist runs
        # the tests on every core (the suite is mostly single-threaded XLA compiles); gguf and
        # accelerate are what transformers' GGUF loader needs (test_prepare_model writes a GGUF).
        "test": [
            "pytest>=8,<10",
            "pytest-xdist>=3.6,<4",
            "torch==2.13.0",
            "math-verify>=0.9,<1",
            "wandb>=0.31,<1",
            "tensorboard>=2.21,<3",
            "ruff>=0.17,<0.18",
            "gguf>=0.19,<0.20",
            "accelerate>=1.16,<2",
        ],
        # python -m dapo_jax.prepare_model: a GGUF file to a model folder (transformers de-quantizes
        # it into a torch model: torch's CPU wheel is enough).
        "gguf": ["gguf>=0.19,<0.20", "accelerate>=1.16,<2", "torch>=2.6"],
        "tracking": ["wandb>=0.31,<1", "tensorboard>=2.21,<3"],
        # gcsfs: etils.epath (metrics, events, plots, export, orbax's folders) opens gs:// with it.
        "gcs": ["gcsfs>=2024.2"],
        "tpu": ["jax[tpu]>=0.10.2,<0.11", "gcsfs>=2024.2"],
        "gpu": ["jax[cuda12]>=0.10.2,<0.11", "gcsfs>=2024.2"],  # tpu_setup/README.md, "GPUs"
    },
)
