"""What makes a downloaded folder a Triton model, and the edits the loader makes to it.

1. Find the model root: the folder holding ``config.pbtxt`` or numeric version folders, unwrapping one
   extra level (an archive of ``resnet/`` rather than of its content; modelmesh-runtime-adapter#25,
   kserve#1684).
2. Check it: at least one version folder as Triton counts them (``0``, ``1``, …: none with a leading zero),
   and no folder Triton would read as a number beyond int64 — Triton 2.51 aborts on one (``std::stoll``'s
   out_of_range, uncaught), every tenant's model with it; ``config.pbtxt``, if present, is a ModelConfig
   Triton can read. A config Triton cannot read is never loaded nor reported: POLL keeps the model name-only in
   its index and only logs "Poll failed for model directory" (seen here, Triton 2.51), so the loader
   would wait for nothing until its deadline. Checking here turns that into exit 10 naming the file,
   line, column and what to change.
3. Set the config's top-level ``name`` to NAME (Triton refuses a name that differs from the folder's,
   REFERENCE §2), editing only that field's value so comments and layout stay as they were.

Before these, every file's mode is opened to what Triton, another user than the loader (k8s/base: 1000 and
65532), can read (:func:`open_modes`): archives keep the modes they were packed with.

Triton reads the file with protobuf's C++ ``TextFormat::Parse`` into its ModelConfig. The check does the
same in two passes, each agreeing with Triton 2.51 on every case the tests list (compared here):

- :func:`tokenize` refuses what Python's text parser reads but the C++ one does not: unknown string
  escapes (``\\q``), Python's integer spellings (``0b10``, ``1_0``, ``+1``) and non-ASCII characters
  outside strings (a no-break space pasted from a web page). Its tokens also locate the ``name`` field.
- :func:`check_schema` runs protobuf's text parser against Triton's ModelConfig schema
  (:mod:`tritonshare.loader.model_config_pb2`): the structure, field names, enum names, value types and
  ranges, a singular field set twice, two members of one oneof.

The schema is the newest tritonshare ships, so a field added after the Triton a node runs still reaches
that Triton (``model_metrics`` on Triton 2.51) and ends in exit 13; the opposite choice, an older schema,
would refuse models a newer Triton serves. For a Triton newer than the schema, ``lenient`` checking
(``tritonshare load --config-check lenient``) lets fields the schema does not know through to Triton, with a
warning naming the first one; everything the schema knows is still checked.
"""

from __future__ import annotations

import bisect
import difflib
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonshare.common.errors import InvalidModel, UnsafeArchive
from tritonshare.common.repository import RECORD_FILE, disk_error
from tritonshare.loader.config_limits import check_data_files, check_load_data
from tritonshare.loader.config_rules import check_triton_rules

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.pbtxt"
# A version folder as Triton 2.51 takes one (model_lifecycle.cc, VersionsToLoad): it skips a name of more than
# one character beginning with '0' ("leading zeros"), then reads the rest with std::stoll.
_VERSION = re.compile(r"0|[1-9][0-9]*")
# What std::stoll reads from the start of a name: white space, a sign, digits; it stops at the first other
# character. A number beyond int64 throws std::out_of_range, which Triton does not catch: the server aborts.
_STOLL = re.compile(r"[ \t\n\v\f\r]*(?P<number>[+-]?[0-9]+)")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_BACKEND_LIBRARY = re.compile(r"libtriton_.*\.so")  # Triton's name for a backend's library: libtriton_<backend>.so
_IGNORED = re.compile(r"\..*|__MACOSX")  # hidden files and macOS archive debris never make a wrapper

# The tokens of protobuf's text format as the C++ tokenizer reads them (whitespace is ASCII only there).
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
_OPENING, _CLOSING = frozenset("{<"), frozenset("}>")
_HINT = "Triton cannot read this config.pbtxt; fix it in the model source"
FILE_MODE, EXECUTABLE_MODE, FOLDER_MODE = 0o644, 0o755, 0o755  # what Triton, another user, can read


@dataclass(frozen=True)
class Token:
    kind: str  # string | number | ident | symbol
    text: str
    start: int  # offsets into the config text
    end: int


class ConfigText:
    """One config.pbtxt's text and where it comes from, for messages naming the file, line and column."""

    def __init__(self, text: str, where: str) -> None:
        self.text = text
        self.where = where
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def error_at(self, offset: int, what: str) -> InvalidModel:
        line = bisect.bisect_right(self._line_starts, offset)
        return self.error(line, offset - self._line_starts[line - 1] + 1, what)

    def error(self, line: int | None, column: int | None, what: str) -> InvalidModel:
        at = f"line {line}, column {column}: " if line and column else ""
        return InvalidModel(f"{self.where}: {at}{what} — {_HINT}")

    def line(self, number: int) -> str:
        """The text of line ``number`` (1-based), "" past the end."""
        if not 0 < number <= len(self._line_starts):
            return ""
        start = self._line_starts[number - 1]
        end = self.text.find("\n", start)
        return self.text[start : end if end >= 0 else len(self.text)]


