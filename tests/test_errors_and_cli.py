"""The shared protocol error types and the CLI registry."""

import pytest

from diloco_node import cli
from wire.errors import LocalProtocolError, ProtocolError, RemoteProtocolError


def test_protocol_errors_carry_status_hint():
    err = RemoteProtocolError("payload too large", status_hint=413)
    assert err.status_hint == 413
    assert isinstance(err, ProtocolError)
    assert LocalProtocolError("misuse").status_hint == 400


def test_base_protocol_error_cannot_be_raised_directly():
    with pytest.raises(TypeError):
        ProtocolError("ambiguous")


def test_cli_rejects_unknown_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_cli_prints_its_version(flag, capsys):
    from diloco_node import __version__

    assert cli.main([flag]) == 0
    assert capsys.readouterr().out.startswith(f"diloco-node {__version__} (Python ")
