"""localspec bench: the ceiling formula on known numbers, workloads, system names, the C++ anchor's
command line and output parsing (on a stand-in program), the report on synthetic runs, and one real
tiny run through the CLI (baseline + one speculative system, anchor skipped). No timing assertions."""

from __future__ import annotations

import json
import math
import stat
import sys
from pathlib import Path

import pytest

from localspec.bench import anchor, ceiling, report, systems, workloads
from localspec.bench.charts import write_charts
from localspec.bench.results_document import results_document

# ---------------------------------------------------------------------------------------- ceiling


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_expected_tokens_limits(k):
    assert ceiling.expected_tokens(0.0, k) == 1.0  # nothing accepted: the oracle's own token
    assert ceiling.expected_tokens(1.0, k) == k + 1  # everything accepted plus the bonus token


def test_expected_tokens_by_hand():
    assert ceiling.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert ceiling.expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)  # 3.3616
    assert ceiling.expected_tokens(0.8, 0) == 1.0
    with pytest.raises(ValueError):
        ceiling.expected_tokens(1.5, 2)


def test_predicted_speedup_by_hand():
    c_verify = lambda n: 10.0 + n  # noqa: E731  (ms: fixed cost + per position)
    # E = 3.3616; step = 4 * 1 + c_verify(5) = 19; oracle alone: c_verify(1) = 11 per token
    assert ceiling.predicted_speedup(0.8, 4, 1.0, c_verify) == pytest.approx(3.3616 * 11 / 19)
    # a = 0 costs the draft for nothing: 1 * 11 / (2 * 1 + 13)
    assert ceiling.predicted_speedup(0.0, 2, 1.0, c_verify) == pytest.approx(11 / 15)
    # free drafts and flat verification: the speedup is E itself
    assert ceiling.predicted_speedup(1.0, 3, 0.0, lambda n: 5.0) == pytest.approx(4.0)


def test_predicted_speedup_per_step():
    c_verify = lambda n: 10.0 + n  # noqa: E731
    e = ceiling.expected_tokens(0.8, 4)
    # one draft length: the standard formula
    assert ceiling.predicted_speedup_per_step(e, {4: 7}, 1.0, c_verify) == pytest.approx(
        ceiling.predicted_speedup(0.8, 4, 1.0, c_verify))
    # half the steps draft nothing (11 ms), half draft 4 (4 + 15 = 19 ms): 2.5 tokens per 15 ms
    assert ceiling.predicted_speedup_per_step(2.5, {0: 5, 4: 5}, 1.0, c_verify) == pytest.approx(2.5 * 11 / 15)


@pytest.mark.parametrize("a,k", [(0.3, 2), (0.8, 4), (0.95, 8), (0.5, 2.5)])
def test_acceptance_inverts_expected_tokens(a, k):
    e = ceiling.expected_tokens(a, k)
    assert ceiling.acceptance_from_tokens_per_step(e, k) == pytest.approx(a, abs=1e-9)


def test_acceptance_edges():
    assert ceiling.acceptance_from_tokens_per_step(1.0, 4) == 0.0
    assert ceiling.acceptance_from_tokens_per_step(5.0, 4) == 1.0
    assert ceiling.acceptance_from_tokens_per_step(2.0, 0) == 0.0


def test_cost_curve():
    c = ceiling.cost_curve({1: 10.0, 3: 14.0, 5: 20.0})
    assert c(1) == 10.0 and c(3) == 14.0
    assert c(2) == pytest.approx(12.0)  # interpolated
    assert c(4.5) == pytest.approx(18.5)
    assert c(9) > c(5)  # extrapolated along the fitted line
    single = ceiling.cost_curve({1: 10.0})
    assert single(3) == pytest.approx(30.0)  # one point: proportional (pessimistic)


def test_stats_helpers():
    assert ceiling.median([3, 1, 2]) == 2 and ceiling.median([1, 2, 3, 4]) == 2.5
    assert ceiling.percentile([1, 2, 3, 4, 5], 50) == 3
    assert ceiling.percentile(list(range(101)), 95) == pytest.approx(95)
    assert ceiling.geomean([1, 4]) == pytest.approx(2)
    assert math.isnan(ceiling.median([]))


# ---------------------------------------------------------------------------------------- workloads


def test_bundled_workloads():
    prompts = workloads.load()
    assert 20 <= len(prompts) <= 60  # a few dozen
    by = {w: [p for p in prompts if p.workload == w] for w in workloads.WORKLOADS}
    assert all(len(v) >= 3 for v in by.values()), {k: len(v) for k, v in by.items()}
    assert all(p.max_tokens >= 400 for p in by["long"])
    assert len({(p.workload, p.id) for p in prompts}) == len(prompts)
    assert all(p.request for p in prompts)
    assert len(workloads.load(["chat", "code"], max_prompts=2, max_tokens=8)) == 4
    assert all(p.max_tokens == 8 for p in workloads.load(["chat"], max_tokens=8))
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.load(["nope"])


def test_workload_file_errors(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "a", "prompt": "x", "max_tokens": 4}\n{"id": "a", "prompt": "y", "max_tokens": 4}\n')
    with pytest.raises(ValueError, match="duplicate id"):
        workloads.load([str(f)])
    f.write_text('{"id": "a", "prompt": "x", "messages": [], "max_tokens": 4}\n')
    with pytest.raises(ValueError, match="exactly one"):
        workloads.load([str(f)])
    f.write_text('{"id": "a", "prompt": "x"}\n')
    with pytest.raises(ValueError, match="max_tokens"):
        workloads.load([str(f)])


# ---------------------------------------------------------------------------------------- systems