def tokenize(config: ConfigText) -> list[Token]:
    """The tokens of ``config``; refuses what Triton's C++ tokenizer refuses (Python's reads some of it)."""
    text, tokens, pos = config.text, [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise config.error_at(pos, _unreadable(text[pos]))
        kind = m.lastgroup or ""
        if kind == "string":
            _check_escapes(config, m.start(), m.group())
        if kind == "number" and m.end() < len(text) and (text[m.end()].isalnum() or text[m.end()] == "_"):
            raise config.error_at(m.end(), f"a number runs into {text[m.end()]!r}; separate them with a space")
        if kind not in ("space", "comment"):
            tokens.append(Token(kind, m.group(), m.start(), m.end()))
        pos = m.end()
    return tokens


def _unreadable(char: str) -> str:
    if char in "\"'":
        return "a string is not closed on its line"
    if char == "+":
        return "a '+' sign: Triton reads numbers without one"
    if not char.isascii():
        return f"the non-ASCII character U+{ord(char):04X} outside a string: Triton reads only ASCII there"
    return f"unexpected character {char!r}"


def _check_escapes(config: ConfigText, start: int, literal: str) -> None:
    body, pos = literal[1:-1], 0
    while (pos := body.find("\\", pos)) >= 0:
        m = _ESCAPE.match(body, pos)
        if m is None:
            raise config.error_at(start + 1 + pos, f"invalid escape {body[pos : pos + 2]!r} in a string")
        pos = m.end()


def check_schema(config: ConfigText, *, lenient: bool = False) -> None:
    """Parse ``config`` into Triton's ModelConfig as Triton does; refuse it with protobuf's reason, made
    specific where it can be (the field or enum value meant, the values there are). ``lenient``: a field the
    schema does not know is let through (logged), the rest checked as strictly."""
    from google.protobuf import text_format  # the loader's only protobuf uses: imported when needed

    from tritonshare.loader import model_config_pb2

    try:
        text_format.Parse(config.text, model_config_pb2.ModelConfig())
        return
    except text_format.ParseError as exc:
        line, (reason, explained) = exc.GetLine(), _reasons(config, exc, model_config_pb2.POOL)
        if not (lenient and _UNKNOWN_FIELD.fullmatch(reason)):
            raise config.error(line, exc.GetColumn(), explained) from exc
    try:
        text_format.Parse(config.text, model_config_pb2.ModelConfig(), allow_unknown_field=True)
    except text_format.ParseError as exc:
        raise config.error(exc.GetLine(), exc.GetColumn(), _reasons(config, exc, model_config_pb2.POOL)[1]) from exc
    logger.warning(
        "%s, line %s: %s — passed to Triton unchecked (--config-check lenient), as is any later unknown field",
        config.where,
        line,
        explained,
    )


def _reasons(config: ConfigText, exc: Any, pool: Any) -> tuple[str, str]:
    """protobuf's reason for refusing ``config`` (``exc``, a ParseError), and that reason explained."""
    reason = _protobuf_reason(str(exc), config.line(exc.GetLine() or 0))
    return reason, _explain(reason, pool)


def _protobuf_reason(message: str, line_text: str) -> str:
    """protobuf's message without the position and the quoted line it puts in front of some."""
    message = re.sub(r"^\d+(?::\d+)? : ", "", message)
    for quoted in (f"'{line_text}': ", "'': "):
        message = message.removeprefix(quoted)
    return message.removesuffix(".")


def _unknown_field(m: re.Match[str], pool: Any) -> str:
    message, field = pool.FindMessageTypeByName(m["type"]), m["field"]
    names = [f.name for f in message.fields]
    close = difflib.get_close_matches(field, names, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"its fields: {', '.join(names)}"
    return f"{_short(message.full_name)} has no field {field!r} ({hint})"


def _unknown_enum_value(m: re.Match[str], pool: Any) -> str:
    enum, value = pool.FindEnumTypeByName(m["type"]), m["value"]
    names = [v.name for v in enum.values]
    close = difflib.get_close_matches(value, names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"{value!r} is not a {_short(enum.full_name)} ({hint}values: {', '.join(names)})"


def _set_twice(m: re.Match[str], pool: Any) -> str:
    return f"{m['field']!r} is set a second time, and it holds one value; keep one"


def _short(full_name: str) -> str:
    return full_name.removeprefix("inference.")


# protobuf's messages (the same from 4.25 to 6.x) for the mistakes people make; others pass as they are.
_EXPLAINERS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str], Any], str]], ...] = (
    (re.compile(r'Message type "(?P<type>[\w.]+)" has no field named "(?P<field>[^"]*)"'), _unknown_field),
    (re.compile(r'Enum type "(?P<type>[\w.]+)" has no value named (?P<value>\S+)'), _unknown_enum_value),
    (re.compile(r'Message type "[\w.]+" should not have multiple "(?P<field>\w+)" fields'), _set_twice),
)


