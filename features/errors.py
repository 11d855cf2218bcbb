"""One error type for every bad feature value, carrying the field's name so that an HTTP layer can answer
422 naming it and a CLI can print it without a traceback."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError

# Longest problem text kept: a message quotes the bad value, and a hostile one (a string of megabytes) must not
# come back whole in the answer or fill the log.
MAX_PROBLEM_CHARS = 300


class FeatureError(ValueError):
    """A feature value is missing, of the wrong type, or out of range."""

    def __init__(self, field: str, problem: str) -> None:
        if len(problem) > MAX_PROBLEM_CHARS:
            problem = f"{problem[: MAX_PROBLEM_CHARS - 20]}... ({len(problem):,} characters)"
        self.field = field[:MAX_PROBLEM_CHARS]
        self.problem = problem
        super().__init__(f"{self.field}: {problem}")  # the field as bounded: a huge one was the whole message

    def under(self, where: str) -> FeatureError:
        """This error as one of the value at `where`: its field below it (`rows[3].kv_cache_percentage`), or
        `where` itself when the error names no field, because the value there is the bad one (a row that is not an
        object is `rows[3]`, not `rows[3].row`: a row has no field of that name).

        >>> FeatureError("kv_cache_percentage", "must be ≤ 1").under("rows[3]").field
        'rows[3].kv_cache_percentage'
        >>> str(FeatureError("", "must be a JSON object, got int").under("rows[3]"))
        'rows[3]: must be a JSON object, got int'
        """
        return FeatureError(f"{where}.{self.field}" if self.field else where, self.problem)


def field_path(loc: Iterable[object]) -> str:
    """A pydantic error location as the path a user writes: `plugins[0].ref`.

    >>> field_path(("plugins", 0, "ref"))
    'plugins[0].ref'

    A mapping's key that is refused (pydantic ends its location with the key and "[key]") is named as a key, not as
    an index of a list nobody wrote:

    >>> field_path(("plugins", 0, "parameters", 1, "[key]"))
    'plugins[0].parameters (its key 1)'
    """
    parts = list(loc)
    where = ""
    for i, part in enumerate(parts):
        if part == "[key]":
            continue
        if i + 1 < len(parts) and parts[i + 1] == "[key]":
            where += f" (its key {part!r})" if isinstance(part, str) else f" (its key {part})"
        else:
            where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
    return where


def problem_text(msg: object) -> str:
    """A pydantic error message as a user reads it: a validator's own words, without "Value error, "."""
    return str(msg).removeprefix("Value error, ")


def expected_mapping(model: type[BaseModel]) -> str:
    """What a part of a file read into `model` should be, by the keys the file writes (the fields' aliases).

    >>> from pydantic import BaseModel, Field
    >>> class Plugin(BaseModel):
    ...     plugin_ref: str = Field(alias="pluginRef")
    ...     weight: float = 1.0
    >>> expected_mapping(Plugin)
    'expected a mapping {pluginRef, weight}'
    """
    return "expected a mapping {" + ", ".join(f.alias or name for name, f in model.model_fields.items()) + "}"


def validation_problem(err: ValidationError, expected: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(where, problem) of a pydantic ValidationError's first error, for a message that names the field: where
    as a `field_path` (empty for a check of several fields together), the problem without pydantic's
    "Value error, " prefix. Every edge that turns a validation error into an answer or a CLI message says it
    this one way.

    `expected`, for a file's reader: what a misshapen part of the file should be, by its model's class name or by
    the mapping field's name (`expected_mapping`). Pydantic's "a valid dictionary or instance of _GroupSpec" names
    a class the file's author never sees: with `expected`, a part that is not its model's mapping is "expected a
    mapping" whatever its class.

    >>> from pydantic import BaseModel, ValidationError, field_validator
    >>> class Plugin(BaseModel):
    ...     ref: str
    ...     @field_validator("ref")
    ...     @classmethod
    ...     def named(cls, ref: str) -> str:
    ...         if not ref:
    ...             raise ValueError("must not be empty")
    ...         return ref
    >>> class Config(BaseModel):
    ...     plugins: list[Plugin]
    >>> try:
    ...     Config.model_validate({"plugins": [{"ref": "a"}, {"ref": ""}]})
    ... except ValidationError as err:
    ...     validation_problem(err)
    ('plugins[1].ref', 'must not be empty')

    A key the model does not know is named before the errors it explains (a misspelled key leaves the one meant
    missing), and a value outside a fixed set is quoted:

    >>> from typing import Literal
    >>> from pydantic import ConfigDict
    >>> class Pool(BaseModel):
    ...     model_config = ConfigDict(extra="forbid")
    ...     role: Literal["prefill", "decode"]
    >>> for bad in ({"rol": "decode"}, {"role": "Decode"}):
    ...     try:
    ...         Pool.model_validate(bad)
    ...     except ValidationError as err:
    ...         validation_problem(err)
    ('rol', 'Extra inputs are not permitted')
    ('role', "Input should be 'prefill' or 'decode', got 'Decode'")
    """
    errors = err.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    where, problem = field_path(first["loc"]), problem_text(first["msg"])
    if first["type"] in ("literal_error", "enum"):
        got = repr(first.get("input"))
        problem += f", got {got if len(got) <= 60 else got[:57] + '...'}"
    for error in errors:
        if expected is None or field_path(error["loc"]) != where:
            continue
        if error["type"] == "model_type":
            problem = expected.get(error.get("ctx", {}).get("class_name", ""), "expected a mapping")
        elif error["type"] == "dict_type" and error["loc"]:
            problem = expected.get(str(error["loc"][-1]), problem)
    return where, problem


def without_index(message: str) -> str:
    """A message about one item of a list as one about any of them: the same refusal of another row reads alike.

    >>> without_index("rows[3].accelerator: unknown accelerator class 'b200'")
    "accelerator: unknown accelerator class 'b200'"
    """
    return re.sub(r"^\w+\[\d+\]\.", "", message)


class ReasonsSaid:
    """The reasons a warning was given for, so that it is given once per reason, whichever row it was about: a
    line per row or batch floods the log and hides the rest. At most `limit` are kept (a reason may quote a value,
    and values are unbounded); past them nothing more is said.

    >>> said = ReasonsSaid()
    >>> said.first("rows[0].accelerator: unknown"), said.first("rows[7].accelerator: unknown"), said.first("x: y")
    (True, False, True)
    """

    def __init__(self, limit: int = 32) -> None:
        self.limit = limit
        self._said: set[str] = set()

    def first(self, message: str) -> bool:
        """Whether `message`'s reason is said for the first time (it is remembered as said)."""
        reason = without_index(message)
        if reason in self._said or len(self._said) >= self.limit:
            return False
        self._said.add(reason)
        return True
