"""Classify one compile + ``run.py --verify`` of a zoo family from what the processes printed.

Pure functions of (exit status, output, timed out), so recorded outputs can be re-read
(tests/e2e/test_zoo.py). The outcomes:

- ``PASS``: verify printed PASS.
- ``REFUSED``: the compile exited 2 with an ``error:`` line and no traceback, in user-error
  wording (a clean refusal; :func:`names_source_line` says whether it points at the model).
- ``COMPILE-CRASH``: the compile raised (a traceback), or its ``error:`` says internal error.
- ``RUN-CRASH``: run.py raised or exited non-zero without a verdict.
- ``FAIL``: verify ran and printed FAIL; which categories mismatched and their max errors.
- ``TIMEOUT``: the compile or the run passed its time limit.
"""
from __future__ import annotations

import re

STATUSES = ("PASS", "REFUSED", "COMPILE-CRASH", "RUN-CRASH", "FAIL", "TIMEOUT")

# a model with no blocks: "tensor parallel: no repeated blocks found; N of M weight matrices
# in the model sharded" (planning/tp.py tp_summary)
_TP_LINE = re.compile(r"tensor parallel: (?:no repeated blocks found; )?(\d+) of (\d+) weight "
                      r"matrices in (?:blocks|the model) sharded(?:; (\d+) of (\d+) outside "
                      r"them)?[^\n]*")
_SOURCE = re.compile(r"\b[\w.-]+\.py:\d+\b")
_INTERNAL = re.compile(r"internal error|this is a bug|please report", re.I)
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?", re.M)
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(:.*)?$")  # the line ending a traceback: Type[: message]
_VERIFY = {
    "loss": re.compile(r"verify: loss (\S+) \(reference (\S+)\) max abs err (\S+)"),
    "outputs": re.compile(r"verify: outputs max abs err (\S+)"),
    "gradients": re.compile(r"verify: gradients \(gathered to full shape\) max abs err (\S+)"),
    "parameters": re.compile(r"verify: parameters after one \w+ step max abs err (\S+)"),
}
_MISMATCH = re.compile(r"(loss|outputs|gradients|parameters) \((\d+) mismatched; worst on rank \d+: "
                       r"([^)]*(?:\([^)]*\))?[^);]*)\)")


def tp_line(text: str) -> dict | None:
    """The compile's ``tensor parallel: N of M weight matrices in blocks sharded[; K of L
    outside them]`` line: N, M, and K, L (0, 0 where the line has no such part)."""
    m = _TP_LINE.search(text)
    if m is None:
        return None
    return {"sharded": int(m.group(1)), "total": int(m.group(2)),
            "outside_sharded": int(m.group(3) or 0), "outside_total": int(m.group(4) or 0),
            "line": m.group(0)}


def names_source_line(text: str) -> str:
    """The first ``file.py:line`` an error text names ('' when none)."""
    m = _SOURCE.search(text)
    return m.group(0) if m else ""


def exceptions(text: str) -> list[str]:
    """The exception lines (``Type: message``) ending each traceback in ``text``, in order,
    with torchrun's ``[rankN]:`` prefixes removed; duplicates (every rank raising the same)
    once."""
    lines = _RANK_PREFIX.sub("", text).splitlines()
    found: list[str] = []
    in_tb = False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_tb = True
            continue
        if in_tb and line and not line[0].isspace() and not line.startswith("^"):
            if _EXCEPTION.match(line.strip()) and line.strip() not in found:
                found.append(line.strip())
            in_tb = False
    return found


def innermost_frames(text: str, limit: int = 3) -> list[str]:
    """The last ``limit`` distinct ``File "...", line N, in fn`` frames of the first
    traceback, shortened to ``package/file.py:N in fn`` (where the crash happened)."""
    text = _RANK_PREFIX.sub("", text)
    start = text.find("Traceback (most recent call last)")
    if start < 0:
        return []
    block = text[start:].split("\n\n")[0]
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', block)
    out = []
    for path, line, fn in frames:
        parts = path.split("/")
        short = "/".join(parts[-2:])
        entry = f"{short}:{line} in {fn}"
        if entry not in out:
            out.append(entry)
    return out[-limit:]


def error_block(stderr: str) -> str:
    """The text from the first ``error:`` line to the end (the CLI's user-error message)."""
    i = stderr.find("error: ")
    while i > 0 and stderr[i - 1] != "\n":
        i = stderr.find("error: ", i + 1)
    return stderr[i:].strip() if i >= 0 else ""


def classify_compile(rc: int | None, stdout: str, stderr: str, timed_out: bool = False) -> dict:
    """What a compile did: ``status`` None when it succeeded (run it), else an outcome, with
    ``error`` (one line), ``text`` (the whole error), ``source_line`` and ``tp``."""
    text = stdout + "\n" + stderr
    res = {"status": None, "rc": rc, "tp": tp_line(text), "error": "", "text": "",
           "source_line": "", "frames": []}
    if timed_out:
        res.update(status="TIMEOUT", error="compile timed out", text=text[-4000:])
        return res
    if rc == 0:
        return res
    excs = exceptions(stderr)
    block = error_block(stderr)
    if rc in (2, 3) and block and not excs:  # 3: the compile's own checks found a bug
        internal = rc == 3 or bool(_INTERNAL.search(block))
        res.update(status="COMPILE-CRASH" if internal else "REFUSED",
                   error=block.splitlines()[0][len("error: "):], text=block,
                   source_line=names_source_line(block))
        return res
    res.update(status="COMPILE-CRASH", error=excs[-1] if excs else (block or f"exit {rc}"),
               text=stderr[-8000:], frames=innermost_frames(stderr),
               source_line=names_source_line(excs[-1] if excs else block))
    return res


def verify_figures(text: str) -> dict:
    """The max abs errors verify printed, by category (absent ones left out)."""
    figures = {}
    for cat, rx in _VERIFY.items():
        m = rx.search(text)
        if m:
            figures[cat] = float(m.group(m.lastindex))
    return figures


def classify_run(rc: int | None, output: str, timed_out: bool = False) -> dict:
    """What ``torchrun ... run.py --verify`` did: ``status``, ``error``, the verify figures,
    for FAIL the mismatched ``categories`` ({category: (count, worst tensor)})."""
    res = {"status": None, "rc": rc, "error": "", "text": "", "figures": verify_figures(output),
           "categories": {}, "frames": []}
    verdict = re.findall(r"^(?:\[rank\d+\]:\s?)?(PASS|FAIL)\s*$", output, re.M)
    if timed_out:
        res.update(status="TIMEOUT", error="run timed out", text=output[-4000:])
    elif verdict and verdict[-1] == "PASS" and rc == 0:
        res["status"] = "PASS"
    elif verdict and verdict[-1] == "FAIL":
        m = re.search(r"verify: mismatches in ([^\n]*)", output)
        cats = {c: (int(n), worst.strip()) for c, n, worst in _MISMATCH.findall(m.group(1))} if m else {}
        worst = ", ".join(f"{c} (max abs err {res['figures'].get(c, float('nan')):.3g}; worst "
                          f"{w or '-'})" for c, (n, w) in cats.items())
        res.update(status="FAIL", categories=cats, error=f"verify FAILed: {worst or 'see text'}",
                   text=output[-6000:])
    else:
        excs = exceptions(output)
        res.update(status="RUN-CRASH", error=excs[0] if excs else f"exit {rc} without a verdict",
                   text=output[-12000:], frames=innermost_frames(output))
    return res
