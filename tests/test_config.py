"""Node configuration: precedence and sources, validation, secrets, joiner manifests, examples."""

import argparse
import json
from pathlib import Path

import pytest

from diloco_node.config.settings import (
    NODE_SPECS,
    RUN_SPECS,
    SITE_NODE_ID_PATTERN,
    ConfigError,
    HostPort,
    NodeConfig,
    add_run_flags,
    check_joiner_manifest,
    load_config,
    load_config_from_args,
)
from diloco_node.config.manifest import RunManifest
from wire.messages import MAX_NODE_ID_CHARS, NODE_ID_PATTERN as WIRE_NODE_ID_PATTERN

from conftest import config_show

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SECRET = "s3cr3t-value-that-is-long-enough"


@pytest.fixture
def secret_file(tmp_path) -> Path:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


def _write(tmp_path: Path, text: str, name: str = "node.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- precedence and sources ----------------------------------------------------------------------


def test_defaults_and_derived_values():
    config = load_config(None, {}, {})
    assert config.node.listen == HostPort("127.0.0.1", 7070)
    assert config.node.advertise == "http://127.0.0.1:7070"
    assert config.node.is_founder and config.node.role == "learner"
    assert config.run == RunManifest()
    assert config.sources["listen"] == "default"
    assert config.sources["advertise"] == "derived:listen"
    assert config.sources["node_id"] == "default:hostname"
    assert config.node.data_dir.is_absolute()
    assert any("no run secret" in w for w in config.warnings)


def test_file_then_env_then_flags_each_value_remembers_its_source(tmp_path, secret_file):
    path = _write(tmp_path, f"""
[node]
node_id = "site-a"
listen = "127.0.0.1:7101"
role = "witness"
secret_file = "{secret_file}"
[run.sync]
period = 16
fragments = 2
[run.outer]
lr = 1
""")
    environ = {"DILOCO_LISTEN": "127.0.0.1:7202", "DILOCO_SYNC_PERIOD": "24", "DILOCO_LOG_LEVEL": "debug",
               "PATH": "/bin"}
    config = load_config(path, environ, {"listen": "127.0.0.1:7303", "run.sync.overlap": "3"})
    assert config.node.listen == HostPort("127.0.0.1", 7303)
    assert config.sources["listen"] == "flag:--listen"
    assert config.node.advertise == "http://127.0.0.1:7303"  # derived from the winning listen
    assert config.node.log_level == "debug" and config.sources["log_level"] == "env:DILOCO_LOG_LEVEL"
    assert config.node.role == "witness" and config.sources["role"] == f"file:{path}"
    assert config.run.sync.period == 24 and config.sources["run.sync.period"] == "env:DILOCO_SYNC_PERIOD"
    assert config.run.sync.overlap == 3 and config.sources["run.sync.overlap"] == "flag:--set run.sync.overlap"
    assert config.run.sync.fragments == 2
    assert config.run.outer.lr == 1.0 and isinstance(config.run.outer.lr, float)
    assert config.explicit_run_keys() == {"sync.period", "sync.fragments", "sync.overlap", "outer.lr"}
    assert config.read_secret() == SECRET.encode()
    settings = {s.key: s for s in config.settings()}
    assert len(settings) == len(NODE_SPECS) + len(RUN_SPECS)
    assert settings["run.sync.period"].env == "DILOCO_SYNC_PERIOD"
    assert settings["run.seed"].env == "DILOCO_RUN_SEED"


def test_config_file_from_env_and_private_variables_ignored(tmp_path):
    path = _write(tmp_path, '[node]\nnode_id = "from-env-file"\n')
    config = load_config(None, {"DILOCO_CONFIG": str(path), "DILOCO_X_HARNESS": "anything"}, {})
    assert config.node.node_id == "from-env-file" and config.config_file == path


def test_relative_paths_in_a_file_are_relative_to_the_file(tmp_path):
    (tmp_path / "conf").mkdir()
    path = _write(tmp_path / "conf", '[node]\ndata_dir = "state"\n')
    config = load_config(path, {}, {})
    assert config.node.data_dir == tmp_path / "conf" / "state"


def test_systemd_state_directory_and_credentials(tmp_path):
    credentials = tmp_path / "creds"
    credentials.mkdir()
    (credentials / "diloco-secret").write_text(SECRET + "\r\n")
    (credentials / "diloco-secret").chmod(0o400)
    config = load_config(None, {"STATE_DIRECTORY": "/var/lib/diloco-node", "CREDENTIALS_DIRECTORY": str(credentials)}, {})
    assert config.node.data_dir == Path("/var/lib/diloco-node") and config.sources["data_dir"] == "env:STATE_DIRECTORY"
    assert config.sources["secret_file"] == "systemd-credential:diloco-secret"
    assert config.read_secret() == SECRET.encode()
    assert config.warnings == ()


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ('[node]\nlisen = "127.0.0.1:1"\n', r"node.lisen \(file:.*node.toml\): unknown key; known in \[node\]: node_id, listen"),
        ("[rum.sync]\nperiod = 3\n", r"rum \(file:.*\): unknown key; top-level tables are \[node\] and \[run\]"),
        ("[run.sync]\nperido = 3\n", r"run.sync.perido \(file:.*\): unknown key; known in \[run.sync\]: fragments, period"),
        ("[run.modle]\nsize = 'tiny'\n", r"run.modle.size \(file:.*\): unknown key; known in \[run.modle\]|run sections"),
        ("[node]\nlisten = 7070\n", r"listen = 7070 \(file:.*\): must be a string"),
        ('[run.sync]\nperiod = "32"\n', r"run.sync.period = '32' \(file:.*\): must be an integer"),
        ("[run.outer]\nlr = true\n", r"run.outer.lr = True \(file:.*\): must be a number"),
        ('[node]\nbootstrap = "a:1"\nrole = "trainer"\n', r"role = 'trainer': must be one of learner, witness \[role from file:"),
        ("[run.sync]\nfragments = 64\n", r"sync.fragments = 64 > sync.period = 28.*\[sync.fragments from file:"),
        ("[node\n", r"config file .*node.toml: not valid TOML"),
    ],
)
def test_bad_file_values_name_the_key_and_the_file(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, {}, {})


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope.toml: cannot read: No such file"):
        load_config(tmp_path / "nope.toml", {}, {})


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"DILOCO_SYNC_PERIDO": "3"}, "unknown environment variable DILOCO_SYNC_PERIDO"),
        ({"DILOCO_SYNC_PERIOD": "soon"}, r"run.sync.period = 'soon' \(env:DILOCO_SYNC_PERIOD\): must be an integer"),
        ({"DILOCO_CHECKPOINT_KEEP": "1"}, r"checkpoint_keep = 1: must be >= 2 \[checkpoint_keep from env:DILOCO_CHECKPOINT_KEEP\]"),
        ({"DILOCO_LEASE_TIMEOUT_S": "1.0"}, r"lease_timeout_s = 1.0: must be >= 3 x heartbeat_interval_s"),
        ({"DILOCO_READ_TIMEOUT_S": "nan"}, "must be finite"),
    ],
)
def test_bad_environment_values_name_the_variable(environ, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, environ, {})


