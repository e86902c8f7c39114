"""The live page's own JavaScript, run by `node`: where it reads each member's series (the page
and `/series` in-process: tests/test_page.py; the page in Chromium:
tests/integration/test_page_browser.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from diloco_node.ops.page import page_html

pytestmark = pytest.mark.integration


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's JavaScript")
def test_the_page_reads_each_members_series_at_its_status_url_and_never_at_a_tls_peer_port():
    source = re.search(r"^function seriesBase\(m\) \{.*\}$", page_html(), re.M)
    assert source is not None, "page.html must define seriesBase(m) on one line"
    members = [{"url": "https://b:7070", "status_url": "http://b:7071"},  # TLS, advertised: there
               {"url": "https://c:7070", "status_url": ""},  # TLS, none advertised: not tried
               {"url": "http://d:7070", "status_url": ""}]  # no TLS: the shared port
    script = source.group(0) + f"\nconsole.log(JSON.stringify({json.dumps(members)}.map(seriesBase)));"
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=30, check=True).stdout
    assert json.loads(out) == ["http://b:7071", "", "http://d:7070"]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the page's JavaScript")
def test_the_eval_chart_draws_one_line_per_site_and_eval_set():
    source = re.search(r"^function evalLines\(sites, colorOf\) \{$.*?^\}$", page_html(), re.M | re.S)
    assert source is not None, "page.html must define evalLines(sites, colorOf)"
    sites = [["a", {"samples": [{"t": 1, "eval_loss": 3.0}, {"t": 2, "eval_loss": 2.9}]}],
             ["b", {"samples": [{"t": 1, "eval_loss": None, "eval_sets": {"code": 2.5, "wiki": None}},
                                {"t": 2, "eval_loss": None, "eval_sets": {"code": 2.4, "wiki": 3.1}}]}],
             ["w", {"samples": [{"t": 1, "eval_loss": None, "eval_sets": {}}]}]]  # a witness: no line
    script = (source.group(0) + f"\nconsole.log(JSON.stringify(evalLines({json.dumps(sites)}, id => 'c-' + id)));")
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=30, check=True).stdout
    lines = {line["name"]: line for line in json.loads(out)}
    assert set(lines) == {"a", "b code", "b wiki"}
    assert lines["a"]["points"] == [[1, 3.0], [2, 2.9]] and lines["b wiki"]["points"] == [[2, 3.1]]
    assert lines["b code"]["color"] == lines["b wiki"]["color"] == "c-b"
    assert lines["b code"]["dash"] == "" and lines["b wiki"]["dash"] != ""
