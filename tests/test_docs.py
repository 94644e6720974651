"""The documentation: the README is a front door, docs/ builds into a site with `mkdocs build --strict`
(a broken link, anchor or page fails it), and the reference pages cover what the program accepts:
every CLI command, flag and environment variable, every server request field, metric and error
code. No model is needed."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import click
import pytest
import yaml
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 220


def page(name: str) -> str:
    return (DOCS / name).read_text("utf-8")


def sections(markdown: str) -> dict[str, str]:
    """Heading text (without its #s) -> the text below it, up to the next heading of any level."""
    out: dict[str, str] = {}
    heading, body = "", []
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6} (.+?)\s*$", line)
        if m:
            out[heading] = "\n".join(body)
            heading, body = m.group(1), []
        else:
            body.append(line)
    out[heading] = "\n".join(body)
    return out


def table_names(text: str, column: int = 0) -> set[str]:
    """The names in one cell (the first by default) of every table row: its `code` spans."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-:| ]+\|$", line):
            cells = line.split("|")[1:-1]
            if column < len(cells):
                names.update(re.findall(r"`([^`]+)`", cells[column]))
    return names


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


# ---------------------------------------------------------------- the site


def test_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: every page in the nav exists, every link and anchor resolves, the
    docstrings of the Python API render."""
    built = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    for name in ("index.html", "cli/index.html", "server/index.html", "policy/index.html",
                 "benchmarks/RESULTS/index.html"):
        assert (tmp_path / "site" / name).is_file(), name
    api = (tmp_path / "site" / "python-api" / "index.html").read_text("utf-8")
    for name in ("localspec.runtime.engine.Engine", "localspec.options.GenerationOptions", "localspec.outputs.Stats"):
        assert f'id="{name}"' in api, f"the API page lacks {name}'s docstring"


def test_strict_build_fails_on_broken_links(tmp_path):
    """The same configuration over a copy of docs/ with a missing page, a missing anchor and a link
    out of docs/ to a file the site does not carry: the build fails, naming each of them."""
    docs = tmp_path / "docs"
    for path in DOCS.rglob("*"):
        if path.is_file():
            (docs / path.relative_to(DOCS)).parent.mkdir(parents=True, exist_ok=True)
            (docs / path.relative_to(DOCS)).write_bytes(path.read_bytes())
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    broken = docs / "troubleshooting.md"
    broken.write_text(broken.read_text("utf-8") + "\n[gone](no-such-page.md) [anchor](server.md#no-such-anchor) "
                      "[out](../localspec/options.py)\n", "utf-8")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text("utf-8"))
    config["docs_dir"] = str(docs)
    config["hooks"] = [str(ROOT / h) for h in config["hooks"]]
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            plugin["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config), "utf-8")
    built = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = built.stdout + built.stderr
    assert built.returncode != 0, output
    warnings = [line for line in output.splitlines() if line.startswith("WARNING")]
    for needle in ("no-such-page.md", "no-such-anchor", "../localspec/options.py"):
        assert any(needle in line for line in warnings), f"no warning for {needle}:\n{output}"


def test_every_page_is_in_the_nav():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text("utf-8"))["nav"]

    def pages(node: Any):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from pages(value)

    listed = set(pages(nav))
    assert {p.name for p in DOCS.glob("*.md")} <= listed


# ---------------------------------------------------------------- the README


def test_readme_is_a_front_door():
    text = README.read_text("utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    for heading in ("Two commands", "Measured", "Chat", "Serve", "Batch", "Where to go next", "Tests"):
        assert f"\n## {heading}\n" in text, heading
    assert "AMD EPYC" in text and "benchmarks/RESULTS.md" in text  # the table names its machine and links the rest


def test_readme_test_command_is_the_ci_command():
    """.ci/run runs exactly the README's test command."""
    ci = (ROOT / ".ci" / "run").read_text("utf-8").strip().splitlines()[-1]
    assert "pytest" in ci
    assert f"\n{ci}\n" in README.read_text("utf-8")


def test_readme_links_resolve():
    text = README.read_text("utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(t.startswith("docs/") for t in targets)
    for target in targets:
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), target
        if anchor and path.endswith(".md"):
            slugs = {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower())
                     for h in sections((ROOT / path).read_text("utf-8"))}
            assert anchor in slugs, target


