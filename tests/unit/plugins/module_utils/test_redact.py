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


# Issue 41, attack 7: what a hostile or careless command line shows. Each row: argv, the secret that must not survive.
SECRETS = [
    (["mysql", "-uroot", "-pS3cretPw", "db"], "S3cretPw"),
    (["mysqldump", "-p123456", "db"], "123456"),                 # digits too, after a mysql-like program
    (["sh", "-c", "mariadb -u app -pS3cretPw db"], "S3cretPw"),
    (["python3", "dump.py", "-pS3cretPw"], "S3cretPw"),          # a glued -p of any program, unless a port
    (["sshpass", "-p", "S3cretPw", "ssh", "host"], "S3cretPw"),
    (["sshpass", "-p4242", "ssh", "host"], "4242"),
    (["redis-cli", "-a", "S3cretPw", "ping"], "S3cretPw"),
    (["python3", "etl.py", "--db-pass", "S3cretPw"], "S3cretPw"),
    (["python3", "etl.py", "--db_pass=S3cretPw"], "S3cretPw"),
    (["gpg", "--passphrase", "S3cretPw"], "S3cretPw"),
    (["sh", "-c", "gpg --batch --passphrase S3cretPw -d x"], "S3cretPw"),
    (["python3", "x.py", "--private-key", "S3cretPw"], "S3cretPw"),
    (["python3", "x.py", "--openai-key=sk-S3cretPw"], "sk-S3cretPw"),
    (["python3", "x.py", "--openai-key", "sk-S3cretPw"], "sk-S3cretPw"),
    (["python3", "x.py", "--token:S3cretPw"], "S3cretPw"),
    (["python3", "x.py", '{"api_key": "S3cret Pw"}'], "S3cret Pw"),
    (["python3", "-c", "run({'password': 'S3cretPw'})"], "S3cretPw"),
    (["python3", "x.py", '--cfg={"hf_token":"S3cretPw","n":1}'], "S3cretPw"),
    (["curl", "-u", "admin:S3cretPw", "https://h/"], "S3cretPw"),
    (["curl", "-uadmin:S3cretPw", "https://h/"], "S3cretPw"),
    (["curl", "--user=admin:S3cretPw", "https://h/"], "S3cretPw"),
    (["sh", "-c", "curl -u admin:S3cretPw https://h/"], "S3cretPw"),
    (["curl", "-H", "X-Api-Key: S3cretPw", "https://h/"], "S3cretPw"),
    (["curl", "-H", "X-Auth-Token:S3cretPw", "https://h/"], "S3cretPw"),
    (["curl", "-H", "Cookie: PVEAuthCookie=S3cretPw", "https://h/"], "S3cretPw"),
    (["python3", "x.py", "--jwt", "eyJS3cretPw"], "eyJS3cretPw"),
    (["python3", "train.py", "--wandb-key", "S3cretPw"], "S3cretPw"),
    (["env", "MYSQL_PWD=S3cretPw", "DB_PASS=S3cretPw2", "x"], "S3cretPw"),
    (["go-server", "-password", "S3cretPw"], "S3cretPw"),
]


@pytest.mark.parametrize("argv, secret", SECRETS, ids=[" ".join(a)[:40] for a, s in SECRETS])
def test_each_secret_is_masked(argv, secret):
    line = redact_argv(argv)
    assert secret not in line and MASK in line, line


# Look-alikes that are not secrets: they stay as they are.
NOT_SECRETS = [
    ["python3", "serve.py", "-p", "8080"],                       # a separate -p is a port far more often
    ["mysql", "-p", "mydb"],                                     # mysql: -p alone prompts, mydb is the database
    ["python3", "serve.py", "-p8080"],                           # a glued -p with a port
    ["docker-proxy", "-p8080:80/tcp"],
    ["vllm", "--port", "8000", "--max-tokens", "100", "--max-tokens:100"],
    ["python3", "--bypass-cache", "yes", "--bypass", "1", "--passes", "3"],
    ["vllm", "--tokenizer", "llama", "--password-file", "/etc/pw", "--key-file", "/etc/k"],
    ["train.py", "--input-key", "prompt", "--label_key", "answer", "--sort-key", "len", "--public-key", "/k.pub"],
    ["python3", "-u", "train.py", "--jwt-algorithm", "HS256"],
    ["docker", "run", "-u", "1000:1000", "img"],                 # -u user:pass only after curl
    ["curl", "-H", "Content-Type: application/json", "-H", "X-Request-Id: 7", "https://h/"],
    ["python3", "x.py", '{"max_tokens": 100, "tokenizer": "llama"}'],
    ["ffmpeg", "-hwaccel", "cuda", "-pix_fmt", "yuv420p", "-preset", "p4"],   # (its `-pass 1` is masked: a pass flag)
    ["env", "PWD=/home/u", "TOKENIZERS_PARALLELISM=false", "x"],
]


@pytest.mark.parametrize("argv", NOT_SECRETS, ids=[" ".join(a)[:40] for a in NOT_SECRETS])
def test_look_alikes_are_not_masked(argv):
    assert redact_argv(argv) == " ".join(argv)
