"""The one path layer of a run's files: local folders and `gs://` (or any URL) workdirs alike.

`etils.epath` (shipped with orbax) opens URLs through their filesystem; `os.path.abspath` would
turn `gs://bucket/run1` into the local folder `./gs:/bucket/run1`.
"""

from __future__ import annotations

from etils import epath


def is_url(path: str) -> bool:
    """Whether `path` names a remote filesystem (`gs://...`, `s3://...`), not a local one."""
    return "://" in str(path)


def run_path(path: str) -> epath.Path:
    """`path` as an epath: a URL unchanged, a local path made absolute."""
    return epath.Path(path) if is_url(path) else epath.Path(path).absolute()