def test_system_names():
    specs = systems.parse_systems("k4,adaptive,lookup,llama.cpp-k2,llama.cpp-spec,lcp-lookup-k3,hybrid")
    names = [s.name for s in specs]
    assert names[0] == "baseline"  # always there, first
    assert {s.name: s.kind for s in specs}["llama.cpp-k2"] == systems.LLAMA_CPP
    assert specs[1].params == {"draft": "model", "draft_length": 4, "lookup": False}  # the draft model alone
    assert systems.parse_system("adaptive").params == {"draft": "model", "draft_length": None, "lookup": True}
    assert systems.parse_system("hybrid").params == systems.parse_system("adaptive").params  # its old name
    assert systems.parse_system("model").params == {"draft": "model", "draft_length": None, "lookup": False}
    assert systems.parse_system("lookup").params["draft"] == "ngram"
    assert systems.parse_system("llama.cpp").params == {"binary": "llama-speculative-simple", "k": 8}
    assert systems.parse_system("llama.cpp-spec-k4").params == {"binary": "llama-speculative", "k": 4}
    assert systems.parse_system("lcp-lookup-k3").params["num_pred_tokens"] == 3
    ngram = systems.parse_system("llama.cpp-ngram")
    assert ngram.params == {"binary": "llama-speculative-simple", "k": None, "spec_type": "ngram-simple"}
    assert not ngram.uses_draft_model and systems.parse_system("llama.cpp").uses_draft_model
    assert systems.parse_system("llama.cpp-ngram-k16").params["k"] == 16
    assert [s.name for s in systems.parse_systems(None)][:2] == ["baseline", "k4"]
    grid = [s for s in systems.parse_systems("llama.cpp-grid") if s.is_anchor]
    assert [(s.params["k"], s.params.get("flash_attn")) for s in grid] == [
        (4, None), (4, "off"), (8, None), (8, "off"), (16, None), (16, "off")]
    off = systems.parse_system("adaptive-fa-on")
    assert off.kind == systems.LOCALSPEC and off.params == {"draft": "model", "draft_length": None, "lookup": True,
                                                            "flash_attn": "on"}
    for bad in ("baseline-fa-off", "lcp-lookup-fa-off", "adaptive-fa-fast"):
        with pytest.raises(ValueError):
            systems.parse_system(bad)
    for bad in ("k0", "fast", "llama.cpp-k"):
        with pytest.raises(ValueError):
            systems.parse_system(bad)


# ---------------------------------------------------------------------------------------- the C++ anchor

STATS = """\
main: encoded   43 tokens in    0.052 seconds, speed:  826.923 t/s
main: decoded   65 tokens in    0.712 seconds, speed:   91.292 t/s

n_draft   = 8
n_predict = 65
n_drafted = 56
n_accept  = 51
accept    = 91.071%
"""


def test_parse_anchor_stats():
    s = anchor.parse_stats(STATS)
    assert s["prompt_tokens"] == 43 and s["completion_tokens"] == 65
    assert s["decode_time"] == pytest.approx(0.712) and s["tokens_per_second"] == pytest.approx(91.292)
    assert (s["n_draft"], s["n_predict"], s["n_drafted"], s["n_accept"]) == (8, 65, 56, 51)
    assert s["accept_percent"] == pytest.approx(91.071)
    with pytest.raises(ValueError):
        anchor.parse_stats("nothing here")


def test_anchor_generated_text():
    assert anchor.generated_text("\n\nPROMPT Hello\x1b[36m world\x1b[37m\n\n", "PROMPT") == " Hello world"
    assert anchor.generated_text("\n\n<s>PROMPT out\n\n", "PROMPT") == " out"  # echo differs at the start


FAKE = """\
#!{python}
import sys
args = sys.argv[1:]
if "--help" in args:
    print("--spec-draft-n-max N  number of tokens to draft\\n--spec-draft-n-min N\\n--spec-draft-p-min P\\n"
          "--spec-type TYPES\\n-td, --threads-draft N\\n-fa, --flash-attn [on|off|auto]\\n-nr, --no-repack")
    sys.exit(0)
opt = dict(zip(args[::2], args[1::2]))
with open("{log}", "w") as f:
    f.write(" ".join(args))
prompt = open(opt["-f"]).read()
if prompt.endswith("\\n"):
    prompt = prompt[:-1]
sys.stdout.write("\\n\\n" + prompt + " generated text\\n\\n")
sys.stderr.write({stats!r})
"""


