"""The errors that a run reports as one line (`error: ...`, exit status 2), never as a traceback.

A run raises them before it compiles anything; `cli.one_line_errors` prints their message alone.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot run."""


class ModelFolderError(ConfigError):
    """A model folder (config.json, safetensors, tokenizer) that cannot be loaded as it is.

    The message is one line, `PATH: what is wrong; what to do`, and names the key or tensor.
    """

    def __init__(self, path: str, problem: str):
        super().__init__(" ".join(f"{path}: {problem}".split()))


class DataFileError(ConfigError):
    """A prompt file that cannot be read or holds no usable rows; the message names the file."""


class CheckpointError(RuntimeError):
    """A workdir whose checkpoints exist but none of which restores."""