# ---------------------------------------------------------------- the CLI reference


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current():
    """docs/cli.md's generated part is what scripts/cli_reference.py writes from the click program."""
    ref = _load_script("cli_reference")
    current = (DOCS / "cli.md").read_text("utf-8")
    assert ref.updated_page(current, ref.render()) == current, "run: python scripts/cli_reference.py"


def test_every_cli_flag_is_documented():
    """Every command of `localspec`, and each of its options' flags, default and environment
    variable, has its entry under the command's heading in docs/cli.md."""
    from localspec.cli.commands import main

    ref = _load_script("cli_reference")
    by_heading = sections(page("cli.md"))
    seen = 0
    for path, command in ref.walk(main):
        heading = " ".join(path)
        assert heading in by_heading, f"docs/cli.md has no section for {heading}"
        section = by_heading[heading]
        documented = table_names(section)
        for param in command.params:
            if isinstance(param, click.Argument):
                assert ref.metavar(param, command) in section, (heading, param.name)
                continue
            if param.hidden:
                continue
            for flag in [*param.opts, *param.secondary_opts]:
                assert flag in documented, f"{heading}: {flag} is not documented"
                seen += 1
            row = next(line for line in section.splitlines()
                       if line.startswith("|") and f"`{param.opts[0]}`" in line.split("|")[1])
            for env in ref._envvars(param):
                assert env in row, f"{heading} {param.opts[0]}: environment variable {env} not documented"
            default = ref.default_of(param)
            if default is not None and not param.is_flag:
                assert f"`{default}`" in row, f"{heading} {param.opts[0]}: default {default!r}"
    assert seen > 50


def test_every_environment_variable_is_documented():
    """Every LOCALSPEC_* / HF_* variable the package or its scripts read is in the CLI reference."""
    names: set[str] = set()
    for path in (ROOT / "localspec").rglob("*.py"):
        names.update(re.findall(r"\"((?:LOCALSPEC|HF)_[A-Z_]+|XDG_CACHE_HOME)\"", path.read_text("utf-8")))
    for path in (ROOT / "scripts").glob("*.sh"):
        names.update(re.findall(r"\$\{?(LOCALSPEC_[A-Z_]+)", path.read_text("utf-8")))
    assert {"LOCALSPEC_CACHE", "LOCALSPEC_API_KEY", "HF_ENDPOINT"} <= names
    documented = table_names(sections(page("cli.md"))["Environment variables"])
    assert names <= documented, sorted(names - documented)


# ---------------------------------------------------------------- the server reference

# every request model -> the heading of its field table in docs/server.md
REQUEST_SECTIONS = {
    "_Common": "Fields of both endpoints",
    "ChatCompletionRequest": "Chat completions fields",
    "CompletionRequest": "Completions fields",
    "ChatMessage": "Messages",
    "ContentPart": "Messages",
    "Speculative": "The `speculative` object",
    "StreamOptions": "`stream_options`",
}
RESPONSE_SECTIONS = {
    "Usage": "`usage`",
    "PromptTokensDetails": "`usage`",
    "SpeculationReport": "Token sources",
    "ReplyFigures": "Token sources",
}


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _declared(model: type[BaseModel]) -> dict[str, set[str]]:
    """Class name -> the wire names of the fields it declares itself, for `model` and every
    model it inherits from or holds (recursively), within localspec's schemas."""
    out: dict[str, set[str]] = {}
    todo = [model]
    while todo:
        cls = todo.pop()
        for klass in cls.__mro__:
            if not (isinstance(klass, type) and issubclass(klass, BaseModel)) or klass is BaseModel \
                    or klass.__name__ in out or not klass.__module__.startswith("localspec."):
                continue
            own = set(klass.__dict__.get("__annotations__", {}))
            out[klass.__name__] = {klass.model_fields[name].alias or name for name in own if name in klass.model_fields}
            for name in own:
                if name in klass.model_fields:
                    todo.extend(_models_in(klass.model_fields[name].annotation))
    return out