_UNKNOWN_FIELD = _EXPLAINERS[0][0]


def _explain(reason: str, pool: Any) -> str:
    for pattern, explain in _EXPLAINERS:
        if (m := pattern.fullmatch(reason)) is not None:
            try:
                return explain(m, pool)
            except KeyError:  # a type the pool does not know: protobuf's own words will do
                return reason
    return reason


def check_config(text: str, where: str, *, lenient: bool = False) -> list[Token]:
    """Check ``text`` is a ModelConfig Triton reads (``where`` names it in errors); returns its tokens."""
    config = ConfigText(text, where)
    tokens = tokenize(config)
    check_schema(config, lenient=lenient)
    return tokens


def _name_values(tokens: list[Token]) -> list[tuple[int, int]]:
    """Where the values of the top-level ``name`` fields are, in a config :func:`check_config` accepted
    (there, an identifier followed by ':' is a field name, and name's value is one or more strings)."""
    spans, depth = [], 0
    for i, token in enumerate(tokens):
        if token.kind == "symbol":
            depth += (token.text in _OPENING) - (token.text in _CLOSING)
        elif depth == 0 and token.kind == "ident" and token.text == "name" and _is_colon(tokens, i + 1):
            last = i + 2
            while last + 1 < len(tokens) and tokens[last + 1].kind == "string":
                last += 1
            spans.append((tokens[i + 2].start, tokens[last].end))
    return spans


def _is_colon(tokens: list[Token], i: int) -> bool:
    return i < len(tokens) and tokens[i].text == ":"


def with_name(text: str, name: str, where: str, *, lenient: bool = False) -> str:
    """``text`` checked, with its top-level ``name`` set to ``name``: the value replaced in place, or a
    first line added when there is none. Everything else stays byte for byte."""
    spans = _name_values(check_config(text, where, lenient=lenient))
    quoted = '"' + name + '"'  # model names are [A-Za-z0-9_.-]: nothing to escape (layout.check_model_name)
    if not spans:
        return f"name: {quoted}\n{text}"
    # Triton, like protobuf, refuses a name set twice unless the first values are empty: the last one counts.
    start, end = spans[-1]
    return text[:start] + quoted + text[end:]


def is_model_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() or bool(version_dirs(path))


def version_dirs(path: Path) -> list[Path]:
    """The folders of ``path`` Triton serves as versions."""
    return sorted(p for p in path.iterdir() if _is_version(p.name) and p.is_dir())


def _is_version(name: str) -> bool:
    return bool(_VERSION.fullmatch(name)) and int(name) <= INT64_MAX


def _triton_number(name: str) -> int | None:
    """The number Triton 2.51 reads from a model's folder of this name; None for one it skips for its leading
    zero (before reading it) or in which std::stoll finds no number."""
    if len(name) > 1 and name.startswith("0"):
        return None
    m = _STOLL.match(name)
    return int(m["number"]) if m is not None else None


def _aborts_triton(name: str) -> bool:
    """Triton 2.51 aborts at its next poll on a folder of this name in a model (std::stoll's out_of_range)."""
    number = _triton_number(name)
    return number is not None and not INT64_MIN <= number <= INT64_MAX


def check_version_names(root: Path, label: str) -> None:
    """Refuse a folder Triton would read as a number beyond int64 (it would abort, and with it every model of
    the node, at each restart too while the folder stays); say which folders Triton ignores when no version
    is left."""
    folders = [p.name for p in root.iterdir() if p.is_dir()]
    for name in sorted(folders):
        if _aborts_triton(name):
            raise InvalidModel(
                f"{label}: folder {name!r} reads to Triton as a version number beyond int64, and Triton aborts on "
                "it (std::out_of_range), taking down every model on the node — rename or remove that folder"
            )
    if not version_dirs(root):
        zeros = [f"{name}/" for name in sorted(folders) if name.isdigit() and _triton_number(name) is None]
        ignored = f" (Triton ignores {', '.join(zeros)}: a version folder's name has no leading zero)" if zeros else ""
        raise InvalidModel(
            f"{label}: the model has no numeric version folder (1/, 2/, …){ignored} — Triton serves only versions; "
            "object stores keep no empty folders, so put a file such as 1/.keep in an otherwise empty one"
        )


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


