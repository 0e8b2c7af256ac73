"""Read images/Dockerfile and run its build stage without Docker (no engine on these machines, REFERENCE §5).

Only what a Python image build needs is modelled: ARG, ENV, WORKDIR, COPY from the build context (filtered
by .dockerignore with Docker's matching rules) and shell-form RUN. Absolute paths in the image are mapped
into a scratch folder; RUN lines must therefore name absolute paths only through build arguments ("$VENV"),
which the Dockerfile promises in its header.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form ENTRYPOINT/CMD/RUN, or None for shell form."""
        try:
            parsed = json.loads(self.value)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, list) and all(isinstance(a, str) for a in parsed) else None


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    global_args: list[Instruction]
    stages: list[Stage]

    @classmethod
    def parse(cls, text: str) -> Dockerfile:
        global_args: list[Instruction] = []
        stages: list[Stage] = []
        for instruction in _instructions(text):
            if instruction.keyword == "FROM":
                parts = instruction.value.split()
                name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
                stages.append(Stage(base=parts[0], name=name))
            elif stages:
                stages[-1].instructions.append(instruction)
            else:
                assert instruction.keyword == "ARG", f"line {instruction.line}: {instruction.keyword} before FROM"
                global_args.append(instruction)
        return cls(global_args=global_args, stages=stages)

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise AssertionError(f"the Dockerfile has no stage {name!r}")

    def defaults(self) -> dict[str, str]:
        return dict(_arg(i.value) for i in self.global_args)  # type: ignore[misc]


def _instructions(text: str) -> Iterator[Instruction]:
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments and blank lines, also inside a continuation
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, value = (pending + line).partition(" ")
        pending = ""
        yield Instruction(keyword.upper(), value.strip(), start)


def _arg(value: str) -> tuple[str, str | None]:
    name, eq, default = value.partition("=")
    return name.strip(), default if eq else None


def expand(text: str, variables: dict[str, str]) -> str:
    """Docker's ${VAR} / $VAR substitution (used by ENV, WORKDIR, COPY)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m[1] or m[2], ""), text)


# --- .dockerignore ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IgnoreRule:
    pattern: re.Pattern[str]
    prefix: str  # literal start of the pattern, to know which folders may hold re-included files
    negated: bool


def ignore_rules(text: str) -> list[IgnoreRule]:
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        prefix = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
        rules.append(IgnoreRule(re.compile(_glob_regex(pattern)), prefix, negated))
    return rules


def _glob_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


def ignored(path: str, rules: list[IgnoreRule]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for rule in rules:
        if any(rule.pattern.fullmatch(c) for c in candidates):
            verdict = not rule.negated
    return verdict


def context_files(root: Path, dockerignore: str) -> list[str]:
    """The files Docker sends as the build context, relative to ``root``."""
    rules = ignore_rules(dockerignore)
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        rel_folder = os.path.relpath(folder, root)
        rel = "" if rel_folder == "." else rel_folder + "/"
        # Do not descend into an ignored folder that no `!` pattern reaches into (.git, .venv, ...).
        dirs[:] = [
            d
            for d in dirs
            if not ignored(rel + d, rules)
            or any(r.negated and (r.prefix.startswith(rel + d + "/") or not r.prefix) for r in rules)
        ]
        found += [rel + f for f in files if not ignored(rel + f, rules)]
    return sorted(found)


# --- running the build stage ---------------------------------------------------------------------------


@dataclass
class StageRun:
    """A build stage's instructions executed in ``root`` (the image's /), with ``variables`` as build args."""

    context: Path
    context_files: list[str]
    root: Path
    variables: dict[str, str]
    env: dict[str, str]
    workdir: str = "/"

    def image_path(self, path: str) -> Path:
        absolute = path if path.startswith("/") else os.path.join(self.workdir, path)
        return self.root / absolute.lstrip("/")

    def apply(self, instruction: Instruction, build_args: dict[str, str], log: list[str]) -> None:
        value = instruction.value
        if instruction.keyword == "ARG":
            name, default = _arg(value)
            self.variables[name] = build_args.get(name, self.variables.get(name, default or ""))
        elif instruction.keyword == "ENV":
            for assignment in shlex.split(expand(value, self.variables | self.env)):
                key, _, val = assignment.partition("=")
                self.env[key] = val
        elif instruction.keyword == "WORKDIR":
            self.workdir = os.path.join(self.workdir, expand(value, self.variables))
            self.image_path(".").mkdir(parents=True, exist_ok=True)
        elif instruction.keyword == "COPY":
            self._copy(shlex.split(expand(value, self.variables | self.env)))
        elif instruction.keyword == "RUN":
            self._run(instruction, log)
        else:
            raise AssertionError(f"line {instruction.line}: the test does not model {instruction.keyword}")

    def _copy(self, args: list[str]) -> None:
        assert not any(a.startswith("--") for a in args), f"COPY flags are not modelled: {args}"
        *sources, dest = args
        for source in sources:
            prefix = source.rstrip("/").removeprefix("./")
            picked = [f for f in self.context_files if f == prefix or f.startswith(prefix + "/")]
            assert picked, f"COPY {source}: nothing in the build context (see .dockerignore)"
            for f in picked:
                inside = f[len(prefix) + 1 :] if f != prefix else os.path.basename(f)
                target = self.image_path(dest) / inside
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.context / f, target)

    def _run(self, instruction: Instruction, log: list[str]) -> None:
        command = instruction.value
        assert instruction.exec_form() is None, f"line {instruction.line}: exec-form RUN is not modelled"
        literal = re.search(r"(?:^|[\s=:'\"(>])(/[A-Za-z][^\s'\"]*)", command)
        assert literal is None, f"line {instruction.line}: absolute path {literal and literal[1]} — use a build arg"
        env = self.env | self.variables  # build args are environment variables of RUN, as in Docker
        proc = subprocess.run(
            ["sh", "-ec", command], cwd=self.image_path("."), env=env, capture_output=True, text=True, timeout=900
        )
        log.append(f"$ {command}\n{proc.stdout}{proc.stderr}")
        assert proc.returncode == 0, f"RUN at line {instruction.line} failed ({proc.returncode}):\n{log[-1][-3000:]}"


def checkpoint(stage: Stage) -> int:
    """Index of the last RUN followed by a COPY: Docker's cache keeps everything up to it while only later
    inputs (the code) change. The tests cache the same layer."""
    runs = [n for n, i in enumerate(stage.instructions) if i.keyword == "RUN"]
    copies = [n for n, i in enumerate(stage.instructions) if i.keyword == "COPY"]
    return max((r for r in runs if any(c > r for c in copies)), default=-1)


def layer_key(stage: Stage, upto: int, context: Path, files: list[str], extra: str) -> str:
    """Docker-like cache key of the instructions ``[0, upto]``: their text and every file they copy."""
    digest = hashlib.sha256(extra.encode())
    for instruction in stage.instructions[: upto + 1]:
        digest.update(f"{instruction.keyword} {instruction.value}\n".encode())
        if instruction.keyword == "COPY":
            *sources, _ = shlex.split(instruction.value)
            for source in sources:
                prefix = source.rstrip("/").removeprefix("./")
                for f in files:
                    if f == prefix or f.startswith(prefix + "/"):
                        digest.update(f.encode() + b"\0" + (context / f).read_bytes())
    return digest.hexdigest()[:16]
