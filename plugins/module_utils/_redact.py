# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Redaction of secrets in command lines (private helper, may change any time)."""

from __future__ import annotations

import re

MASK = "********"

# Option names whose value is a secret: `--token X`, `--api-key=X`, `--hf-token X`, `--pass X`.
_SECRET_WORD = r"(?:api[-_]?key|access[-_]?key|token|auth[-_]?token|password|passwd|secret|client[-_]?secret)"
_FLAG_ALONE = re.compile(r"--?[\w-]*" + _SECRET_WORD + r"|--?pass|bearer", re.IGNORECASE)
# Each default masks its `secret` group only.
_DEFAULT_INLINE = (
    # --token=X, --api-key=X, --pass=X, and `--token X` inside one argument (sh -c "...")
    re.compile(r"(?:--?[\w-]*" + _SECRET_WORD + r"|--?pass\b)(?:=|\s+)(?P<secret>\S+)", re.IGNORECASE),
    # token=X, HF_TOKEN=X, password=X, client_secret=X, api_key=X
    re.compile(r"(?:^|(?<=[\s;&,?]))[\w.-]*" + _SECRET_WORD + r"=(?P<secret>[^\s&;,]+)", re.IGNORECASE),
    # scheme://user:password@host
    re.compile(r"\b[a-z][\w+.-]*://[^:/\s@]+:(?P<secret>[^@\s/]+)@", re.IGNORECASE),
    # Authorization: Bearer X, Authorization: Basic X, Bearer X
    re.compile(r"(?:\bauthorization:\s*(?:\w+\s+)?|\bbearer\s+)(?P<secret>[^\s\"']+)", re.IGNORECASE),
)


def compile_patterns(patterns):
    """Compile user patterns; raise ValueError naming the first bad one."""
    compiled = []
    for pattern in patterns or ():
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise ValueError("redact pattern %r does not compile: %s" % (pattern, exc))
    return compiled


def _mask_group(match, group):
    start, end = match.span(group)
    if start < 0:  # an optional group that did not take part: mask the whole match
        return MASK
    whole_start = match.start(0)
    text = match.group(0)
    return text[:start - whole_start] + MASK + text[end - whole_start:]


def _mask_default(match):
    return _mask_group(match, "secret")


def _mask_match(match):
    """A user pattern: with exactly one group only the group is masked, else the whole match."""
    if match.re.groups == 1:
        return _mask_group(match, 1)
    return MASK


def redact_argv(argv, extra=()):
    """Return the command line as one string with secrets replaced by MASK.

    Default patterns cover `--api-key X`, `--token X`, `--hf-token X`, `--pass X`,
    `--passwd X`, `token=`, `*_TOKEN=`, `password=`, `secret=`,
    `scheme://user:password@host` and `Authorization: Bearer X`. Each extra
    (compiled) pattern is applied to the joined line: with one group only the
    group is masked, else the whole match.
    """
    args = list(argv)
    for i, arg in enumerate(args):
        if _FLAG_ALONE.fullmatch(arg) and i + 1 < len(args):
            args[i + 1] = MASK
    masked = []
    for arg in args:
        if arg != MASK:
            for pattern in _DEFAULT_INLINE:
                arg = pattern.sub(_mask_default, arg)
        masked.append(arg)
    line = " ".join(masked)
    for pattern in extra:
        line = pattern.sub(_mask_match, line)
    return line