def prepare(top: Path, name: str, label: str, *, lenient: bool = False) -> Path:
    """Open the modes of the files in ``top``, find and check the model there, set its config's name to
    ``name``; returns the model root. ``lenient``: see :func:`check_schema`. A full disk while editing is
    InsufficientSpace (exit 15), as it is mid-download."""
    with _editing(label, "setting file modes"):
        open_modes(top)
    root = find_root(top, label)
    check_links(root, label)  # an archive's links, in the folder that is published: none may lead out of it
    if os.path.lexists(root / RECORD_FILE) and not (root / RECORD_FILE).is_file():
        raise InvalidModel(
            f"{label}: {RECORD_FILE} is a folder or a link in the model, and the loader keeps its install record "
            "under that name — rename it"
        )
    check_version_names(root, label)
    config = root / CONFIG_FILE
    if config.is_file():
        where = f"{label}: {config.relative_to(top).as_posix()}"
        text = _read_text(config, where)
        named = with_name(text, name, where, lenient=lenient)
        parsed = _parse(named)
        check_version_policy(root, parsed, where)
        check_triton_rules(parsed, where)
        check_load_data(parsed, where)
        check_data_files(root, parsed, where)
        check_backend_libraries(root, parsed.runtime, label)
        with _editing(label, f"writing {config}"):
            _replace_text(config, named)
    else:
        check_backend_libraries(root, "", label)
    with _editing(label, f"blocking bytecode in {root}"):
        block_bytecode(root)
    return root


def check_version_policy(root: Path, config: Any, where: str) -> None:
    """Refuse a config (``config``, as :func:`_parse` reads it) whose ``version_policy`` leaves Triton none of the
    model's version folders to load, chosen as Triton 2.51 chooses them (VersionsToLoad): Triton then fails the model at
    every poll ("at least one version must be available under the version policy") without listing it in its
    index, so a load would wait out its deadline and blame Triton's repository (seen here)."""
    policy, existing = config.version_policy, _triton_versions(root)
    kind = policy.WhichOneof("policy_choice")
    if kind == "specific":
        chosen, said = existing & set(policy.specific.versions), f"specific versions {list(policy.specific.versions)}"
    elif kind == "all":
        chosen, said = existing, "all"
    else:  # latest, Triton's default with one version
        count = policy.latest.num_versions if kind == "latest" else 1
        chosen, said = set(sorted(existing, reverse=True)[:count]), f"the latest {count}"
    if not chosen:
        raise InvalidModel(
            f"{where}: its version policy ({said}) leaves Triton no version to load among the model's version "
            f"folders ({', '.join(map(str, sorted(existing)))}) — Triton would fail it at every poll without "
            "reporting it; add the version folder, or change the policy"
        )


def _parse(text: str) -> Any:
    """``text``, a config :func:`check_config` accepted, as a ModelConfig message (generated, untyped)."""
    from google.protobuf import text_format  # imported when needed, as in check_schema

    from tritonshare.loader import model_config_pb2

    config = model_config_pb2.ModelConfig()
    text_format.Parse(text, config, allow_unknown_field=True)
    return config


def check_backend_libraries(root: Path, runtime: str, label: str) -> None:
    """Refuse a shared library in the model that Triton 2.51 would load as the model's backend: it looks for the
    backend library (the config's ``runtime``, by default ``libtriton_<backend>.so``) in the model's version folder
    and in the model folder before its backend directory, and loads it into its own process — native code of one
    tenant in the server every tenant shares (a library that aborts as it loads took Triton down, seen here). A
    ``runtime`` ending in ``.py`` is Python, run by the Python backend's own process as a model.py is."""
    # Every folder Triton reads as a version (std::stoll: `1abc` is version 1), not only the plain numbers it lists.
    versions = sorted(p for p in root.iterdir() if p.is_dir() and _triton_number(p.name) is not None)
    for folder in (root, *versions):
        found = sorted(p.name for p in folder.iterdir() if _BACKEND_LIBRARY.fullmatch(p.name))
        if runtime and not runtime.endswith(".py") and os.path.lexists(folder / runtime):
            found.append(runtime)
        if found:
            name = (folder / found[0]).relative_to(root).as_posix()
            raise InvalidModel(
                f"{label}: {name} is where Triton looks for the model's backend library, and Triton would load it "
                "into its own process, which every model of the node shares — remove it and use a backend "
                "installed with Triton"
            )


