"""Orbax checkpoints of a run: the sharded train state and the host-side state beside it.

One checkpoint per saved step holds two items:
- `state`: the device pytree (policy params, optimizer state, step), restored straight into the
  shardings of an abstract target, so nothing is gathered on one host;
- `host`: everything else a resumed run needs to continue exactly where the saved one would have
  gone: the PRNG key, the data iterator's position, the dynamic-sampling filter's carried groups
  (numpy arrays), counters. A nested dict of numpy arrays and scalars, nothing pickled. Orbax
  cannot write zero-size arrays or empty dicts (an empty carry), so those travel in `meta`.

Saves are asynchronous (the next step runs while the files are written); only complete
checkpoints are listed, so a run killed mid-save resumes from the previous one, and the temporary
folders such a save leaves are removed when the next run opens the folder. A listed checkpoint
whose files were damaged afterwards (truncated, garbled) is skipped at restore with a warning
naming its step and why: `restore_latest` resumes from the newest one that restores.
"""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import traverse_util

from dapo_jax import paths
from dapo_jax.errors import CheckpointError


class Checkpointer:
    """Keep-last-N asynchronous checkpoints under `<workdir>/checkpoints`, or `directory`."""

    def __init__(
        self,
        workdir: str,
        *,
        keep: int = 3,
        asynchronous: bool = True,
        directory: str | None = None,
        read_only: bool = False,
    ):
        """`read_only` (evaluate, export): restores only, and leaves the temporary folders of a
        save in progress (a run still training in that workdir) alone."""
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            create=not read_only,
            enable_async_checkpointing=asynchronous,
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,
        )
        self.directory = (
            paths.run_path(directory)
            if directory  # gs:// stays a URL
            else paths.run_path(workdir) / "checkpoints"
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "host", "meta")
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state, host: dict) -> None:
        """Start saving; returns before the files are written unless the manager is synchronous."""
        flat = traverse_util.flatten_dict(host, keep_empty_nodes=True)
        empty_dicts = ["/".join(k) for k, v in flat.items() if v is traverse_util.empty_node]
        flat = {"/".join(k): np.asarray(v) for k, v in flat.items() if v is not traverse_util.empty_node}
        arrays = {k: v for k, v in flat.items() if v.size}
        arrays["saved_step"] = np.asarray(step)  # also keeps the item non-empty, as orbax requires
        empty = {k: [list(v.shape), v.dtype.str] for k, v in flat.items() if not v.size}
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                host=ocp.args.PyTreeSave(arrays),
                meta=ocp.args.JsonSave({"empty": empty, "empty_dicts": empty_dicts}),
            ),
            force=True,
        )

    def restore(self, step: int, abstract_state) -> tuple[object, dict]:
        """(state with the shardings of `abstract_state`, host dict of numpy arrays)."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                host=ocp.args.PyTreeRestore(),
                meta=ocp.args.JsonRestore(),
            ),
        )
        flat = {k: np.asarray(v) for k, v in restored["host"].items()}
        if int(flat.pop("saved_step")) != step:
            raise ValueError(f"{self.directory}: checkpoint {step} holds the host state of another step")
        for k, (shape, dtype) in restored["meta"]["empty"].items():
            flat[k] = np.zeros(shape, np.dtype(dtype))
        for k in restored["meta"]["empty_dicts"]:
            flat[k] = traverse_util.empty_node
        host = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})
        return restored["state"], host

    def restore_latest(self, abstract_state) -> tuple[int, object, dict] | None:
        """(step, state, host) of the newest checkpoint that restores; None when there is none.

        A newer checkpoint that fails to restore is logged (its step and the error) and, once an
        older one has restored, deleted: the resumed run computes and saves that step again.
        Raises CheckpointError when checkpoints exist but none restores."""
        failed = []
        for step in sorted(self.all_steps(), reverse=True):
            try:
                state, host = self.restore(step, abstract_state)
            except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
                reason = " ".join(f"{type(e).__name__}: {e}".split())[:500]
                logging.warning(
                    "checkpoint %d in %s cannot be restored, skipped: %s", step, self.directory, reason
                )
                failed.append((step, reason))
                continue
            for bad, _ in failed:
                self._manager.delete(bad)
            return step, state, host
        if failed:
            raise CheckpointError(
                f"no checkpoint in {self.directory} restores: "
                + "; ".join(f"{bad} ({why})" for bad, why in failed)
            )
        return None

    def wait(self) -> None:
        """Block until the pending asynchronous save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