def test_anchor_run_on_a_stand_in(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "llama-speculative-simple"
    log = tmp_path / "args"
    fake.write_text(FAKE.format(python=sys.executable, log=log, stats=STATS))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert anchor.find_binary("llama-speculative-simple", bin_dir) == fake
    with pytest.raises(anchor.AnchorUnavailable, match="build_llama_anchor"):
        anchor.find_binary("llama-speculative", bin_dir)

    r = anchor.run(fake, oracle="o.gguf", draft="d.gguf", prompt_text="<|im_start|>user\nhi\n", prompt_echo=
                   "<|im_start|>user\nhi\n", n_predict=64, k=4, threads=2, n_ctx=2048)
    assert r["text"] == " generated text"  # the trailing newline of the prompt survived -f
    assert r["tokens_per_second"] == pytest.approx(91.292) and r["n_accept"] == 51
    assert r["peak_rss"] and r["peak_rss"] > 0
    args = log.read_text().split()
    for flag, value in [("-m", "o.gguf"), ("-md", "d.gguf"), ("-n", "64"), ("--spec-draft-n-max", "4"),
                        ("-t", "2"), ("-td", "2"), ("--temp", "0"), ("-c", "2048"),
                        ("--spec-type", "draft-simple")]:
        assert args[args.index(flag) + 1] == value, flag
    assert "--spec-draft-p-min" not in args  # llama.cpp's own default
    assert "--no-repack" in args and "--flash-attn" not in args  # no repacking (it crashes on AMX); its default kernel
    anchor.run(fake, oracle="o.gguf", draft="d.gguf", prompt_text="p", prompt_echo="p", n_predict=8, k=16,
               threads=1, n_ctx=512, flash_attn="off")
    args = log.read_text().split()
    assert args[args.index("--flash-attn") + 1] == "off"
    anchor.run(fake, oracle="o.gguf", draft="d.gguf", prompt_text="p", prompt_echo="p", n_predict=8, k=16,
               threads=1, n_ctx=512, temperature=0.7)
    args = log.read_text().split()  # sampled as localspec samples by default: no other filter
    for flag, value in [("--temp", "0.7"), ("--top-k", "0"), ("--top-p", "1.0"), ("--min-p", "0.0")]:
        assert args[args.index(flag) + 1] == value, flag


def test_anchor_ngram_lookup_runs_without_a_draft_model(tmp_path):
    fake = tmp_path / "llama-speculative-simple"
    log = tmp_path / "args"
    fake.write_text(FAKE.format(python=sys.executable, log=log, stats=STATS))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    anchor.run(fake, oracle="o.gguf", draft=None, prompt_text="p", prompt_echo="p", n_predict=8, k=16,
               threads=1, n_ctx=512, spec_type="ngram-simple")
    args = log.read_text().split()
    assert "-md" not in args and "--spec-draft-n-max" not in args
    assert args[args.index("--spec-type") + 1] == "ngram-simple"
    assert args[args.index("--spec-ngram-simple-size-m") + 1] == "16"


# ---------------------------------------------------------------------------------------- report


def verify_cost(n):
    return 0.010 + 0.001 * n


def _k4_records(context=100):
    """A k4 run's steps: the first drafts nothing; then 24 steps draft 4 tokens (1 ms each) and 3 of
    them are accepted. Fields as the bench worker sends them."""
    steps = [[0, 0, 0, 0.0, verify_cost(1), context, 0]]
    steps += [[4, 4, 3, 0.004, verify_cost(5), context + 1 + 4 * i, 4] for i in range(24)]
    return steps


def _synthetic_report():
    runs = []
    for rep in range(3):
        for pid, base_tps in (("p1", 50.0), ("p2", 40.0)):
            runs.append({"system": "baseline", "workload": "chat", "prompt_id": pid, "rep": rep,
                         "completion_tokens": 100, "tokens_per_second": base_tps + rep, "ttft": 0.1,
                         "drafted": 0, "accepted": 0, "steps": 100, "latencies": [0.02] * 99, "prompt_tokens": 100,
                         "records": [[0, 0, 0, 0.0, verify_cost(1), 100 + i, 0] for i in range(100)],
                         "match": 1.0})
            runs.append({"system": "k4", "workload": "chat", "prompt_id": pid, "rep": rep,
                         "completion_tokens": 100, "tokens_per_second": 2 * (base_tps + rep), "ttft": 0.1,
                         "drafted": 100, "accepted": 75, "steps": 25, "latencies": [0.01] * 99, "prompt_tokens": 100,
                         "records": _k4_records(), "match": 1.0 if pid == "p1" else 0.5})
    return {"config": {"prompts": [{"workload": "chat", "id": "p1"}, {"workload": "chat", "id": "p2"}]},
            "systems": [{"name": "baseline", "kind": "localspec", "params": {"draft": None}, "peak_rss": 2**29},
                        {"name": "k4", "kind": "localspec", "params": {"draft": "model", "draft_length": 4},
                         "peak_rss": 2**30},
                        {"name": "llama.cpp", "kind": "llama.cpp", "params": {}, "status": "skipped",
                         "reason": "not built"}],
            "runs": runs, "notes": []}


def test_aggregate_on_synthetic_runs():
    rep = _synthetic_report()
    rows = {(r["system"], r["workload"]): r for r in report.aggregate(rep)}
    k4 = rows[("k4", "chat")]
    assert set(report.RESULT_FIELDS) <= set(k4)
    assert k4["speedup"] == pytest.approx(2.0)
    assert k4["acceptance_rate"] == pytest.approx(0.75) and k4["mean_accepted_length"] == pytest.approx(3.0)
    assert k4["tokens_per_step"] == pytest.approx(4.0) and k4["mean_draft_length"] == pytest.approx(4.0)
    assert k4["greedy_match"] == pytest.approx(0.75) and k4["mismatched_runs"] == 3
    assert k4["latency_p50"] == pytest.approx(0.01) and k4["peak_rss"] == 2**30
    assert rows[("baseline", "chat")]["ceiling"] == 1.0 and rows[("baseline", "chat")]["speedup"] == 1.0

    rep["results"] = report.aggregate(rep)
    text = report.summary(report.clean(rep))
    assert "| chat | k4 |" in text and "2.00×" in text and "`llama.cpp` skipped: not built" in text


def test_the_ceiling_is_predicted_step_by_step_from_the_fitted_costs():
    """The oracle alone's predicted time for the tokens each step emitted, over the predicted time of
    the steps taken (draft and verify at the step's size and context)."""
    rows = {r["system"]: r for r in report.aggregate(_synthetic_report())}
    steps = _k4_records()
    expected = sum(s[2] + 1 for s in steps) * verify_cost(1) / (verify_cost(1) + 24 * (0.004 + verify_cost(5)))
    assert rows["k4"]["ceiling"] == pytest.approx(expected, rel=0.02)
    assert rows["k4"]["efficiency"] == pytest.approx(2.0 / rows["k4"]["ceiling"])
    assert rows["k4"]["costs"]["verify"]["5"] == pytest.approx(verify_cost(5), rel=0.02)
    assert rows["k4"]["costs"]["draft_per_token"] == pytest.approx(0.001, rel=0.05)
    assert rows["baseline"]["ceiling"] == 1.0


def test_the_ceilings_one_token_cost_comes_from_the_oracle_alones_own_steps():
    """A run at fixed K has one pass size (its first step's aside): the oracle alone's time for its
    tokens is priced from the baseline's one-token passes, here 30% dearer than the k4 run's single
    one-token step says."""
    rep = _synthetic_report()
    for r in rep["runs"]:
        if r["system"] == "baseline":
            r["records"] = [[0, 0, 0, 0.0, 1.3 * verify_cost(1), 100 + i, 0] for i in range(100)]
    rows = {r["system"]: r for r in report.aggregate(rep)}
    steps = _k4_records()
    expected = sum(s[2] + 1 for s in steps) * 1.3 * verify_cost(1) / (verify_cost(1) + 24 * (0.004 + verify_cost(5)))
    assert rows["k4"]["ceiling"] == pytest.approx(expected, rel=0.03)


def test_a_drafts_catch_up_on_the_prompt_counts_in_the_ceiling_as_measured():
    """The first proposal evaluates the prompt as one batch (draft_prompt_time > 0): the cost model
    describes a step's few tokens, so that step's draft time is taken as measured, and left out of
    the fit."""
    rep = _synthetic_report()
    for r in rep["runs"]:
        if r["system"] == "k4":
            r["records"] = [x + [0.0] for x in _k4_records()]
            r["records"][1] = [4, 4, 3, 0.25, verify_cost(5), 101, 104, 0.246]
    rows = {r["system"]: r for r in report.aggregate(rep)}
    steps = _k4_records()
    expected = sum(s[2] + 1 for s in steps) * verify_cost(1) / (
        verify_cost(1) + 0.25 + 23 * 0.004 + 24 * verify_cost(5))
    assert rows["k4"]["ceiling"] == pytest.approx(expected, rel=0.02)
    assert rows["k4"]["costs"]["draft_per_token"] == pytest.approx(0.001, rel=0.05)


def test_the_anchors_ceiling_uses_localspecs_costs_for_the_same_k_and_the_report_names_its_best_flags():
    rep = _synthetic_report()
    rep["systems"][2] = {"name": "llama.cpp-k4", "kind": "llama.cpp", "params": {"k": 4}}
    rep["systems"].append({"name": "llama.cpp-k4-fa-off", "kind": "llama.cpp", "params": {"k": 4, "flash_attn": "off"}})
    for rep_i in range(3):
        for pid, base_tps in (("p1", 50.0), ("p2", 40.0)):
            for name, factor in (("llama.cpp-k4", 1.5), ("llama.cpp-k4-fa-off", 1.6)):
                rep["runs"].append({"system": name, "workload": "chat", "prompt_id": pid, "rep": rep_i,
                                    "completion_tokens": 100, "tokens_per_second": factor * (base_tps + rep_i),
                                    "ttft": None, "drafted": 100, "accepted": 75, "steps": 25, "latencies": [],
                                    "prompt_tokens": 100, "one_shot_wall": 3.0})
    rows = {r["system"]: r for r in report.aggregate(rep)}
    a = ceiling.acceptance_from_tokens_per_step(4.0, 4)
    expected = ceiling.predicted_speedup(a, 4, 0.001, verify_cost)
    assert rows["llama.cpp-k4"]["ceiling"] == pytest.approx(expected, rel=0.03)
    rep["results"] = report.aggregate(rep)
    assert report.best_anchor(rep)["system"] == "llama.cpp-k4-fa-off"
    assert any("llama.cpp at its best flags here: llama.cpp-k4-fa-off" in line for line in report.headline(rep))


def test_one_shot_columns():
    rep = _synthetic_report()
    for r in rep["runs"]:
        if r["rep"] == 0:
            r["one_shot_wall"] = 6.0 if r["system"] == "baseline" else 4.0
    rows = {r["system"]: r for r in report.aggregate(rep)}
    assert rows["k4"]["one_shot_wall"] == pytest.approx(8.0) and rows["k4"]["one_shot_speedup"] == pytest.approx(1.5)
    assert rows["baseline"]["one_shot_speedup"] == pytest.approx(1.0)
    rep["results"] = report.aggregate(rep)
    assert "one-shot speedup" in report.markdown_table(rep) and "| 8.00 | 1.50× |" in report.markdown_table(rep)


def test_time_to_first_token_against_the_oracle_alones_on_the_same_prompt():
    """A row's TTFT median mixes prompts of every length; the ratio is per prompt and repetition."""
    rep = _synthetic_report()
    for r in rep["runs"]:  # p1 a short prompt, p2 a long one; k4 10% slower on p1, 20% faster on p2
        short = r["prompt_id"] == "p1"
        r["ttft"] = (0.1 if short else 0.4) * (1.0 if r["system"] == "baseline" else 1.1 if short else 0.8)
    rows = {r["system"]: r for r in report.aggregate(rep)}
    assert rows["baseline"]["ttft_ratio"] == pytest.approx(1.0)
    assert rows["k4"]["ttft_ratio"] == pytest.approx(math.sqrt(1.1 * 0.8))
    rep["results"] = report.aggregate(rep)
    assert "TTFT vs alone" in report.markdown_table(rep) and "| 0.94× |" in report.markdown_table(rep)


def test_ratio_interval():
    assert ceiling.ratio_interval([1.1, 0.9]) is None  # too few to say
    assert ceiling.ratio_interval([2.0, 2.0, 2.0]) == pytest.approx((2.0, 2.0))
    logs = [math.log(x) for x in (0.9, 1.0, 1.1, 1.05)]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    low, high = ceiling.ratio_interval([0.9, 1.0, 1.1, 1.05])
    assert low == pytest.approx(math.exp(mean - 3.18 * sd / 2)) and high == pytest.approx(math.exp(mean + 3.18 * sd / 2))


def test_paired_speedup_is_over_the_same_process_run_with_drafting_off():
    rep = _synthetic_report()
    rows = {r["system"]: r for r in report.aggregate(rep)}
    assert rows["k4"]["paired_speedup"] is None
    rep["results"] = report.aggregate(rep)
    assert "paired speedup" not in report.markdown_table(rep)

    for r in rep["runs"]:
        if r["system"] == "k4":  # drafting off ran at 0.8x the baseline's speed in k4's process
            r["paired_tokens_per_second"] = r["tokens_per_second"] / 2.0 * 0.8 * (1.1 if r["rep"] else 1.0)
    rows = {r["system"]: r for r in report.aggregate(rep)}
    assert rows["k4"]["speedup"] == pytest.approx(2.0)
    # per prompt, the median of the repetitions' ratios 2.5, 2.5/1.1, 2.5/1.1
    assert rows["k4"]["paired_speedup"] == pytest.approx(2.5 / 1.1)
    assert rows["baseline"]["paired_speedup"] is None
    rep["results"] = report.aggregate(rep)
    table = report.markdown_table(rep)
    low, high = rows["k4"]["paired_interval"]
    assert low < 2.5 / 1.1 < high < 2.5
    assert "| speedup | paired speedup |" in table and f"| 2.00× | 2.27× ({low:.2f}–{high:.2f}) |" in table
    assert "| 1.00× | – |" in table  # the baseline has no paired figure


def test_json_is_strict(tmp_path):
    rep = _synthetic_report()
    rep["results"] = report.aggregate(rep)
    rep["results"][0]["speedup"] = float("nan")
    path = tmp_path / "r.json"
    report.write_json(rep, path)
    assert json.loads(path.read_text())["results"][0]["speedup"] is None


def test_charts(tmp_path):
    pytest.importorskip("matplotlib")
    rep = _synthetic_report()
    rep["results"] = report.aggregate(rep)
    charts, why_not = write_charts(rep, tmp_path)
    assert why_not is None and len(charts) == 2
    for path in charts.values():
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------- a real tiny run


@pytest.mark.model
def test_bench_cli_tiny_run(tmp_path, pair_paths):
    from click.testing import CliRunner

    from localspec.cli.commands import main

    oracle, draft = pair_paths
    wl = tmp_path / "tiny.jsonl"
    wl.write_text(json.dumps({"id": "t1", "messages": [{"role": "user", "content": "Name three colours."}],
                              "max_tokens": 8}) + "\n")
    out = tmp_path / "report.json"
    empty = tmp_path / "no-anchor"
    empty.mkdir()
    result = CliRunner().invoke(main, [
        "bench", "--oracle", str(oracle), "--draft", str(draft), "--workload", str(wl), "--systems", "k2,llama.cpp",
        "--paired", "--one-shot", "--reps", "1", "--threads", "1", "--ctx", "512", "--json", str(out),
        "--anchor-bin", str(empty),
        "--markdown", str(tmp_path / "RESULTS.md")])
    assert result.exit_code == 0, result.output
    assert "| tiny | k2 |" in result.output

    rep = json.loads(out.read_text())
    assert rep["schema"] == "localspec-bench/1"
    for key in ("cpu", "logical_cpus", "threads", "ram_bytes", "llama_cpp_python", "python"):
        assert key in rep["machine"]
    assert rep["config"]["threads"] == 1 and rep["config"]["prompts"][0]["prompt_tokens"] > 0
    status = {s["name"]: s for s in rep["systems"]}
    assert status["baseline"]["status"] == "ok" and status["k2"]["status"] == "ok"
    assert status["llama.cpp"]["status"] == "skipped" and "build_llama_anchor" in status["llama.cpp"]["reason"]
    assert status["k2"]["peak_rss"] > 0

    assert {r["system"] for r in rep["runs"]} == {"baseline", "k2"}
    for r in rep["runs"]:
        assert 0 < r["completion_tokens"] <= 8 and r["tokens_per_second"] > 0 and r["ttft"] > 0
        assert r["match"] is not None
    k2_run = next(r for r in rep["runs"] if r["system"] == "k2")
    assert k2_run["drafted"] > 0 and len(k2_run["records"]) == k2_run["steps"]
    assert k2_run["records"][0][:3] == [0, 0, 0]  # the first token from a plain oracle step
    assert sum(k2_run["draft_lengths"].values()) == k2_run["steps"]
    assert k2_run["paired_tokens_per_second"] > 0  # the same process, drafting off
    for r in rep["runs"]:  # a fresh `localspec generate` process per system and prompt
        assert r["one_shot_wall"] > r["decode_time"] and 0 < r["one_shot_tokens"] <= 8
    assert "paired_tokens_per_second" not in next(r for r in rep["runs"] if r["system"] == "baseline")

    rows = {r["system"]: r for r in rep["results"]}
    for row in rows.values():
        assert set(report.RESULT_FIELDS) <= set(row)
    k2 = rows["k2"]
    for key in ("tokens_per_second", "speedup", "paired_speedup", "acceptance_rate", "mean_accepted_length", "ceiling",
                "efficiency", "ttft", "latency_p50", "latency_p95", "peak_rss", "greedy_match", "host_ms_per_token"):
        assert k2[key] is not None, key
    assert rows["baseline"]["host_ms_per_token"] > 0  # the oracle alone's controller too
    assert k2_run["host_ms_per_step"] > 0 and k2_run["host_draft_time"] >= 0
    assert 0.0 <= k2["greedy_match"] <= 1.0
    assert "## Machine" in (tmp_path / "RESULTS.md").read_text()


def test_a_sampled_bench_samples_every_system_and_claims_no_greedy_match(tmp_path, pair_paths):
    """`--temperature 0.7`: localspec's runs sample (unseeded), a fresh `generate` is told to, and
    llama-cpp-python's greedy-only systems are skipped; no run is compared with the baseline's text."""
    from click.testing import CliRunner

    from localspec.bench.runner import one_shot_command
    from localspec.bench.systems import parse_systems
    from localspec.bench.workloads import BenchPrompt
    from localspec.cli.commands import main

    oracle, draft = pair_paths
    wl = tmp_path / "tiny.jsonl"
    wl.write_text(json.dumps({"id": "t1", "messages": [{"role": "user", "content": "Name three colours."}],
                              "max_tokens": 8}) + "\n")
    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, [
        "bench", "--oracle", str(oracle), "--draft", str(draft), "--workload", str(wl), "--systems", "k2,lcp-lookup",
        "--temperature", "0.7", "--reps", "1", "--threads", "1", "--ctx", "512", "--json", str(out),
        "--markdown", str(tmp_path / "RESULTS.md")])
    assert result.exit_code == 0, result.output
    rep = json.loads(out.read_text())
    assert rep["config"]["temperature"] == 0.7
    status = {s["name"]: s for s in rep["systems"]}
    assert status["k2"]["status"] == "ok" and status["lcp-lookup"]["status"] == "skipped"
    assert "greedy" in status["lcp-lookup"]["reason"]
    assert {r["system"] for r in rep["runs"]} == {"baseline", "k2"}
    assert all(r.get("match") is None for r in rep["runs"])
    assert "sampled at temperature 0.7" in (tmp_path / "RESULTS.md").read_text()
    k2 = next(spec for spec in parse_systems(["k2"]) if spec.name == "k2")
    prompt, models = BenchPrompt(workload="tiny", id="t1", max_tokens=8, prompt="hi"), {"oracle": "o", "draft": "d"}
    cmd = one_shot_command(k2, prompt, models, 1, 4096, temperature=0.7)
    assert cmd[cmd.index("--temperature") + 1] == "0.7"
    assert "--temperature" not in one_shot_command(k2, prompt, models, 1, 4096)