@pytest.mark.parametrize(
    "listen, message",
    [
        ("localhost", r"expected HOST:PORT"),
        ("127.0.0.1:99999", r"port 99999 must be in 1..65535"),
        ("127.0.0.1:http", r"port 'http' is not a number"),
        ("::1:7070", r"expected HOST:PORT \(IPv6 as \[addr\]:port\)"),
        ("[not-v6]:7070", r"'not-v6' is not an IPv6 address"),
        (":7070", "expected HOST:PORT"),
    ],
)
def test_bad_listen_addresses(listen, message):
    with pytest.raises(ConfigError, match=r"listen \(flag:--listen\)"):
        load_config(None, {}, {"listen": listen})
    with pytest.raises(ConfigError, match=message):
        load_config(None, {}, {"listen": listen})


def test_ipv6_and_wildcard_listen():
    config = load_config(None, {}, {"listen": "[::1]:7070", "bootstrap": "[::1]:7071, 10.0.0.2:7070"})
    assert config.node.advertise == "http://[::1]:7070"
    assert config.node.bootstrap == (HostPort("::1", 7071), HostPort("10.0.0.2", 7070))
    with pytest.raises(ConfigError, match="advertise: not set, and listen = '0.0.0.0:7070' .* is a wildcard"):
        load_config(None, {}, {"listen": "0.0.0.0:7070"})
    wildcard = load_config(None, {}, {"listen": "0.0.0.0:7070", "advertise": "https://site-a.example.net:7070"})
    assert wildcard.node.listen.is_wildcard


