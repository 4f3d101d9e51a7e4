"""The paper's data in our parquet format, from the Hugging Face Hub or from local copies:

    python -m dapo_jax.prepare_data --out_dir=/data
    python -m dapo_jax.prepare_data --out_dir=/data --dapo_math=~/dl/dapo-math-17k.parquet \
        --aime=~/dl/aime-2024.parquet

writes `<out_dir>/dapo-math-17k.parquet` and `<out_dir>/aime-2024.parquet`, the names
configs/dapo.py reads. Each source is a local parquet/jsonl file or a Hub dataset id (the
recipe's: BytedTsinghua-SIA/DAPO-Math-17k and BytedTsinghua-SIA/AIME-2024, fetched through the
Hub cache; HF_HUB_OFFLINE=1 reads the cache alone). Rows are kept as the source has them
(prompt, reward_model.ground_truth, data_source, extra_info, ...), malformed ones dropped, and each
problem text once: the published DAPO-Math-17k repeats its ~17k problems ~100 times and AIME 2024
its 30 problems 32 times. The counts of both drops are printed.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
from absl import app, flags

from dapo_jax import data, hub
from dapo_jax.errors import ConfigError, one_line_errors

SOURCES = {
    "dapo-math-17k.parquet": "BytedTsinghua-SIA/DAPO-Math-17k",
    "aime-2024.parquet": "BytedTsinghua-SIA/AIME-2024",
}

_OUT_DIR = flags.DEFINE_string("out_dir", None, "folder for the parquet files")
_DAPO_MATH = flags.DEFINE_string(
    "dapo_math", SOURCES["dapo-math-17k.parquet"], "DAPO-Math-17k: a local file or a Hub dataset id"
)
_AIME = flags.DEFINE_string(
    "aime", SOURCES["aime-2024.parquet"], "AIME 2024: a local file or a Hub dataset id"
)


def prepare(source: str, out_path: str) -> dict:
    """Writes the deduplicated well-formed rows of `source` (file or Hub id) to `out_path`;
    returns the counts {"rows", "problems", "duplicates", "malformed"}."""
    rows, counts = [], {"rows": 0, "problems": 0, "duplicates": 0, "malformed": 0}
    seen = set()
    for path in hub.resolve_data(os.path.expanduser(source), "source"):
        kept, n_rows, n_malformed, n_duplicates = data.unique_rows(path, seen)  # across files
        rows += kept
        for key, n in (("rows", n_rows), ("malformed", n_malformed), ("duplicates", n_duplicates)):
            counts[key] += n
    counts["problems"] = len(rows)
    if not rows:
        raise ConfigError(f"{source}: no well-formed rows ({counts['rows']} read)")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out_path)
    return counts


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if _OUT_DIR.value is None:
        raise app.UsageError("--out_dir is required")
    for name, source in (("dapo-math-17k.parquet", _DAPO_MATH.value), ("aime-2024.parquet", _AIME.value)):
        out = os.path.join(_OUT_DIR.value, name)
        with one_line_errors():
            n = prepare(source, out)
        print(
            f"{out}: {n['problems']} problems from {n['rows']} rows of {source} "
            f"({n['duplicates']} duplicates and {n['malformed']} malformed rows dropped)"
        )


if __name__ == "__main__":
    app.run(main)
