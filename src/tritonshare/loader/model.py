"""What makes a downloaded folder a Triton model, and the one edit the loader makes to it.

1. Find the model root: the folder holding ``config.pbtxt`` or numeric version folders, unwrapping one
   extra level (an archive of ``resnet/`` rather than of its content; modelmesh-runtime-adapter#25,
   kserve#1684).
2. Check it: at least one numeric version folder; ``config.pbtxt``, if present, is well-formed protobuf
   text format. A config Triton cannot parse is never loaded nor reported: POLL keeps the model
   name-only in its index and only logs "Poll failed for model directory" (seen here, Triton 2.51), so
   the loader would wait for nothing until its deadline. Catching it here turns that into exit 10 naming
   the file, line and column.
3. Set the config's top-level ``name`` to NAME (Triton refuses a name that differs from the folder's,
   REFERENCE §2), editing only that field's value so comments and layout stay as they were.

The checker is syntactic: Triton's ModelConfig schema (field names, enum values) is not importable
cheaply at run time — it ships with tritonclient, which pulls in gRPC — so an unknown field still
reaches Triton. Grammar (protobuf's text format, as Triton's C++ ``TextFormat`` reads it)::

    message := field*
    field   := name ( ":" value | message_value | "[" message_value,* "]" ) [";" | ","]
    name    := IDENT | "[" IDENT ("." | "/" IDENT)* "]"
    value   := message_value | "[" (message_value | scalar),* "]" | scalar
    message_value := "{" message "}" | "<" message ">"
    scalar  := STRING+ | ["-"] (NUMBER | IDENT)
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tritonshare.common.errors import InvalidModel

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.pbtxt"
_VERSION = re.compile(r"[0-9]+")
_IGNORED = re.compile(r"\..*|__MACOSX")  # hidden files and macOS archive debris never make a wrapper

_TOKEN = re.compile(
    r"""
     (?P<space>[ \t\r\n\f\v]+)
    |(?P<comment>\#[^\n]*)
    |(?P<string>"(?:[^"\\\n]|\\[^\n])*"|'(?:[^'\\\n]|\\[^\n])*')
    |(?P<number>0[xX][0-9A-Fa-f]+|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?[fF]?)
    |(?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<symbol>[{}\[\]<>:;,\-/.])
    """,
    re.VERBOSE,
)
_ESCAPE = re.compile(r"\\(?:[abfnrtv\\?'\"]|[0-7]{1,3}|x[0-9A-Fa-f]{1,2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8})")
_CLOSING = {"{": "}", "<": ">"}
MAX_DEPTH = 100  # protobuf's own default recursion limit for text format


@dataclass(frozen=True)
class Token:
    kind: str  # string | number | ident | symbol | end
    text: str
    start: int  # offsets into the config text
    end: int


@dataclass(frozen=True)
class NameField:
    """A top-level ``name`` field: where its value is, and whether that value is a string."""

    line: int
    value_start: int
    value_end: int
    is_string: bool


class ConfigSyntax:
    """Positions in one config text, for messages that name the file, line and column."""

    def __init__(self, text: str, where: str) -> None:
        self.text = text
        self.where = where
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def line_of(self, offset: int) -> int:
        return bisect.bisect_right(self._line_starts, offset)

    def error(self, offset: int, what: str) -> InvalidModel:
        line = self.line_of(offset)
        column = offset - self._line_starts[line - 1] + 1
        return InvalidModel(
            f"{self.where}: line {line}, column {column}: {what} — Triton cannot read this config.pbtxt; "
            "fix it in the model source"
        )


def tokenize(syntax: ConfigSyntax) -> list[Token]:
    text, tokens, pos = syntax.text, [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise syntax.error(pos, _unreadable(text[pos]))
        kind = m.lastgroup or ""
        if kind == "string":
            _check_escapes(syntax, m.start(), m.group())
        if kind == "number" and m.end() < len(text) and (text[m.end()].isalnum() or text[m.end()] == "_"):
            raise syntax.error(m.end(), f"a number runs into {text[m.end()]!r}; separate them with a space")
        if kind not in ("space", "comment"):
            tokens.append(Token(kind, m.group(), m.start(), m.end()))
        pos = m.end()
    tokens.append(Token("end", "", len(text), len(text)))
    return tokens


def _unreadable(char: str) -> str:
    if char in "\"'":
        return "a string is not closed on its line"
    return f"unexpected character {char!r}"


def _check_escapes(syntax: ConfigSyntax, start: int, literal: str) -> None:
    body, pos = literal[1:-1], 0
    while (pos := body.find("\\", pos)) >= 0:
        m = _ESCAPE.match(body, pos)
        if m is None:
            raise syntax.error(start + 1 + pos, f"invalid escape {body[pos : pos + 2]!r} in a string")
        pos = m.end()


class _Parser:
    """Recursive descent over the tokens; records the top-level ``name`` fields it meets."""

    def __init__(self, syntax: ConfigSyntax) -> None:
        self.syntax = syntax
        self.tokens = tokenize(syntax)
        self.pos = 0
        self.depth = 0
        self.names: list[NameField] = []

    @property
    def token(self) -> Token:
        return self.tokens[self.pos]

    def take(self) -> Token:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def expect(self, text: str, context: str) -> Token:
        if not self.at(text):
            raise self.fail(f"expected {text!r} {context}")
        return self.take()

    def fail(self, what: str) -> InvalidModel:
        found = "the end of the file" if self.token.kind == "end" else repr(self.token.text)
        return self.syntax.error(self.token.start, f"{what}, found {found}")

    def at(self, *symbols: str) -> bool:
        return self.token.kind == "symbol" and self.token.text in symbols

    def message(self, closing: str | None) -> None:
        while not (self.at(closing) if closing else self.token.kind == "end"):
            if self.token.kind == "end":
                raise self.fail(f"expected {closing!r} to close the message")
            self.field(top=closing is None)

    def field(self, *, top: bool) -> None:
        name = self.field_name()
        if self.at(":"):
            self.take()
            start = self.token.start
            is_string = self.value(name.text)
        else:
            start = self.token.start
            self.message_or_list(name.text)
            is_string = False
        if top and name.text == "name" and name.kind == "ident":
            line = self.syntax.line_of(name.start)
            self.names.append(NameField(line, start, self.tokens[self.pos - 1].end, is_string))
        if self.at(";", ","):
            self.take()

    def field_name(self) -> Token:
        if self.token.kind == "ident":
            return self.take()
        if self.at("["):
            first = self.take()
            self._type_name()
            self.expect("]", "to close the extension name")
            end = self.tokens[self.pos - 1].end
            return Token("extension", self.syntax.text[first.start : end], first.start, end)
        raise self.fail("expected a field name")

    def _type_name(self) -> None:
        while True:
            if self.token.kind != "ident":
                raise self.fail("expected a type name")
            self.take()
            if not self.at(".", "/"):
                return
            self.take()

    def message_or_list(self, field: str) -> None:
        """After a field name without ':', only a message or a list of messages may follow."""
        if self.at("["):
            self.list_of(field, scalars=False)
        elif self.at(*_CLOSING):
            self.message_value()
        else:
            raise self.fail(f"expected ':' or '{{' after the field name {field!r}")

    def value(self, field: str) -> bool:
        """A value after ':'; returns whether it was a string."""
        if self.at("["):
            self.list_of(field, scalars=True)
            return False
        if self.at(*_CLOSING):
            self.message_value()
            return False
        return self.scalar(field)

    def message_value(self) -> None:
        if self.depth >= MAX_DEPTH:
            raise self.fail(f"messages are nested more than {MAX_DEPTH} deep")
        opening = self.take().text
        self.depth += 1
        self.message(_CLOSING[opening])
        self.depth -= 1
        self.take()

    def list_of(self, field: str, *, scalars: bool) -> None:
        self.take()  # "["
        if self.at("]"):
            self.take()
            return
        while True:
            if self.at(*_CLOSING):
                self.message_value()
            elif scalars:
                self.scalar(field)
            else:
                raise self.fail(f"expected '{{' for an element of {field!r} (a list of values needs ':')")
            if self.at("]"):
                self.take()
                return
            self.expect(",", f"or ']' in the list of {field!r}")

    def scalar(self, field: str) -> bool:
        if self.token.kind == "string":
            while self.token.kind == "string":  # adjacent literals concatenate
                self.take()
            return True
        if self.at("-"):
            self.take()
            if self.token.kind not in ("number", "ident"):
                raise self.fail(f"expected a number after '-' in the value of {field!r}")
        if self.token.kind not in ("number", "ident"):
            raise self.fail(f"expected a value for {field!r}")
        self.take()
        return False


def parse_config(text: str, where: str) -> list[NameField]:
    """Check ``text`` is well-formed protobuf text format; return its top-level ``name`` fields."""
    parser = _Parser(ConfigSyntax(text, where))
    parser.message(None)
    return parser.names


def with_name(text: str, name: str, where: str) -> str:
    """``text`` with its top-level ``name`` set to ``name``: the value replaced in place, or a first line
    added when there is none. Everything else stays byte for byte."""
    names = parse_config(text, where)
    quoted = '"' + name + '"'  # model names are [A-Za-z0-9_.-]: nothing to escape (layout.check_model_name)
    if not names:
        return f"name: {quoted}\n{text}"
    if len(names) > 1:
        lines = ", ".join(str(n.line) for n in names)
        raise InvalidModel(f"{where}: 'name' is set more than once (lines {lines}) — keep one")
    field = names[0]
    if not field.is_string:
        raise InvalidModel(f"{where}: line {field.line}: 'name' must be a quoted string")
    return text[: field.value_start] + quoted + text[field.value_end :]


def is_model_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() or bool(version_dirs(path))


def version_dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if _VERSION.fullmatch(p.name) and p.is_dir())


def find_root(top: Path, label: str) -> Path:
    """The model folder in ``top``: ``top`` itself, or its one sub-folder (one wrapping level)."""
    if is_model_dir(top):
        return top
    entries = sorted(p for p in top.iterdir() if not _IGNORED.fullmatch(p.name))
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink() and is_model_dir(entries[0]):
        logger.info("model root is %s/ inside %s", entries[0].name, label)
        return entries[0]
    found = ", ".join(p.name + ("/" if p.is_dir() else "") for p in entries[:10]) or "nothing"
    raise InvalidModel(
        f"{label}: not a Triton model — expected config.pbtxt or numeric version folders (1/, 2/, …) at its "
        f"top or inside one wrapping folder, found {found}"
    )


def prepare(top: Path, name: str, label: str) -> Path:
    """Find and check the model in ``top``, set its config's name to ``name``; returns the model root."""
    root = find_root(top, label)
    if not version_dirs(root):
        raise InvalidModel(
            f"{label}: the model has no numeric version folder (1/, 2/, …) — Triton serves only versions; "
            "object stores keep no empty folders, so put a file such as 1/.keep in an otherwise empty one"
        )
    config = root / CONFIG_FILE
    if config.is_file():
        where = f"{label}: {config.relative_to(top).as_posix()}"
        text = _read_text(config, where)
        config.write_text(with_name(text, name, where), encoding="utf-8")
    block_bytecode(root)
    return root


def block_bytecode(root: Path) -> None:
    """Put a plain file named ``__pycache__`` beside every Python module of the model.

    The Python backend imports ``model.py`` from the model folder and, even with PYTHONDONTWRITEBYTECODE
    in Triton's environment, a ``__pycache__/`` folder appeared there (seen here, Triton 2.51): a change
    POLL may take for a new model version. Python skips writing bytecode when ``__pycache__`` is not a
    folder. Caches shipped with the model are dropped: they are derived files, rebuilt on import.
    """
    for folder, _dirs, files in os.walk(root):  # links are not followed: they point inside, already walked
        if not any(f.endswith(".py") for f in files):
            continue
        cache = Path(folder, "__pycache__")
        if cache.is_dir() and not cache.is_symlink():
            shutil.rmtree(cache)
        if not cache.exists():
            cache.touch()


def _read_text(path: Path, where: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidModel(f"{where}: not UTF-8 text (byte {exc.start}) — Triton reads text protobuf") from exc