def _triton_versions(root: Path) -> set[int]:
    """The version numbers Triton 2.51 reads from the folders of ``root`` (:func:`_triton_number`)."""
    numbers = (_triton_number(path.name) for path in root.iterdir() if path.is_dir())
    return {number for number in numbers if number is not None}


def check_links(root: Path, label: str) -> None:
    """Every symbolic link under ``root``, resolved in the tree as it now stands, leads inside ``root``, and
    those at its top to something (:func:`_check_top_links`). Only
    an archive brings links (a folder source copies what a link inside points to), and its members are checked
    as they land; but a link resolves through those unpacked after it (see :mod:`tritonshare.loader.archive`),
    and the published root may be a sub-folder of what was unpacked."""
    real = os.path.realpath(root)
    pending = [root]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                if entry.is_symlink():
                    if not inside(real, os.path.realpath(entry.path)):
                        name = Path(entry.path).relative_to(root).as_posix()
                        raise UnsafeArchive(
                            f"{label}: {name!r} links to {os.readlink(entry.path)!r}, which leads outside the model "
                            "folder once every member is in place — rebuild the archive with links that stay inside "
                            "the model folder"
                        )
                elif entry.is_dir():
                    pending.append(Path(entry.path))
    _check_top_links(root, label)


def _check_top_links(root: Path, label: str) -> None:
    """A link at the model's top that leads to nothing (a member the archive lacks, or a loop): Triton, which
    stats every entry there, fails the model's poll for good ("Poll failed for model directory") and never
    lists it. Deeper, Triton does not look (a dangling ``1/__pycache__`` is replaced anyway)."""
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.is_symlink() and not os.path.exists(entry.path):
                raise UnsafeArchive(
                    f"{label}: {entry.name!r} links to {os.readlink(entry.path)!r}, which leads to nothing (a member "
                    "the archive lacks, or links round in a loop), and Triton could not load the model — rebuild the "
                    "archive without that link"
                )


def inside(root: str, resolved: str) -> bool:
    """``resolved`` is ``root`` or lies under it (both real paths, as ``os.path.realpath`` gives them)."""
    return resolved == root or resolved.startswith(root + os.sep)


def open_modes(top: Path) -> None:
    """Make every file and folder under ``top`` readable by all: files ``rw-r--r--`` (``rwxr-xr-x`` when any
    execute bit was set), folders ``rwxr-xr-x``. Exact modes: write for others, set-user-ID and the like go.

    Triton runs as another user than the loader (k8s/base: 1000 and 65532), and archives keep the modes
    they were packed with: weights written through ``tempfile`` are 0600, and Triton cannot read a config
    it does not own — POLL only logs "Poll failed". Each folder gets its mode before it is listed, so one
    packed unreadable (0000) is walked too. Links are left alone: what they lead to inside gets its own mode.
    """
    os.chmod(top, FOLDER_MODE)
    pending = [top]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in entries:
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    _set_mode(entry.path, mode, FOLDER_MODE)
                    pending.append(Path(entry.path))
                elif stat.S_ISREG(mode):
                    _set_mode(entry.path, mode, EXECUTABLE_MODE if mode & 0o111 else FILE_MODE)


def _set_mode(path: str, mode: int, wanted: int) -> None:
    if stat.S_IMODE(mode) != wanted:
        os.chmod(path, wanted)


@contextmanager
def _editing(label: str, doing: str) -> Iterator[None]:
    """The loader's edits of a staged model in the error tree: a full disk is InsufficientSpace (exit 15)
    with the advice a full disk mid-download gets, another failure a node problem (exit 1)."""
    try:
        yield
    except OSError as exc:
        raise disk_error(f"{label}: {doing}", exc) from exc


def _replace_text(path: Path, text: str) -> None:
    """Write ``path`` anew, never through it: a link named so is replaced by the file, its target untouched."""
    temp = path.with_name(f".{path.name}.tritonshare")
    try:
        temp.write_text(text, encoding="utf-8")
        os.chmod(temp, FILE_MODE)  # as open_modes left the one it replaces, whatever the umask
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


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
        if cache.is_symlink():
            cache.unlink()  # never touched through: a link would lead the bytecode, or the touch, elsewhere
        elif cache.is_dir():
            shutil.rmtree(cache)
        cache.touch()


def _read_text(path: Path, where: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidModel(f"{where}: not UTF-8 text (byte {exc.start}) — Triton reads text protobuf") from exc