@pytest.mark.parametrize("roots,where", [
    (("ChatCompletionRequest", "CompletionRequest"), REQUEST_SECTIONS),
    (("ChatCompletion", "ChatCompletionChunk", "Completion"), RESPONSE_SECTIONS),
])
def test_every_server_field_is_documented(roots, where):
    """Every field of every request model (and of the responses' localspec additions) has a row in
    the table of its section of docs/server.md, and a strict model's table has no row that is not
    a field."""
    from localspec.server import schemas

    declared: dict[str, set[str]] = {}
    for root in roots:
        declared.update(_declared(getattr(schemas, root)))
    by_heading = sections(page("server.md"))
    checked = 0
    for name, fields in declared.items():
        if where is RESPONSE_SECTIONS and name not in where:
            continue  # OpenAI's own response shapes: documented by OpenAI
        if not fields:
            continue  # a base holding rules, no fields of its own (schemas._Body)
        assert name in where, f"schemas.{name} is a request model: give it a section in docs/server.md"
        documented = table_names(by_heading[where[name]])
        assert fields <= documented, f"{where[name]}: {sorted(fields - documented)} not documented"
        checked += len(fields)
    if where is REQUEST_SECTIONS:
        assert {"speculative.n_max", "draft_max", "sources", "messages", "prompt"} <= set().union(*declared.values())
        for heading in set(where.values()):
            models = [getattr(schemas, n) for n, h in where.items() if h == heading]
            if all(m.model_config.get("extra") == "forbid" for m in models):
                fields = set().union(*(declared[m.__name__] for m in models))
                stale = table_names(by_heading[heading]) - fields
                assert not stale, f"{heading}: {sorted(stale)} are not fields of the API"
    assert checked > 10


def test_every_metric_is_documented():
    from localspec.server.metrics import Metrics

    documented = {re.sub(r"\{.*\}", "", n) for n in table_names(sections(page("server.md"))["Metrics"])}
    families = list(Metrics().registry.collect())
    assert len(families) > 15
    for family in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        assert name in documented, f"/metrics: {name} is not documented"


def test_every_error_code_is_documented():
    source = "\n".join(p.read_text("utf-8") for p in (ROOT / "localspec" / "server").glob("*.py"))
    string = r'f?"(?:[^"\\]|\\.)*"'
    codes = set(re.findall(r"code(?::\s*str)?\s*=\s*\"([a-z_]+)\"", source))  # code="...", and InvalidParam's default
    codes |= set(re.findall(r"code\s*=\s*\"[a-z_]+\"\s+if [^\n]*? else \"([a-z_]+)\"", source))  # code = "..." if ... else "..."
    codes |= set(re.findall(rf"InvalidParam\(\s*{string},\s*(?:{string}|\w+),\s*\"([a-z_]+)\"\)", source))
    assert {"invalid_json", "context_length_exceeded", "unsupported_parameter", "host_not_allowed"} <= codes
    documented = table_names(sections(page("server.md"))["Errors"], column=1)
    assert codes <= documented, sorted(codes - documented)


# ---------------------------------------------------------------- troubleshooting, docstrings


def test_troubleshooting_quotes_real_messages():
    """Each `quoted` part of a heading in docs/troubleshooting.md is text the program really prints."""
    source = "\n".join(p.read_text("utf-8") for p in (ROOT / "localspec").rglob("*.py"))
    quoted = [q for heading in sections(page("troubleshooting.md")) for q in re.findall(r"`([^`]+)`", heading)]
    assert len(quoted) > 30
    missing = [q for q in quoted if q not in source]
    assert not missing, f"not found in localspec/: {missing}"


def test_policy_docstring_is_a_contract():
    """Issue 39: policy.py's module docstring states the contract in at most 15 lines; the
    reasoning and its figures live in docs/policy.md."""
    tree = ast.parse((ROOT / "localspec" / "speculative" / "policy.py").read_text("utf-8"))
    docstring = ast.get_docstring(tree, clean=False)
    assert docstring and len(docstring.strip().splitlines()) <= 15
    assert "docs/policy.md" in docstring
    text = page("policy.md")
    for figure in ("62-84% against 95-100%", "1.06-1.09x", "~70 ms", "AVX2/FMA/F16C"):
        assert figure in text, figure


def test_cli_reference_script_check_mode(tmp_path, monkeypatch):
    """`python scripts/cli_reference.py --check` exits 1 on a stale page, 0 on a current one."""
    ref = _load_script("cli_reference")
    stale = tmp_path / "cli.md"
    stale.write_text(f"# CLI\n\n{ref.BEGIN}\nold\n{ref.END}\n", "utf-8")
    monkeypatch.setattr(ref, "CLI_PAGE", stale)
    assert ref.main_(["--check"]) == 1
    assert ref.main_([]) == 0
    assert ref.main_(["--check"]) == 0
    assert "### localspec serve" in stale.read_text("utf-8")
