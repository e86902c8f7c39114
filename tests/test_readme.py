"""The README's recipes stay valid: the two commands are where CI expects them, the "two sites on one
host" lines are valid `diloco-node run` flags with distinct node ids, ports and data directories,
and the "sites on two hosts" config files are valid TLS configs. (Running the recipes themselves is
`tests/integration/test_local_cluster_script.py`'s job for the script; the README's own runs are
recorded in the issue's closing note.)
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from diloco_node.ops import pki

from conftest import config_show

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TEST_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest -q"
DEMO_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/diloco-node demo"


def _section(title: str) -> str:
    start = README.index(f"### {title}\n")
    end = README.index("\n##", start + 4)
    return README[start:end]


def _blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def _show(argv: list[str]) -> tuple[int, dict[str, str], str]:
    code, out, err = config_show(argv)
    values = {line.split()[0]: line.split()[1] for line in out.splitlines()[3:] if len(line.split()) >= 2}
    return code, values, err


def test_the_readme_opens_with_the_two_commands():
    first_section = README[README.index("\n## "):]
    assert first_section.startswith("\n## The two commands\n")
    blocks = _blocks(first_section[:first_section.index("\n## ", 5)])
    assert [b.strip() for b in blocks] == [DEMO_COMMAND, TEST_COMMAND]


def test_two_sites_on_one_host_are_valid_and_distinct(tmp_path, monkeypatch):
    (block,) = _blocks(_section("Two sites on one host"))
    lines = block.replace("\\\n", " ").splitlines()
    assert "head -c 32 /dev/urandom | base64 > secret && chmod 600 secret" in lines
    runs = [shlex.split(line.split(">")[0]) for line in lines if line.startswith("diloco-node run ")]
    assert len(runs) == 2
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret").write_text("s" * 44 + "\n")
    (tmp_path / "secret").chmod(0o600)
    shown = []
    for argv in runs:
        code, values, err = _show(argv[2:])
        assert code == 0, err
        shown.append((values["node_id"], values["listen"], values["data_dir"]))
    assert len({s[0] for s in shown}) == len({s[1] for s in shown}) == len({s[2] for s in shown}) == 2
    assert "--bootstrap" not in runs[0] and runs[1][runs[1].index("--bootstrap") + 1] == shown[0][1]


def _heredoc(block: str) -> str:
    return block[block.index("<<EOF\n") + 6:block.index("\nEOF\n")]


def test_sites_on_two_hosts_are_valid_tls_configs(tmp_path):
    host_a, host_b = _blocks(_section("Sites on two hosts"))
    assert "diloco-node certs init --out ca" in host_a
    assert "diloco-node certs issue --ca ca --node-id site-b --out site-b" in host_a
    ca = tmp_path / "ca"
    pki.init_ca(ca)
    for node_id in ("site-a", "site-b"):
        pki.issue_site(ca, node_id, tmp_path / node_id)
    (tmp_path / "secret").write_text("s" * 44 + "\n")
    (tmp_path / "secret").chmod(0o600)
    for name, block in (("site-a", host_a), ("site-b", host_b)):
        text = _heredoc(block).replace("$A", "host-a.example.net").replace("$B", "host-b.example.net")
        (tmp_path / f"{name}.toml").write_text(text)
        code, values, err = _show(["--config", str(tmp_path / f"{name}.toml")])
        assert code == 0, err
        assert values["node_id"] == name and values["advertise"].startswith("https://")
        assert values["status_listen"] == "127.0.0.1:7071"  # where the recipe's `status --peer` looks
    assert 'bootstrap = ["host-a.example.net:7070"]' in _heredoc(host_b).replace("$A", "host-a.example.net")


@pytest.mark.parametrize("path", ["docs/RESULTS.md", "docs/OPERATIONS.md", "docs/MODELS.md", "docs/DATA.md"])
def test_the_documents_the_readme_names_exist(path):
    assert f"`{path}`" in README and (ROOT / path).is_file()
