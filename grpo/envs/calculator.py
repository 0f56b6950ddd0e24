"""The calculator tool: an arithmetic expression, checked here and evaluated in a child interpreter
with a time and memory limit.

Only numbers, parentheses and + - * / // % ** pass the check (no names, calls or attributes), so the
expression can reach neither the network nor the file system; the child (isolated mode, no site
packages, no file writes, an address-space limit, killed when a result takes longer than the time
limit) bounds what arithmetic alone can still do, such as 9 ** 9 ** 9. Children are kept and reused:
starting an interpreter per call cost ~0.1 s, which made a step of 512 tool episodes wait ten
seconds on the tool. Every failure is a short "error: ..." result the model reads, never an
exception: a tool that fails is part of the episode, not of the run.
"""

from __future__ import annotations

import ast
import json
import os
import select
import subprocess
import sys
import threading
import time
import warnings

_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
            ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)
# The child: limits first, then one JSON-encoded expression per line in, one JSON reply per line out.
_CHILD = (
    "import ast, json, resource, sys\n"
    "limit = int(sys.argv[1]) * 2**20\n"
    "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))\n"
    "for line in sys.stdin:\n"
    "    try:\n"
    "        tree = ast.parse(json.loads(line), mode='eval')\n"
    "        reply = {'value': str(eval(compile(tree, '<calculator>', 'eval'), {'__builtins__': {}}, {}))}\n"
    "    except Exception as e:\n"
    "        reply = {'error': f'{type(e).__name__}: {e}'}\n"
    "    sys.stdout.write(json.dumps(reply) + '\\n')\n"
    "    sys.stdout.flush()\n"
)
# A model's malformed number ("12ab") would print a SyntaxWarning from the parse below on every call.
warnings.filterwarnings("ignore", category=SyntaxWarning, module="<calculator>")


def check_expression(expression: str) -> str | None:
    """None when `expression` is plain arithmetic, else what is wrong with it."""
    try:
        tree = ast.parse(expression.strip(), filename="<calculator>", mode="eval")
    except SyntaxError:
        return "not an arithmetic expression"
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            return f"{type(node).__name__} is not allowed: only numbers, ( ) and + - * / // % **"
        if isinstance(node, ast.Constant) and (isinstance(node.value, bool) or not isinstance(node.value, int | float)):
            return f"{node.value!r} is not a number"
    return None


class _Child:
    """One child interpreter; evaluate() returns its reply, or None when it took too long or died
    (the child is then killed and must not be reused)."""

    def __init__(self, memory_mb: int):
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _CHILD, str(memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )

    def evaluate(self, expression: str, timeout_s: float) -> dict | None:
        try:
            self.process.stdin.write((json.dumps(expression) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            return None
        reply, deadline, fd = b"", time.monotonic() + timeout_s, self.process.stdout.fileno()
        while not reply.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            reply += chunk
        return json.loads(reply)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


_idle: dict[int, list[_Child]] = {}
_idle_lock = threading.Lock()


def _evaluate(expression: str, timeout_s: float, memory_mb: int) -> dict | None:
    """Run `expression` in an idle child (or a new one); a child that fails is replaced, not reused."""
    with _idle_lock:
        pool = _idle.setdefault(memory_mb, [])
        child = pool.pop() if pool else None
    child = child or _Child(memory_mb)
    reply = child.evaluate(expression, timeout_s)
    if reply is None:
        child.kill()
        return None
    with _idle_lock:
        _idle[memory_mb].append(child)
    return reply


def calculate(expression: str, timeout_s: float = 2.0, memory_mb: int = 256, max_chars: int = 200) -> str:
    """The value of `expression` as text, or "error: ..."; at most max_chars characters."""
    problem = check_expression(expression)
    if problem is not None:
        return f"error: {problem}"
    reply = _evaluate(expression.strip(), timeout_s, memory_mb)
    if reply is None:
        return f"error: no result within {timeout_s:g} s"
    if "error" in reply:
        return _cut(f"error: {reply['error']}", max_chars)
    return _cut(reply["value"], max_chars)


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else f"{text[:max_chars]}... ({len(text) - max_chars} characters cut)"
