"""What a request constrains its output to: vLLM's ``StructuredOutputsParams`` fields."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# The largest grammar source (schema text, regex, grammar, joined choices) accepted, in
# characters; compile limits (compiler.py) bound the work for anything below it.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: a JSON schema (``json``, a dict or its JSON text), any JSON
    object (``json_object``), a regular expression, a list of literal ``choice``s, or a
    context-free ``grammar`` (Lark or GBNF syntax).

    ``disable_any_whitespace`` makes JSON compact (no whitespace between tokens);
    ``whitespace_pattern`` is the regex JSON whitespace must match instead. Invalid values
    raise ValueError naming the field; a grammar that does not compile fails when compiled.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"json is not valid JSON: {exc}") from None
            object.__setattr__(self, "json", schema)
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("json must be a JSON schema object")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("json_object must be a boolean")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        if self.choice is not None:
            choice = self.choice
            if (
                not isinstance(choice, (list, tuple))
                or not choice
                or any(not isinstance(c, str) or not c for c in choice)
            ):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            if len(choice) > MAX_CHOICES:
                raise ValueError(f"choice takes at most {MAX_CHOICES} strings")
            object.__setattr__(self, "choice", tuple(choice))
        if self.whitespace_pattern is not None and self.kind not in ("json", "json_object"):
            raise ValueError("whitespace_pattern applies only to json and json_object")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("disable_any_whitespace must be a boolean")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"{self.kind} is {len(self.source)} characters; at most {MAX_GRAMMAR_CHARS}"
            )

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutputsParams:
        """From vLLM's JSON object form; unknown keys raise ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs does not support {', '.join(unknown)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def source(self) -> str:
        """The constraint as one string (a schema keeps its key order: properties are generated
        in the order given)."""
        if self.json is not None:
            return json.dumps(self.json, ensure_ascii=False)
        if self.choice is not None:
            return json.dumps(list(self.choice), ensure_ascii=False)
        if self.json_object:
            return "{}"
        return str(self.regex if self.regex is not None else self.grammar)

    @property
    def key(self) -> tuple[str, str, bool, str | None]:
        """The compile cache key: equal keys compile to the same grammar."""
        return (self.kind, self.source, self.disable_any_whitespace, self.whitespace_pattern)
