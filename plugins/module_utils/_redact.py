# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Redaction of secrets in command lines (private helper, may change any time)."""

from __future__ import annotations

import re

MASK = "********"

# Option names whose value is a secret: `--token X`, `--api-key=X`.
_SECRET_WORD = r"(?:api[-_]?key|access[-_]?key|token|auth[-_]?token|password|passwd|secret|client[-_]?secret)"
_FLAG_ALONE = re.compile(r"--?[\w-]*" + _SECRET_WORD, re.IGNORECASE)
_DEFAULT_INLINE = (
    # --token=X, --api-key=X, and `--token X` inside one argument (sh -c "...")
    re.compile(r"(--?[\w-]*" + _SECRET_WORD + r"(?:=|\s+))(\S+)", re.IGNORECASE),
    # token=X, HF_TOKEN=X, password=X, client_secret=X, api_key=X
    re.compile(r"((?:^|(?<=[\s;&,?]))[\w.-]*" + _SECRET_WORD + r"=)([^\s&;,]+)", re.IGNORECASE),
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


def _mask_match(match):
    if match.re.groups >= 2:
        return match.group(1) + MASK
    if match.re.groups == 1:
        start, end = match.span(1)
        whole_start = match.start(0)
        text = match.group(0)
        return text[:start - whole_start] + MASK + text[end - whole_start:]
    return MASK


def redact_argv(argv, extra=()):
    """Return the command line as one string with secrets replaced by MASK.

    Default patterns cover `--api-key X`, `--token X`, `token=`, `*_TOKEN=`,
    `password=` and `secret=`. Each extra (compiled) pattern is applied to the
    joined line: with one group only the group is masked, else the whole match.
    """
    args = list(argv)
    for i, arg in enumerate(args):
        if _FLAG_ALONE.fullmatch(arg) and i + 1 < len(args):
            args[i + 1] = MASK
    masked = []
    for arg in args:
        if arg != MASK:
            for pattern in _DEFAULT_INLINE:
                arg = pattern.sub(_mask_match, arg)
        masked.append(arg)
    line = " ".join(masked)
    for pattern in extra:
        line = pattern.sub(_mask_match, line)
    return line