@pytest.mark.parametrize("advertise", ["site-a:7070", "http://site-a", "http://0.0.0.0:7070", "http://a:1/path", "ftp://a:1"])
def test_bad_advertise_urls(advertise):
    with pytest.raises(ConfigError, match=r"advertise = .*expected http\(s\)://HOST:PORT.*\[advertise from flag:--advertise\]"):
        load_config(None, {}, {"advertise": advertise})


def test_source_address_is_an_ip_literal_or_unset():
    assert load_config(None, {}, {}).node.source_address is None
    config = load_config(None, {"DILOCO_SOURCE_ADDRESS": "127.0.0.12"}, {})
    assert config.node.source_address == "127.0.0.12"
    assert config.sources["source_address"] == "env:DILOCO_SOURCE_ADDRESS"
    assert load_config(None, {}, {"source_address": "::1"}).node.source_address == "::1"
    with pytest.raises(ConfigError, match=r"source_address = 'gateway.example' \(flag:--source-address\): must be an IP"):
        load_config(None, {}, {"source_address": "gateway.example"})
    with pytest.raises(ConfigError, match=r"source_address = '0.0.0.0' .*wildcard"):
        load_config(None, {}, {"source_address": "0.0.0.0"})
    parser = argparse.ArgumentParser()
    add_run_flags(parser)
    config = load_config_from_args(parser.parse_args(["--source-address", "127.0.0.9"]), {})
    assert config.node.source_address == "127.0.0.9" and config.sources["source_address"] == "flag:--source-address"


def test_bootstrap_pointing_at_self_and_bad_node_ids():
    with pytest.raises(ConfigError, match="points at this node's own advertise address"):
        load_config(None, {}, {"bootstrap": "127.0.0.1:7070"})
    with pytest.raises(ConfigError, match=r"node_id = 'site a!'"):
        load_config(None, {}, {"node_id": "site a!"})
    with pytest.raises(ConfigError, match=r"node_id = 'site-a\\n'"):  # fullmatch: no trailing newline
        load_config(None, {}, {"node_id": "site-a\n"})


def test_every_node_id_a_site_can_be_given_is_one_the_wire_carries():
    # The site's pattern is the wire's, narrowed to what a certificate's DNS name may hold.
    longest = "a" + "Z9._-" * 12 + "bc"
    assert len(longest) == 63 and SITE_NODE_ID_PATTERN.fullmatch(longest)
    assert len(longest) <= MAX_NODE_ID_CHARS and WIRE_NODE_ID_PATTERN.fullmatch(longest)
    assert load_config(None, {}, {"node_id": longest}).node.node_id == longest
    for wire_only in ("site:a", "site@a", "a" * MAX_NODE_ID_CHARS):
        assert WIRE_NODE_ID_PATTERN.fullmatch(wire_only) and not SITE_NODE_ID_PATTERN.fullmatch(wire_only)
        with pytest.raises(ConfigError, match="must be 1-63 characters"):
            load_config(None, {}, {"node_id": wire_only})
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(None, {}, {"listn": "127.0.0.1:1"})


