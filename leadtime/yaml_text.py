"""YAML as users write it: the files they hand to Leadtime (fleets, plugin configurations, discovery, time-slice
states). PyYAML keeps the last of a key written twice, so `count: 2` followed further down by `count: 3` would run
with 3 and say nothing; here it is an error naming where (and in JSON, `load_json`). `yaml_problem` says what is
wrong in one line, for every file a user hands over alike. `Real`, `Integer` and `Boolean` are the numbers and
switches of such files as pydantic fields: what YAML gives for them, taken as its author meant it (a boolean or a
quoted number is not a number, a number or a quoted word not a switch). Imports nothing else of Leadtime's.
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Hashable
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BeforeValidator, Strict
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode

MAX_FILE_BYTES = 1 << 20
"""Largest YAML file a user hands over that is read (fleets and catalogs are a few kilobytes)."""


class _UniqueKeys(yaml.SafeLoader):
    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Hashable] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # what a `<<` merge brings may be overridden, as YAML allows
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable):
                if key in seen:
                    raise ConstructorError(None, None, f"the key {key!r} is given twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, refusing a key given twice in one mapping (yaml.YAMLError, with the line).

    >>> load_yaml("pools: [{name: a, count: 2}]")
    {'pools': [{'name': 'a', 'count': 2}]}
    >>> try:
    ...     load_yaml("name: a\\ncount: 2\\ncount: 3\\n")
    ... except yaml.YAMLError as err:
    ...     print(err.problem, "at line", err.problem_mark.line + 1)
    the key 'count' is given twice at line 3
    """
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} is given twice")
        out[key] = value
    return out


def load_json(text: str) -> Any:
    """`json.loads`, refusing a key given twice in one object (ValueError), as `load_yaml` does: JSON keeps the
    last silently, so a second "endpoints" list in a discovery file would drop every endpoint of the first.

    >>> load_json('{"a": 1, "a": 2}')
    Traceback (most recent call last):
    ...
    ValueError: the key 'a' is given twice
    """
    return json.loads(text, object_pairs_hook=_unique_keys)


def yaml_problem(err: Exception) -> str:
    """What `load_yaml` refused, on one line: where and what. PyYAML's own message spans several, quoting the text
    with a caret, which breaks a CLI's one-line errors; a ValueError (bad UTF-8, an integer of thousands of digits)
    is joined onto one line as it is.

    >>> try:
    ...     load_yaml("plugins:\\n\\t- type: queue-scorer\\n")
    ... except yaml.YAMLError as err:
    ...     print(yaml_problem(err))
    line 2, column 1: found character '\\t' that cannot start any token
    """
    if isinstance(err, yaml.MarkedYAMLError) and err.problem and err.problem_mark is not None:
        mark = err.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {err.problem}"
    return " ".join(str(err).split())


def read_yaml_file(path: Path, kind: str) -> Any:
    """A user's YAML file parsed (`load_yaml`); ValueError saying on one line, after the file's name, why it cannot
    be: not a regular file, larger than `MAX_FILE_BYTES`, unreadable, not UTF-8, not YAML, nested too deeply.
    `kind` names what the file should be ("a fleet YAML"). Only a regular file is read: /dev/zero or a named pipe
    nobody writes was read for ever.
    """
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise ValueError(f"{path}: is a directory (expected {kind})")
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: not a regular file (expected {kind})")
        with path.open("rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise ValueError(
            f"{path}: {err.strerror.lower() if err.strerror else err}"
        ) from None  # lower case, as data.describe_os_error
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{path}: larger than 1 MiB (expected {kind})")
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text (expected {kind})") from None
    try:
        return load_yaml(text)
    except (yaml.YAMLError, ValueError) as err:  # ValueError: an integer of thousands of digits
        raise ValueError(f"{path}: not valid YAML ({yaml_problem(err)})") from None
    except RecursionError:
        raise ValueError(f"{path}: not {kind} (nested too deeply)") from None


_EXPONENT_TEXT = re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+")
"""A number in exponent notation that PyYAML leaves as text: its YAML 1.1 resolver wants a dot and a signed
exponent (`1.0e+3`), so `1e3`, `2.25e3` and `1.0e3` come as strings."""


def yaml_number(value: object) -> object:
    """A YAML file's number as its author wrote it, for pydantic to check further (`Real`): `true` was read as 1 and
    `"8"` as 8 by pydantic's lax mode, so a boolean or a quoted number is refused; a number in exponent notation
    PyYAML leaves as text (`1e3`, `_EXPONENT_TEXT`) is the number a reader of the file sees.

    >>> yaml_number(load_yaml("x: 2.25e3")["x"]), yaml_number(5)
    (2250.0, 5)
    >>> for bad in (True, "8"):
    ...     try:
    ...         yaml_number(bad)
    ...     except ValueError as err:
    ...         print(err)
    must be a number, got True
    must be a number, got '8' (text: unquote it)
    """
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {value}")
    if isinstance(value, str):
        if _EXPONENT_TEXT.fullmatch(value):
            return float(value.replace("_", ""))
        hint = " (text: unquote it)" if _is_number_text(value) else ""
        raise ValueError(f"must be a number, got {value[:40]!r}{hint}")
    return value


def _is_number_text(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


Real = Annotated[float, BeforeValidator(yaml_number)]
"""A number field of a user's YAML file (`yaml_number`); its bounds, and `allow_inf_nan`, are the field's own."""
Integer = Annotated[int, Strict()]
"""An integer field of a user's YAML file: an integer as written (`count: true` was taken as 1, `"8"` as 8, `2.5`
refused only for its fraction)."""
Boolean = Annotated[bool, Strict()]
"""A switch of a user's YAML file: true or false as written (pydantic read a quoted `'no'` as false and `1` as true)."""
