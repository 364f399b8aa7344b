import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils._redact import MASK, compile_patterns, redact_argv


@pytest.mark.parametrize("argv, expected", [
    (["python3", "serve.py", "--api-key", "sk-123", "--port", "8000"], "python3 serve.py --api-key %s --port 8000" % MASK),
    (["python3", "--token=abc", "--max-tokens", "100"], "python3 --token=%s --max-tokens 100" % MASK),
    (["env", "HF_TOKEN=hf_x", "python", "x.py"], "env HF_TOKEN=%s python x.py" % MASK),
    (["app", "password=pw", "secret=s3"], "app password=%s secret=%s" % (MASK, MASK)),
    (["sh", "-c", "python x.py --hf-token t1 --n 2"], "sh -c python x.py --hf-token %s --n 2" % MASK),
    (["curl", "https://h/x?token=abc&b=1"], "curl https://h/x?token=%s&b=1" % MASK),
    (["vllm", "--tokenizer", "llama", "--password-file", "/etc/pw"], "vllm --tokenizer llama --password-file /etc/pw"),
    (["python3", "--api-key"], "python3 --api-key"),
    (["python3", "dl.py", "--hf-token", "hf_abc"], "python3 dl.py --hf-token %s" % MASK),
    (["mysql", "--pass", "pw1", "--passwd", "pw2", "--pass=pw3"], "mysql --pass %s --passwd %s --pass=%s" % (MASK, MASK, MASK)),
    (["python3", "--db", "postgres://app:s3cret@db:5432/x"], "python3 --db postgres://app:%s@db:5432/x" % MASK),
    (["curl", "-H", "Authorization: Bearer eyJabc.def"], "curl -H Authorization: Bearer %s" % MASK),
    (["curl", "-H", "authorization: Basic dXNlcjpwdw=="], "curl -H authorization: Basic %s" % MASK),
    (["tool", "Bearer", "tok123"], "tool Bearer %s" % MASK),
    (["python3", "--bypass-cache", "yes"], "python3 --bypass-cache yes"),
])
def test_default_patterns(argv, expected):
    assert redact_argv(argv) == expected


def test_secret_never_survives_in_any_default_form():
    for argv in (["x", "--api-key", "SEKRIT"], ["x", "--secret=SEKRIT"], ["x", "MY_TOKEN=SEKRIT"],
                 ["x", "db_password=SEKRIT"], ["x", "--password", "SEKRIT"]):
        assert "SEKRIT" not in redact_argv(argv)


def test_user_pattern_with_group_masks_only_the_group():
    line = redact_argv(["x", "--db", "postgres://u:pw@h/db"], compile_patterns([r"://[^:]+:([^@]+)@"]))
    assert line == "x --db postgres://u:%s@h/db" % MASK


def test_user_pattern_without_group_masks_the_match():
    assert redact_argv(["x", "AKIA1234ABCD"], compile_patterns([r"AKIA[0-9A-Z]+"])) == "x " + MASK


def test_user_pattern_with_an_optional_group_never_crashes():
    patterns = compile_patterns([r"key(=(\w+))?", r"pw(:(\S+))?"])
    assert redact_argv(["x", "key", "key=abc"], patterns) == "x %s %s" % (MASK, MASK)
    one_optional = compile_patterns([r"sk-(\d+)?[a-z]+"])
    assert redact_argv(["x", "sk-abc", "sk-12abc"], one_optional) == "x %s sk-%sabc" % (MASK, MASK)


def test_bad_user_pattern_names_it():
    with pytest.raises(ValueError, match=r"redact pattern '\(unclosed' does not compile"):
        compile_patterns(["(unclosed"])