@pytest.mark.model
def test_bench_on_the_cross_tokenizer_pair(tmp_path, registry):
    """The pair's cross_tokenizer setting reaches the engine: without it, the draft would not load."""
    from click.testing import CliRunner

    from localspec.cli.commands import main

    wl = tmp_path / "tiny.jsonl"
    wl.write_text(json.dumps({"id": "t1", "prompt": "The capital of France is", "max_tokens": 6}) + "\n")
    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, [
        "bench", "--pair", "gemma3-270m-smollm2", "--workload", str(wl), "--systems", "k2", "--reps", "1",
        "--threads", "1", "--ctx", "512", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rep = json.loads(out.read_text())
    assert rep["config"]["cross_tokenizer"] is True
    status = {s["name"]: s for s in rep["systems"]}
    assert status["k2"]["status"] == "ok", status["k2"]
    assert status["k2"]["info"]["proposer"] == "CrossTokenizerProposer"
    assert all(r["completion_tokens"] > 0 and r["match"] is not None for r in rep["runs"])


@pytest.mark.model
def test_real_anchor_if_built(pair_paths):
    """The real llama-speculative-simple, when scripts/build_llama_anchor.sh has built it (never required)."""
    try:
        binary = anchor.find_binary("llama-speculative-simple")
    except anchor.AnchorUnavailable as e:
        pytest.skip(str(e))
    oracle, draft = pair_paths
    prompt = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
    r = anchor.run(binary, oracle=str(oracle), draft=str(draft), prompt_text=prompt, prompt_echo=prompt,
                   n_predict=12, k=4, threads=1, n_ctx=512)
    assert r["completion_tokens"] > 0 and r["tokens_per_second"] > 0 and r["n_drafted"] is not None
    assert r["text"].strip() and not r["text"].startswith("<|im_start|>")

    lookup = anchor.run(binary, oracle=str(oracle), draft=None, prompt_text=prompt, prompt_echo=prompt,
                        n_predict=12, k=None, threads=1, n_ctx=512, spec_type="ngram-simple")
    assert lookup["completion_tokens"] > 0 and lookup["text"].strip()


def test_repricing_compares_runs_by_the_steps_they_took_not_by_the_machines_speed_at_the_time():
    """Two runs of the same steps, one on a machine 1.5x slower (every pass), reprice alike; a run
    whose drafts were accepted more reprices higher, though its machine was slower too."""
    import copy

    same = _synthetic_report()
    slow = copy.deepcopy(same)
    better = copy.deepcopy(same)
    for rep in (slow, better):
        for r in rep["runs"]:
            r["records"] = [x[:3] + [x[3] * 1.5, x[4] * 1.5] + x[5:] for x in r["records"]]
    for r in better["runs"]:
        if r["system"] == "k4":  # every draft wholly accepted: 20 steps of 5 tokens
            r["records"] = [x[:2] + [x[1]] + x[3:] for x in r["records"]][:21]
    table = report.repriced({"same": same, "slow": slow, "better": better})
    assert table[("same", "chat", "k4")] == pytest.approx(table[("slow", "chat", "k4")])
    assert table[("better", "chat", "k4")] > 1.2 * table[("same", "chat", "k4")]
    assert table[("same", "chat", "baseline")] == pytest.approx(1.0, rel=0.02)
    assert ("same", "chat", "llama.cpp") not in table


def test_the_reprice_script_prints_a_table_of_two_reports(tmp_path):
    import subprocess

    paths = []
    for label in ("before", "after"):
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(_synthetic_report()))
        paths.append(str(path))
    script = Path(__file__).resolve().parent.parent / "scripts" / "reprice_bench.py"
    out = subprocess.run([sys.executable, str(script), *paths], capture_output=True, text=True, check=True).stdout
    assert "| workload | system | before | after |" in out and "| chat | k4 |" in out