def test_inline_secrets_are_refused_everywhere_without_echoing_them(tmp_path):
    attempts = [
        lambda: load_config(None, {"DILOCO_SECRET": SECRET}, {}),
        lambda: load_config(None, {"DILOCO_RUN_SECRET": SECRET}, {}),
        lambda: load_config(_write(tmp_path, f'[node]\nsecret = "{SECRET}"\n'), {}, {}),
        lambda: load_config(_write(tmp_path, f'hmac_key = "{SECRET}"\n', "top.toml"), {}, {}),
        lambda: load_config(None, {}, {"secret": SECRET}),
    ]
    for attempt in attempts:
        with pytest.raises(ConfigError, match="inline secrets are refused") as exc:
            attempt()
        assert SECRET not in str(exc.value)
        assert "secret_file" in str(exc.value) and "LoadCredential" in str(exc.value)


def test_unreadable_or_unsuitable_secret_files_are_named(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=rf"secret_file = '{missing}' \(flag:--secret-file\): cannot read: No such file"):
        load_config(None, {}, {"secret_file": str(missing)})
    not_a_dir = tmp_path / "plain"
    not_a_dir.write_text("x")
    with pytest.raises(ConfigError, match="cannot read: Not a directory"):
        load_config(None, {}, {"secret_file": str(not_a_dir / "secret")})
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(None, {}, {"secret_file": str(tmp_path)})
    short = _write(tmp_path, "short\n", "short")
    with pytest.raises(ConfigError, match="secret is 5 bytes, need at least 32"):
        load_config(None, {}, {"secret_file": str(short)})
    loose = _write(tmp_path, SECRET, "loose")
    loose.chmod(0o644)
    config = load_config(None, {}, {"secret_file": str(loose)})
    assert any("readable by group or others" in w and "chmod 600" in w for w in config.warnings)
    with pytest.raises(ConfigError, match="no run secret"):
        load_config(None, {}, {}).read_secret()


def test_data_dir_that_is_a_file_is_refused(tmp_path):
    blocker = _write(tmp_path, "", "blocker")
    with pytest.raises(ConfigError, match=r"data_dir = .*blocker.* \(flag:--data-dir\): exists and is not a directory"):
        load_config(None, {}, {"data_dir": str(blocker)})


# --- joiners and the run manifest ---------------------------------------------------------------


def test_joiner_manifest_contradictions_are_listed():
    ours = RunManifest.from_dict({"sync": {"period": 16}, "model": {"size": "small"}})
    theirs = RunManifest.from_dict({"sync": {"period": 32}})
    with pytest.raises(ConfigError) as exc:
        check_joiner_manifest(ours, theirs)
    assert "model.size: 'small' != (unset: the factory's default)" in str(exc.value) and "sync.period: 16 != 32" in str(exc.value)
    # Only the keys this node set itself are held against the run.
    with pytest.raises(ConfigError, match="sync.period: 16 != 32") as exc:
        check_joiner_manifest(ours, theirs, explicit={"sync.period"})
    assert "model.size" not in str(exc.value)
    check_joiner_manifest(RunManifest(), theirs, explicit=set())  # a silent joiner accepts the run


def test_effective_config_checks_the_run_it_joins(tmp_path):
    joiner = load_config(None, {"DILOCO_SYNC_PERIOD": "16"}, {})
    with pytest.raises(ConfigError, match="(?s)contradict the run it is joining.*sync.period: 16 != 28"):
        joiner.manifest_for_join(RunManifest())
    silent = load_config(None, {}, {})
    founder = RunManifest.from_dict({"sync": {"period": 8, "fragments": 2}})
    assert silent.manifest_for_join(founder) == founder


# --- examples and the config show command --------------------------------------------------------


