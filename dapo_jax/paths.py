"""The one path layer of a run's files: local folders and `gs://` (or any URL) workdirs alike.

`etils.epath` (shipped with orbax) opens URLs through their filesystem (fsspec's gcsfs for
`gs://`); `os.path.abspath` would turn `gs://bucket/run1` into the local folder
`./gs:/bucket/run1`. Everything a run writes or reads back in its workdir goes through here:
orbax checkpoints, metrics.jsonl, TensorBoard events (`tensorboard_writers`), plots and the
Hugging Face export (`upload_tree`).
"""

from __future__ import annotations

import io
import os
import shutil

from etils import epath

URL_SCHEMES = ("gs", "s3", "az", "hf")  # the ones epath opens; others would become local paths


def is_url(path) -> bool:
    """Whether `path` names a remote filesystem (`gs://...`, `s3://...`), not a local one."""
    return "://" in str(path)


def run_path(path) -> epath.Path:
    """`path` as an epath: a URL unchanged, a local path made absolute. A URL of a scheme that
    epath cannot open is a ValueError (epath would read it as a local path)."""
    if is_url(path):
        scheme = str(path).split("://", 1)[0]
        if scheme not in URL_SCHEMES:
            raise ValueError(
                f"{path}: {scheme}:// is not supported; use a local path or "
                + ", ".join(f"{s}://" for s in URL_SCHEMES)
            )
        return epath.Path(path)
    return epath.Path(path).absolute()


def write_text_atomic(path: epath.Path, text: str) -> None:
    """Write `path` whole: a reader (or a kill mid-write) sees the old or the new file, never a
    part (a rename locally; an object store's upload is atomic by itself)."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(text)
    tmp.replace(path)


def upload_tree(local_dir: str, dest) -> epath.Path:
    """Copy the files of the local folder `local_dir` (recursively) to `dest` (a URL or a local
    folder), replacing files of the same names; returns `dest` as an epath."""
    dest = run_path(dest)
    for root, _, files in os.walk(local_dir):
        target = dest / os.path.relpath(root, local_dir) if root != local_dir else dest
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            with open(os.path.join(root, name), "rb") as src, (target / name).open("wb") as dst:
                shutil.copyfileobj(src, dst, 2**24)
    return dest


class _EpathRecordWriter:
    """A TensorBoard event file on a URL: records are kept in memory and the whole file is
    written on each flush (object stores cannot append); events files are small."""

    def __init__(self, path: str):
        self._path, self._buffer = epath.Path(path), io.BytesIO()

    def write(self, data: bytes) -> None:
        self._buffer.write(data)

    def flush(self) -> None:
        self._path.write_bytes(self._buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _EpathWriterFactory:
    def open(self, path: str) -> _EpathRecordWriter:
        return _EpathRecordWriter(path)

    def directory_check(self, path: str) -> None:
        epath.Path(path).mkdir(parents=True, exist_ok=True)


def tensorboard_writers() -> None:
    """Route tensorboardX's event files on URLs through epath (its own `gs://` writer needs
    google-cloud-storage and ignores epath); local logdirs keep tensorboardX's own files.
    tensorboardX is imported here, not at the top: it imports torch when torch is installed
    (~175 MiB of resident memory that a run writing no TensorBoard events does not need)."""
    from tensorboardX import record_writer  # noqa: PLC0415

    for scheme in URL_SCHEMES:
        record_writer.register_writer_factory(scheme, _EpathWriterFactory())