def test_lookup_priors_counts_each_guess_by_the_match_it_extends(tmp_path):
    """scripts/lookup_priors.py on kept answers (no model): an answer that copies its prompt is right
    at every guess; one that departs from it is wrong where it departs."""
    import subprocess

    source = list(range(100, 140))
    texts = {"copy-x": {"workload": "copy", "prompt": source + [7], "out": source[:30]},
             "chat-x": {"workload": "chat", "prompt": source + [7], "out": source[:3] + [9, 9, 9]}}
    kept = tmp_path / "answers.json"
    kept.write_text(json.dumps(texts))
    script = Path(__file__).resolve().parent.parent / "scripts" / "lookup_priors.py"
    out = subprocess.run([sys.executable, str(script), "--json", str(kept)], capture_output=True, text=True,
                         check=True).stdout
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert "0%" not in rows["copy"].replace("100%", "") and "100% (" in rows["copy"]  # every guess held
    assert " 0% (" in rows["chat"]  # the guess after "100 101 102" says 103 where the answer says 9


def test_fixed_lengths_with_prompt_lookup_are_systems_and_the_headline_sets_adaptive_against_the_best_fixed_k():
    spec = systems.parse_system("k8+lookup")
    assert spec.params == {"draft": "model", "draft_length": 8, "lookup": True} and spec.uses_draft_model
    assert {"k4+lookup", "k8+lookup", "k16+lookup"} <= set(systems.DEFAULT_SYSTEMS)
    rep = _synthetic_report()
    rep["systems"] += [{"name": n, "kind": "localspec", "params": {"draft": "model"}} for n in ("k8+lookup", "adaptive")]
    for rep_i in range(3):
        for pid, base_tps in (("p1", 50.0), ("p2", 40.0)):
            for name, factor in (("k8+lookup", 2.5), ("adaptive", 2.25)):
                rep["runs"].append({"system": name, "workload": "chat", "prompt_id": pid, "rep": rep_i,
                                    "completion_tokens": 100, "tokens_per_second": factor * (base_tps + rep_i),
                                    "ttft": None, "drafted": 100, "accepted": 75, "steps": 25, "latencies": [],
                                    "prompt_tokens": 100})
    rep["results"] = report.aggregate(rep)
    line = report.headline(rep)[0]
    assert "2.25x the oracle alone, 0.90x the best fixed K" in line and "best fixed K: k8+lookup 2.50x" in line


