"""scripts/gpu_check.sh --cpu: the GPU check's every step without CUDA, small, as CI keeps it working
(its llama.cpp build, once: reused from the cache after). The CUDA run is the same script on a
machine with a card (benchmarks/gpu/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

pytestmark = pytest.mark.model


def test_help_names_every_mode():
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    for mode in ("--prepare", "--start", "--stage", "--cpu", "--results", "--jobs", "--budget", "--wide-only"):
        assert mode in out
    bad = subprocess.run(["bash", str(SCRIPT), "--nope"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown argument" in bad.stderr


def test_the_cpu_check_runs_every_step(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    p = subprocess.run(["bash", str(SCRIPT), "--cpu", "--results", str(results)],
                       env={**os.environ, "PYTHON": sys.executable, "OUT": str(out)}, capture_output=True, text=True,
                       timeout=5400)
    assert p.returncode == 0, p.stderr[-5000:]
    summary = (results / "SUMMARY.md").read_text()
    assert "tests marked gpu: exit 0" in summary and "benchmarks: exit 0" in summary

    suite = ET.parse(results / "tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    ran = int(suite.get("tests")) - int(suite.get("skipped"))
    assert int(suite.get("failures")) == int(suite.get("errors")) == 0 and ran >= 4

    host = json.loads((results / "host_time.json").read_text())
    assert host["speculative"]["host_ms_per_step"] > 0 and host["oracle_alone"]["host_ms_per_token"] > 0
    assert json.loads((results / "logits.json").read_text())["max_abs_diff"] < 0.25
    idle = json.loads((results / "idle_host_time.json").read_text())
    assert idle["default"]["host_ms_per_step"] > 0 and idle["oracle_alone"]["host_ms_per_step"] > 0
    assert "host ms a step: the oracle alone" in summary  # the idle step's figure, on the report
    assert json.loads((results / "first_token.json").read_text())["served_ms"] > 0
    assert "first token, the oracle alone: in-process" in summary
    assert "the draft picking from its rows' top k on the device" in summary  # ... and a drafting step's, both ways
    assert {"speculative", "speculative_whole_draft_rows", "draft_picks"} <= set(host)
    assert "bench-smollm2, host time's share of the wall: " in summary and "adaptive (chat)" in summary

    # localspec against llama.cpp's speculative program built in the same step
    bench = json.loads((results / "bench-smollm2.json").read_text())
    assert {"baseline", "k4", "llama.cpp-k4"} <= {row["system"] for row in bench["runs"]}
    clients = json.loads((results / "clients-smollm2.json").read_text())
    assert {"localspec", "llama-server"} <= {row["system"] for row in clients["runs"]}

    # issue 48's first targets: fresh `generate` processes, the default against --no-draft
    generate = json.loads((results / "generate.json").read_text())
    assert {(r["prompt"], r["phase"]) for r in generate["rows"]} == {
        (prompt, phase) for prompt in ("open", "code-rewrite") for phase in ("fresh", "again")}
    assert all(r["default_tok_s"] > 0 and r["no_draft_tok_s"] > 0 for r in generate["rows"])
    assert "fresh `generate`, default / --no-draft tok/s: open fresh" in summary
    # ... and whether llama.cpp's CPU threads (idle where every layer is on a GPU) cost the host
    assert {(t["system"], t["threads"]) for t in generate["threads"]} == {
        (system, threads) for system in ("default", "no-draft") for threads in (1, "default")}
    assert "llama.cpp's CPU threads, fresh `generate` of the open prompt: no-draft --threads 1" in summary

    # what the device tool brings back (<= 8 files): the summary, the tests' log, everything in one tarball
    assert sorted(f.name for f in out.iterdir()) == ["SUMMARY.md", "results.tar.gz", "tests.log"]
    with tarfile.open(out / "results.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"SUMMARY.md", "generate.json", "bench-smollm2.json", "clients-smollm2.json", "tests.xml"} <= names
    assert (out / "SUMMARY.md").read_text() == summary