def test_config_show_prints_values_and_sources(tmp_path, secret_file):
    path = _write(tmp_path, '[node]\nnode_id = "site-a"\n[run.sync]\nperiod = 16\n')
    code, out, err = config_show(["--config", str(path), "--listen", "127.0.0.1:7101", "--secret-file", str(secret_file),
                            "--set", "run.outer.lr=0.5"], {"DILOCO_ROLE": "witness"})
    assert code == 0 and err == ""
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert rows["node_id"][1:] == ["site-a", f"file:{path}"]
    assert rows["listen"][1:] == ["127.0.0.1:7101", "flag:--listen"]
    assert rows["role"][1:] == ["witness", "env:DILOCO_ROLE"]
    assert rows["run.sync.period"][1:] == ["16", f"file:{path}"]
    assert rows["run.outer.lr"][1] == "0.5" and rows["run.outer.lr"][2:] == ["flag:--set", "run.outer.lr"]
    assert rows["run.sync.min_quorum"][1:] == ["1", "default"]
    assert SECRET not in out
    code, out, _ = config_show(["--json", "--secret-file", str(secret_file)], {})
    document = json.loads(out)
    assert code == 0 and len(document["run_manifest_digest"]) == 64
    assert {"key": "listen", "value": "127.0.0.1:7070", "source": "default", "env": "DILOCO_LISTEN"} in document["settings"]


def test_config_show_reports_errors_with_exit_2():
    code, out, err = config_show(["--listen", "nowhere"], {})
    assert code == 2 and out == ""
    assert err.startswith("diloco-node config: error: listen (flag:--listen) = 'nowhere': expected HOST:PORT")
    code, _, err = config_show(["--secret", SECRET], {})
    assert code == 2 and "inline secrets are refused" in err and SECRET not in err
    code, _, err = config_show(["--set", "novalue"], {})
    assert code == 2 and "--set 'novalue': expected KEY=VALUE" in err


@pytest.mark.parametrize("name", ["site-a", "site-b", "site-c", "witness"])
def test_each_example_site_config_is_valid(name):
    code, out, err = config_show(["--config", str(EXAMPLES / "sites" / f"{name}.toml")], {})
    assert code == 0, err
    assert f"node_id                               {name}" in out or f" {name} " in out


def test_example_joiners_agree_with_the_founder():
    founder = load_config(EXAMPLES / "sites" / "site-a.toml", {}, {})
    assert founder.node.is_founder and founder.run.sync.min_quorum == 2
    for name in ("site-b", "site-c", "witness"):
        joiner = load_config(EXAMPLES / "sites" / f"{name}.toml", {}, {})
        assert not joiner.node.is_founder
        assert joiner.manifest_for_join(founder.run) == founder.run
    assert load_config(EXAMPLES / "sites" / "witness.toml", {}, {}).node.role == "witness"
    assert load_config(EXAMPLES / "sites" / "site-c.toml", {}, {}).explicit_run_keys() == {"model.size", "sync.codec_up"}


def test_systemd_unit_has_the_hardening_and_notify_settings():
    unit = (EXAMPLES / "systemd" / "diloco-node.service").read_text()
    settings = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in unit.splitlines()
                if "=" in line and not line.startswith("#")}
    assert settings["Type"] == "notify" and settings["WatchdogSec"] and settings["Restart"] == "on-failure"
    assert settings["KillSignal"] == "SIGTERM" and settings["TimeoutStopSec"]
    for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "NoNewPrivileges", "DynamicUser"):
        assert settings[key] in ("yes", "strict"), key
    assert settings["LoadCredential"].startswith("diloco-secret:")
    assert settings["StateDirectory"] == "diloco-node"
    assert "MemoryDenyWriteExecute" not in settings  # XLA's JIT needs W+X pages


def test_operations_doc_lists_every_key_and_variable():
    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    missing = [s.key for s in NODE_SPECS + RUN_SPECS if f"`{s.key}`" not in doc or s.env not in doc]
    assert missing == []


def test_node_config_direct_construction_validates():
    with pytest.raises(ConfigError, match="checkpoint_keep = 1"):
        NodeConfig(node_id="a", listen=HostPort("127.0.0.1", 1), advertise="http://127.0.0.1:1", checkpoint_keep=1)
    with pytest.raises(ConfigError, match="port 0"):
        HostPort("127.0.0.1", 0)