def test_the_report_weighs_host_time_per_token_by_tokens():
    rep = _synthetic_report()
    for r in rep["runs"]:
        if r["system"] == "k4":
            r["host_ms_per_token"] = 1.0 if r["prompt_id"] == "p1" else 4.0
            r["completion_tokens"] = 100 if r["prompt_id"] == "p1" else 300
    rows = {(r["system"], r["workload"]): r for r in report.aggregate(rep)}
    assert rows[("k4", "chat")]["host_ms_per_token"] == pytest.approx((100 + 4 * 300) / 400)
    assert rows[("baseline", "chat")]["host_ms_per_token"] is None


# ---------------------------------------------------------------------------------------- the report, pinned

GOLDEN = Path(__file__).resolve().parent / "data" / "bench_report"


def _full_report():
    """A hand-made run that reaches every part of the report: two workloads (so "all" rows), a
    drafting system with paired, one-shot and host-time figures, an adaptive system, a C++ anchor
    (its ceiling from localspec's costs), a skipped system, notes, and the machine and setup."""
    rep = _synthetic_report()
    rep["systems"][2] = {"name": "llama.cpp-k4", "kind": "llama.cpp", "params": {"k": 4},
                         "description": "llama.cpp's speculative decoding, K=4", "status": "ok", "peak_rss": 3 * 2**28}
    rep["systems"][0]["description"] = "the oracle alone"
    rep["systems"][1]["description"] = "a draft model, K=4"
    rep["systems"] += [{"name": "adaptive", "kind": "localspec", "params": {"draft": "model"},
                        "description": "the length policy", "status": "ok", "peak_rss": 2**30 + 2**20},
                       {"name": "lookup", "kind": "localspec", "params": {"draft": "ngram"},
                        "description": "prompt lookup", "status": "skipped", "reason": "failed on p1: boom"}]
    for r in rep["runs"]:
        r["ttft"] = (0.1 if r["prompt_id"] == "p1" else 0.3) * (1.0 if r["system"] == "baseline" else 1.2)
        r["one_shot_wall"] = (5.0 if r["system"] == "baseline" else 4.0) + 0.1 * r["rep"]
        r["host_ms_per_token"] = 0.5 + 0.1 * r["rep"]
        if r["system"] == "k4":
            r["paired_tokens_per_second"] = r["tokens_per_second"] / (1.8 + 0.05 * r["rep"])
            r["paired_records"] = [[0, 0, 0, 0.0, 1.1 * verify_cost(1), 100 + i, 0] for i in range(20)]
    for rep_i in range(3):
        for workload, pid, base_tps in (("chat", "p1", 50.0), ("chat", "p2", 40.0), ("code", "c1", 30.0)):
            if workload == "code":
                rep["runs"].append({"system": "baseline", "workload": workload, "prompt_id": pid, "rep": rep_i,
                                    "completion_tokens": 80, "tokens_per_second": base_tps + rep_i, "ttft": 0.2,
                                    "drafted": 0, "accepted": 0, "steps": 80, "latencies": [0.03] * 79,
                                    "prompt_tokens": 200, "match": 1.0, "one_shot_wall": 6.0,
                                    "records": [[0, 0, 0, 0.0, verify_cost(1), 200 + i, 0] for i in range(80)]})
                rep["runs"].append({"system": "k4", "workload": workload, "prompt_id": pid, "rep": rep_i,
                                    "completion_tokens": 80, "tokens_per_second": 2.5 * (base_tps + rep_i),
                                    "ttft": 0.25, "drafted": 80, "accepted": 70, "steps": 20,
                                    "latencies": [0.012] * 79, "prompt_tokens": 200, "match": 1.0,
                                    "records": _k4_records(200)[:21], "one_shot_wall": 3.5 + 0.2 * rep_i})
            rep["runs"].append({"system": "adaptive", "workload": workload, "prompt_id": pid, "rep": rep_i,
                                "completion_tokens": 90, "tokens_per_second": 2.2 * (base_tps + rep_i),
                                "ttft": 0.12, "drafted": 60, "accepted": 50, "steps": 40, "latencies": [0.011] * 89,
                                "prompt_tokens": 100, "match": 0.9 if rep_i == 1 else 1.0,
                                "records": [[3, 3, 2, 0.003, verify_cost(4), 100 + 3 * i, 3] for i in range(40)],
                                "host_ms_per_token": 0.7})
            rep["runs"].append({"system": "llama.cpp-k4", "workload": workload, "prompt_id": pid, "rep": rep_i,
                                "completion_tokens": 100, "tokens_per_second": 1.7 * (base_tps + rep_i), "ttft": None,
                                "drafted": 100, "accepted": 60, "steps": 40, "latencies": [], "prompt_tokens": 100,
                                "match": 0.8, "one_shot_wall": 4.5, "peak_rss": 3 * 2**28})
    rep["config"] = {
        "pair": "smollm2-135m", "oracle": "smollm2-135m-f32", "draft": "smollm2-135m-q4", "cross_tokenizer": False,
        "oracle_path": "/cache/oracle.gguf", "draft_path": "/cache/draft.gguf", "threads": 2, "n_ctx": 4096,
        "reps": 3, "temperature": 0.0, "paired": True, "one_shot": True,
        "mixed_warmup": {"requests": 12, "max_tokens": 48, "temperatures": [1.0, 0.7]},
        "workloads": ["chat", "code"],
        "prompts": [{"workload": "chat", "id": "p1", "max_tokens": 100, "prompt_tokens": 100},
                    {"workload": "chat", "id": "p2", "max_tokens": 100, "prompt_tokens": 100},
                    {"workload": "code", "id": "c1", "max_tokens": 80, "prompt_tokens": 200}]}
    rep["machine"] = {"cpu": "AMD EPYC 7B13", "cpu_flags": ["avx", "avx2", "fma"], "llama_cpp_system_info": "CPU : AVX2 = 1",
                      "logical_cpus": 4, "physical_cores": 2, "threads": 2, "ram_bytes": 16 * 2**30 + 2**28,
                      "os": "Linux 6.1", "python": "3.11.9", "llama_cpp_python": "0.3.16", "localspec": "0.9.0",
                      "git_commit": "abc1234", "load_average_start": [1.0, 0.5, 0.25],
                      "load_average_end": [2.125, 1.0, 0.5]}
    rep.update(schema="localspec-bench/1", created="2025-01-02T03:04:05+00:00", elapsed_seconds=123.4,
               notes=["the C++ anchor's prompt text does not tokenize to exactly localspec's prompt tokens for: p2"])
    rep["results"] = report.aggregate(rep)
    return rep


