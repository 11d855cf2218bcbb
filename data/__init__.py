"""The real data files Leadtime ships (see README.md here): their names, and turning a name or a path into a file.

Commands take either a shipped name (`mooncake`, `sharegpt-h200`, ...) or a path wherever they take a file, and a
file that is missing or unreadable is reported as one line naming the path and what was expected there.
Imports nothing else of Leadtime's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from importlib.resources import files
from pathlib import Path

HERE = Path(str(files(__name__)))

TRACES: Mapping[str, Path] = {
    "mooncake": HERE / "traces" / "mooncake_conversation_trace.jsonl",
    "azure-conv": HERE / "traces" / "AzureLLMInferenceTrace_conv_2023.csv",
}
MEASURED: Mapping[str, Path] = {
    "sharegpt-h200": HERE / "measured" / "sharegpt-h200.jsonl",
}
SPLITWISE = HERE / "calibration" / "splitwise_sim_perf_model.csv"
KERNEL_TABLES = HERE / "calibration"  # the vLLM 0.14 kernel timing tables, <gpu>_vllm0.14_<kernel>.csv


class DataFileError(ValueError):
    """A file given to a command that is missing, unreadable or not what was expected; the message is one line."""


def resolve(value: str | os.PathLike[str], shipped: Mapping[str, Path], what: str) -> Path:
    """The file a user named: an existing file, else a shipped name, else an error naming what is wrong.

    >>> resolve("mooncake", TRACES, "a trace").name
    'mooncake_conversation_trace.jsonl'
    >>> resolve("azure_conv", TRACES, "a trace").name  # names take "-" and "_" alike
    'AzureLLMInferenceTrace_conv_2023.csv'
    >>> try:
    ...     resolve("no-such.jsonl", TRACES, "a trace")
    ... except DataFileError as err:
    ...     print(err)
    no-such.jsonl: no such file (expected a trace, or one of the shipped names: mooncake, azure-conv)
    """
    text = os.fspath(value)
    name = shipped_name(text, shipped)
    if name is not None and not Path(text).is_file():
        return shipped[name]
    return readable_file(Path(text), what, shipped)


def shipped_name(text: str, names: Iterable[str]) -> str | None:
    """The one of `names` that `text` spells, "-" and "_" taken alike (`pd-hetero` for `pd_hetero`), else None.

    >>> shipped_name("pd-hetero", ["pd", "pd_hetero"]), shipped_name("sharegpt_h200", ["sharegpt-h200"])
    ('pd_hetero', 'sharegpt-h200')
    """
    wanted = text.replace("_", "-")
    return next((name for name in names if name.replace("_", "-") == wanted), None)


def readable_file(path: Path, what: str, shipped: Mapping[str, Path] | None = None) -> Path:
    """`path` itself if it is a readable file, else a DataFileError saying what is wrong with it."""
    names = f", or one of the shipped names: {', '.join(shipped)}" if shipped else ""
    if not path.exists():
        raise DataFileError(f"{path}: no such file (expected {what}{names})")
    if path.is_dir():
        raise DataFileError(f"{path}: is a directory (expected {what}{names})")
    if not os.access(path, os.R_OK):
        raise DataFileError(f"{path}: not readable (expected {what})")
    return path


def describe_os_error(err: OSError) -> str:
    """One line for an OSError met while reading or writing a file, without Python's errno formatting."""
    reason = (err.strerror or str(err)).lower()
    return f"{err.filename}: {reason}" if err.filename else reason
