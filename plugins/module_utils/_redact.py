# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Redaction of secrets in command lines (private helper, may change any time).

What is masked, and what is deliberately not (issue 41):

- the value of an option whose name says secret: `--token X`, `--hf-token=X`, `--token:X`, `-password X`,
  `--api-key`, `--private-key`, `--jwt`, `--client-secret`; `pass` as a word of the name (`--pass`, `--db-pass`,
  `--passphrase`, `--db_passwd`), never inside one (`--bypass`, `--passes`); any `--WORD-key` (`--openai-key`,
  `--wandb-key`) except the names of data fields and the like (`--input-key`, `--sort-key`, `--public-key`:
  NON_SECRET_KEYS), but not `--key` alone (curl's and openssl's key file, sort's field). A name that goes on
  (`--password-file`, `--key-file`, `--max-tokens`) is not one;
- the same names as `NAME=X` (`HF_TOKEN=X`, `MYSQL_PWD=X`, `DB_PASS=X`, `?token=X`), as JSON or Python keys
  (`"api_key": "X"`) and as HTTP headers (`X-Api-Key: X`, `X-Auth-Token: X`, `Cookie: X`, `Authorization: X`);
- a glued `-pX` (mysql's password) of every program, unless X is a port (`-p8080`, `-p8080:80/tcp`) or the
  program is not mysql-like and the argument is a known single-dash option (`-pix_fmt`, `-preset`, `-pthread`);
  after a mysql-like program or sshpass, a glued `-pX` is masked even when X is digits;
- a separate `-p X` only after sshpass (`-a X` after redis-cli): elsewhere it is a port far more often, and mysql's
  `-p X` prompts for the password and X is the database;
- `user:X` after curl's `-u`/`--user`/`--proxy-user` (docker's `-u 1000:1000` is a uid:gid), and the password of
  `scheme://user:X@host`.
"""

from __future__ import annotations

import os
import re

MASK = "********"

_SECRET_WORD = (r"(?:api[-_]?key|access[-_]?key|private[-_]?key|token|auth[-_]?token|password|passwd|passphrase|secret"
                r"|client[-_]?secret|jwt)")
_SECRET_NAME = re.compile(r"[\w.-]*" + _SECRET_WORD, re.IGNORECASE)
_PASS_WORDS = frozenset(("pass", "passwd", "password", "passphrase"))
NON_SECRET_KEYS = frozenset((
    "input", "output", "label", "labels", "text", "prompt", "response", "chosen", "rejected", "reward", "query",
    "context", "answer", "question", "instruction", "message", "messages", "conversation", "image", "audio", "video",
    "target", "source", "feature", "sample", "column", "field", "data", "dataset", "dict", "id", "index", "sort",
    "cache", "primary", "foreign", "partition", "shard", "routing", "group", "metric", "map", "lookup", "hash",
    "public", "hot", "shortcut"))
_MYSQL_LIKE = frozenset((
    "mysql", "mysqldump", "mysqladmin", "mysqlimport", "mysqlcheck", "mysqlshow", "mysqlpump", "mysqlbinlog", "mysqlsh",
    "mariadb", "mariadb-dump", "mariadb-admin", "mariadb-import", "mariadb-check", "mariadb-show", "sshpass"))
_SPACED_PASSWORD_FLAG = {"sshpass": "-p", "redis-cli": "-a"}
_USER_FLAGS = frozenset(("-u", "--user", "-U", "--proxy-user"))
_SINGLE_DASH_P = frozenset(("-pix_fmt", "-preset", "-profile", "-pthread", "-pipe", "-print", "-print0", "-printf",
                            "-prune", "-perm", "-path", "-pedantic", "-pg", "-pie", "-pid"))
_PORT = re.compile(r"[\d.:,/-]+(?:tcp|udp|sctp)?", re.IGNORECASE)
_OPTION = re.compile(r"--?[A-Za-z][\w.-]*")
_GLUED_P = re.compile(r"(?<![\w-])-p(?P<secret>[^\s\"']+)")


def secret_name(name):
    """Whether an option, variable, key or header name says that its value is a secret."""
    name = name.lstrip("-").lower()
    words = [word for word in re.split(r"[-_.]", name) if word]
    if not words:
        return False
    if _SECRET_NAME.fullmatch(name) or words[-1] in _PASS_WORDS:
        return True
    if words[-1] == "pwd":
        return len(words) > 1     # MYSQL_PWD, never the working directory's PWD
    return len(words) > 1 and words[-1] == "key" and words[-2] not in NON_SECRET_KEYS


def _mask_group(match, group):
    start, end = match.span(group)
    if start < 0:  # an optional group that did not take part: mask the whole match
        return MASK
    whole_start = match.start(0)
    text = match.group(0)
    return text[:start - whole_start] + MASK + text[end - whole_start:]


def _masked_if_named(match):
    """Mask the secret group when the name group says secret; else leave the match as it is."""
    return _mask_group(match, "secret") if secret_name(match.group("name")) else match.group(0)


def _mask_default(match):
    return _mask_group(match, "secret")


def _mask_quoted(match):
    return _mask_group(match, "dq" if match.group("dq") is not None else "sq") if secret_name(match.group("name")) \
        else match.group(0)


# Each masks its `secret` group (the named ones only when their `name` says secret).
_NAMED_INLINE = (
    # --token=X, --token:X, --token X inside one argument (sh -c "..."), -password X
    re.compile(r"(?<![\w-])(?P<name>--?[A-Za-z][\w.-]*)(?:=|:|\s+(?=[^\s-]))(?P<secret>[^\s\"']+)"),
    # token=X, HF_TOKEN=X, MYSQL_PWD=X, ?api_key=X
    re.compile(r"(?:^|(?<=[\s;&,?]))(?P<name>[\w.-]+)=(?P<secret>[^\s&;,]+)"),
    # X-Api-Key: X, X-Auth-Token:X (an HTTP header)
    re.compile(r"(?<![\w-])(?P<name>[A-Za-z][\w-]*):[ \t]*(?P<secret>[^\s\"']+)"),
)
_DEFAULT_INLINE = (
    # scheme://user:password@host
    re.compile(r"\b[a-z][\w+.-]*://[^:/\s@]+:(?P<secret>[^@\s/]+)@", re.IGNORECASE),
    # Authorization: Bearer X, Authorization: Basic X, Bearer X
    re.compile(r"(?:\bauthorization:\s*(?:\w+\s+)?|\bbearer\s+)(?P<secret>[^\s\"']+)", re.IGNORECASE),
    # Cookie: a=X; b=Y (the whole value)
    re.compile(r"\bcookie:\s*(?P<secret>[^\"']+)", re.IGNORECASE),
)
# "api_key": "X", 'password': 'X'
_QUOTED_KEY = re.compile(r"[\"'](?P<name>[\w.-]+)[\"']\s*:\s*(?:\"(?P<dq>[^\"]*)\"|'(?P<sq>[^']*)')")
# curl -u user:X, -uuser:X, --user=user:X
_CURL_USER = re.compile(r"(?<![\w-])(?:-u|-U|--user|--proxy-user)(?:=|\s+)?[^\s:\"']+:(?P<secret>[^\s\"']+)")


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
    """A user pattern: with exactly one group only the group is masked, else the whole match."""
    if match.re.groups == 1:
        return _mask_group(match, 1)
    return MASK


def _programs(args):
    """The base names of every word of the command line (sh -c "mysql ..." counts)."""
    return {os.path.basename(word) for arg in args for word in arg.split()}


def _mask_glued_p(arg, programs):
    """-pX: masked unless X is a port, or the argument a known single-dash option of a program not mysql-like."""
    mysql_like = bool(programs & _MYSQL_LIKE)

    def mask(match):
        value = match.group("secret")
        if not mysql_like and (_PORT.fullmatch(value) or match.group(0) in _SINGLE_DASH_P):
            return match.group(0)
        return "-p" + MASK
    return _GLUED_P.sub(mask, arg)


def _mask_next_values(args, programs):
    """The argument after a secret flag (--token X), sshpass's -p, redis-cli's -a, curl's -u user:X."""
    spaced = {_SPACED_PASSWORD_FLAG[p] for p in programs if p in _SPACED_PASSWORD_FLAG}
    for i, arg in enumerate(args[:-1]):
        if args[i] == MASK:
            continue
        if arg in spaced or arg.lower() == "bearer" or (_OPTION.fullmatch(arg) and secret_name(arg)):
            args[i + 1] = MASK
        elif "curl" in programs and arg in _USER_FLAGS and ":" in args[i + 1]:
            args[i + 1] = args[i + 1].split(":", 1)[0] + ":" + MASK


def _mask_inline(arg, programs):
    for pattern in _NAMED_INLINE:
        arg = pattern.sub(_masked_if_named, arg)
    arg = _QUOTED_KEY.sub(_mask_quoted, arg)
    for pattern in _DEFAULT_INLINE:
        arg = pattern.sub(_mask_default, arg)
    if "curl" in programs:
        arg = _CURL_USER.sub(_mask_default, arg)
    return _mask_glued_p(arg, programs)


def redact_argv(argv, extra=()):
    """Return the command line as one string with secrets replaced by MASK.

    The default rules are in this module's docstring (and the modules' C(redact) option). Each extra
    (compiled) pattern is applied to the joined line: with one group only the group is masked, else the
    whole match.
    """
    args = list(argv)
    programs = _programs(args)
    _mask_next_values(args, programs)
    masked = [arg if arg == MASK else _mask_inline(arg, programs) for arg in args]
    line = " ".join(masked)
    for pattern in extra:
        line = pattern.sub(_mask_match, line)
    return line
