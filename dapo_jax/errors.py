"""The errors that a run reports as one line (`error: ...`, exit status 2), never as a traceback.

A run raises them before it compiles anything; a command's `one_line_errors` prints their message
alone.
"""

from __future__ import annotations

import contextlib
import sys


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


class HostDisagreement(RuntimeError):
    """Processes of one run hold different values of what must be equal on all of them."""


@contextlib.contextmanager
def one_line_errors():
    """A bad config, checkpoint or missing file ends the command with its message alone, status 2;
    processes that disagree (every one raises at the same check) with status 1."""
    try:
        yield
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except HostDisagreement as e:
        import jax  # noqa: PLC0415 - only a multi-process run gets here; the light commands skip jax

        print(f"error: process {jax.process_index()}: {e}", file=sys.stderr)
        sys.exit(1)
