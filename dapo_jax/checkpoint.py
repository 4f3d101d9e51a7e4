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
naming its step and why: `restore_latest` resumes from the newest one that restores, on every
process of a multi-host run the same one.
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import flags, logging
from flax import traverse_util

from dapo_jax import hosts, paths
from dapo_jax.errors import CheckpointError


class Checkpointer:
    """Keep-last-N asynchronous checkpoints under `<workdir>/checkpoints`, or `directory`."""

    def __init__(
        self,
        workdir: str,
        *,
        keep: int = 3,
        directory: str | None = None,
        read_only: bool = False,
    ):
        """`read_only` (evaluate, export): restores only, and leaves the temporary folders of a
        save in progress (a run still training in that workdir) alone."""
        # Orbax's barriers through the coordination service (with a timeout), not through a
        # device collective: its background thread's collective could otherwise run between the
        # main thread's in another order on another process, and all of them hang (seen on the
        # four-process CPU pod, tests/test_pod.py).
        flags.FLAGS.experimental_orbax_use_distributed_barrier = True
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            create=not read_only,
            enable_async_checkpointing=True,
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

    def agreed_steps(self) -> list[int]:
        """`all_steps()`, checked to be the same list on every process of the run (one
        all-gather); a CheckpointError naming each process's list where they differ."""
        steps = self.all_steps()
        seen = hosts.allgather_json(steps)
        if any(s != steps for s in seen):
            views = "; ".join(f"process {p}: {s}" for p, s in enumerate(seen))
            raise CheckpointError(
                f"the processes see different checkpoints in {self.directory} ({views}): give every "
                "process the same folder (--checkpoint_dir on storage they share, e.g. gs://)"
            )
        return steps

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
        """(step, state, host) of the newest checkpoint that restores on every process; None
        when there is none. The same step on every process of a multi-host run: they first check
        that they see the same checkpoints, and a step that fails to restore on any one of them
        (a transient read error included) is given up by all.

        A newer checkpoint that fails to restore is logged (its step and the error) and, once an
        older one has restored, deleted: the resumed run computes and saves that step again.
        Raises CheckpointError when checkpoints exist but none restores, or when the processes
        see different checkpoints."""
        steps = sorted(self.agreed_steps(), reverse=True)
        failed = []
        for step in steps:
            restored, reason = self._try_restore(step, abstract_state)
            reasons = [r for r in hosts.allgather_json(reason) if r]
            if not reasons:
                for bad, _ in failed:
                    self._manager.delete(bad)
                return step, *restored
            why = "; ".join(reasons)
            logging.warning("checkpoint %d in %s cannot be restored, skipped: %s", step, self.directory, why)
            failed.append((step, why))
        if failed:
            raise CheckpointError(
                f"no checkpoint in {self.directory} restores: "
                + "; ".join(f"{bad} ({why})" for bad, why in failed)
            )
        return None

    def _try_restore(self, step: int, abstract_state) -> tuple[tuple | None, str]:
        """((state, host), "") or (None, why it failed on this process)."""
        try:
            return self.restore(step, abstract_state), ""
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:500]
            prefix = f"process {jax.process_index()}: " if jax.process_count() > 1 else ""
            return None, prefix + reason

    def wait(self) -> None:
        """Block until the pending asynchronous save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
