"""The module path checkpoints had before they were split into rooms, kept for what names it:
the `pcompile-merge` entry point of installs made before (`pcompile.backends.checkpoint:main`),
`python -m pcompile.backends.checkpoint OUT_DIR`, and code that imports from here. New code
imports from the rooms: backends/checkpoint_files.py (the per-rank checkpoint files: format,
write, verified read, resume point), backends/checkpoint_merge.py (`pcompile-merge`),
backends/atomic_files.py (atomic writes) and backends/npz_files.py (deterministic .npz).
"""

from __future__ import annotations

import sys

from pcompile.backends.atomic_files import (
    atomic_fill,
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    clean_temp_files,
    temp_name,
)
from pcompile.backends.checkpoint_files import (
    FORMAT,
    META_KEY,
    CheckpointError,
    CheckpointReader,
    ResumePoint,
    WriteReport,
    checkpoint_path,
    checkpoint_problem,
    clear_checkpoints,
    layout_entry,
    rank_steps,
    read_checkpoint,
    resume_point,
    tensors_path,
    write_checkpoint,
    write_checkpoint_report,
)
from pcompile.backends.checkpoint_merge import (
    folder_plan_id,
    main,
    merge_checkpoints,
    merge_command,
    merged_tensors,
)
from pcompile.backends.merge_output import MergeError
from pcompile.backends.npz_files import (
    DTYPES_KEY,
    LazyNpz,
    load_npz,
    npz_bytes,
    portable,
    restore_dtypes,
    save_npz,
    write_npz,
)

__all__ = [
    "DTYPES_KEY",
    "FORMAT",
    "META_KEY",
    "CheckpointError",
    "CheckpointReader",
    "LazyNpz",
    "MergeError",
    "ResumePoint",
    "WriteReport",
    "atomic_fill",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "checkpoint_path",
    "checkpoint_problem",
    "clean_temp_files",
    "clear_checkpoints",
    "folder_plan_id",
    "layout_entry",
    "load_npz",
    "main",
    "merge_checkpoints",
    "merge_command",
    "merged_tensors",
    "npz_bytes",
    "portable",
    "rank_steps",
    "read_checkpoint",
    "restore_dtypes",
    "resume_point",
    "save_npz",
    "temp_name",
    "tensors_path",
    "write_checkpoint",
    "write_checkpoint_report",
    "write_npz",
]

if __name__ == "__main__":
    sys.exit(main())
