"""The calculator tool: an arithmetic expression, checked here and evaluated in a subprocess with a
time and memory limit.

Only numbers, parentheses and + - * / // % ** pass the check (no names, calls or attributes), so the
expression can reach neither the network nor the file system; the subprocess (isolated mode, no
site packages, no file writes, a CPU-time and an address-space limit) bounds what arithmetic alone
can still do, such as 9 ** 9 ** 9. Every failure is a short "error: ..." result the model reads,
never an exception: a tool that fails is part of the episode, not of the run.
"""

from __future__ import annotations

import ast
import resource
import signal
import subprocess
import sys

_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
            ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)
_CHILD = (
    "import ast, sys\n"
    "print(eval(compile(ast.parse(sys.argv[1], mode='eval'), '<calculator>', 'eval'), {'__builtins__': {}}, {}))\n"
)


def check_expression(expression: str) -> str | None:
    """None when `expression` is plain arithmetic, else what is wrong with it."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return "not an arithmetic expression"
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            return f"{type(node).__name__} is not allowed: only numbers, ( ) and + - * / // % **"
        if isinstance(node, ast.Constant) and (isinstance(node.value, bool) or not isinstance(node.value, int | float)):
            return f"{node.value!r} is not a number"
    return None


def _limits(cpu_s: int, memory_mb: int) -> None:
    """In the child, before it runs: CPU time, address space, no file writes."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20, memory_mb * 2**20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))


def calculate(expression: str, timeout_s: float = 2.0, memory_mb: int = 256, max_chars: int = 200) -> str:
    """The value of `expression` as text, or "error: ..."; at most max_chars characters."""
    problem = check_expression(expression)
    if problem is not None:
        return f"error: {problem}"
    cpu_s = max(1, int(timeout_s))
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _CHILD, expression.strip()], capture_output=True, text=True,
            timeout=timeout_s, preexec_fn=lambda: _limits(cpu_s, memory_mb), stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"error: no result within {timeout_s:g} s"
    if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # the CPU-time limit
        return f"error: no result within {timeout_s:g} s"
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        return _cut(f"error: {last}", max_chars)
    return _cut(done.stdout.strip(), max_chars)


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else f"{text[:max_chars]}... ({len(text) - max_chars} characters cut)"
