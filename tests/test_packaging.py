"""The package says what it is: one version, the license file its metadata names, where to find
the project, and extras for accelerator sites."""

from __future__ import annotations

import tomllib
from pathlib import Path

import diloco_node

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_license_file_is_the_apache_2_license_the_metadata_names() -> None:
    assert PROJECT["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text


def test_one_version_and_the_project_urls() -> None:
    assert "version" in PROJECT["dynamic"] and "version" not in PROJECT  # from diloco_node.__version__
    assert diloco_node.__version__.count(".") == 2
    assert set(PROJECT["urls"]) == {"Homepage", "Documentation", "Issues"}
    assert all(url.startswith("https://") for url in PROJECT["urls"].values())


def test_accelerator_extras_and_the_metrics_dependency() -> None:
    extras = PROJECT["optional-dependencies"]
    assert extras["cuda12"] == ["jax[cuda12]>=0.5"] and extras["tpu"] == ["jax[tpu]>=0.5"]
    assert any(d.startswith("prometheus_client") for d in PROJECT["dependencies"])