def _rounded(x):
    """Floats to 10 significant digits: the pin holds what the report computes, not the last bits of
    a least-squares fit."""
    if isinstance(x, float):
        return float(f"{x:.10g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _golden_outputs():
    """(name, text) of every pinned output: the result rows (JSON), results documents with and without
    the optional parts, and the summary `localspec bench` prints."""
    full = report.clean(_full_report())
    plain = _synthetic_report()
    plain.update(machine={}, created="2025-01-02T03:04:05+00:00",
                 config={**plain["config"], "oracle": "o.gguf", "draft": None, "n_ctx": 512, "reps": 3,
                         "workloads": ["chat"]})
    for s in plain["systems"]:
        s["description"] = f"the {s['name']} system"
    plain["results"] = report.aggregate(plain)
    plain = report.clean(plain)
    charts = {"Speedup against acceptance": "speedup_vs_acceptance.png", "Tokens per second": "tokens_per_second.png"}
    return [("rows.json", json.dumps(_rounded(full["results"]), indent=1, ensure_ascii=False) + "\n"),
            ("RESULTS.md", results_document(full, charts, command="localspec bench --paired --one-shot")),
            ("RESULTS-plain.md", results_document(plain)),
            ("summary.txt", report.summary(full))]


@pytest.mark.parametrize("name", ["rows.json", "RESULTS.md", "RESULTS-plain.md", "summary.txt"])
def test_the_report_matches_its_pinned_output(name):
    """The result rows, the results document and the summary of a fixed, hand-made run, as committed
    in tests/data/bench_report/ (rewrite them with `python tests/test_bench.py --write-golden` when a
    change to the report is meant)."""
    text = dict(_golden_outputs())[name]
    assert text == (GOLDEN / name).read_text("utf-8")


if __name__ == "__main__" and sys.argv[1:] == ["--write-golden"]:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name, text in _golden_outputs():
        (GOLDEN / name).write_text(text, "utf-8")


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
physical id\t: 0
core id\t: 0
flags\t\t: fpu sse4_2 avx avx2 fma f16c

processor\t: 1
model name\t: AMD EPYC 7B13
physical id\t: 0
core id\t: 0
flags\t\t: fpu sse4_2 avx avx2 fma f16c

processor\t: 2
model name\t: AMD EPYC 7B13
physical id\t: 0
core id\t: 1
flags\t\t: fpu sse4_2 avx avx2 fma f16c
"""


def test_machine_info_reads_the_cpu_its_features_cores_and_memory(monkeypatch):
    """From /proc/cpuinfo (the flags llama.cpp cares about, in CPU_FLAGS' order; physical cores as
    distinct (physical id, core id) pairs, the last block without a blank line after it) and
    /proc/meminfo."""
    from localspec.bench import runner

    real = Path.read_text
    files = {"/proc/cpuinfo": CPUINFO, "/proc/meminfo": "MemTotal:       16384 kB\nMemFree:  1 kB\n"}
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: files[str(self)] if str(self) in files
                        else real(self, *a, **k))
    info = runner.machine_info(3)
    assert info["cpu"] == "AMD EPYC 7B13" and info["cpu_flags"] == ["sse4_2", "avx", "avx2", "fma", "f16c"]
    assert info["physical_cores"] == 2 and info["ram_bytes"] == 16384 * 1024 and info["threads"] == 3
    assert list(info) == ["cpu", "cpu_flags", "llama_cpp_system_info", "logical_cpus", "physical_cores", "threads",
                          "ram_bytes", "os", "python", "llama_cpp_python", "localspec", "git_commit",
                          "load_average_start"]

    def missing(self, *a, **k):
        if str(self).startswith("/proc/"):
            raise OSError("no /proc here")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", missing)
    info = runner.machine_info(1)
    assert info["cpu_flags"] == [] and info["physical_cores"] is None and info["ram_bytes"] > 0
