"""MkDocs hooks (mkdocs.yml `hooks:`): the measured results under benchmarks/ become pages of the site.

The pages in docs/ link to the results the way the repository host reads them, relative to the
file: `../benchmarks/RESULTS.md`. MkDocs knows only docs/, so here

* every Markdown file and image under benchmarks/ is added to the site at the same path
  (benchmarks/RESULTS.md, benchmarks/rpc/RESULTS.md, ...), built and link-checked like any page;
* a link from a page in docs/ that leaves docs/ is pointed at that copy when it targets one of
  those files, and is an error otherwise (a warning, which `mkdocs build --strict` fails on): a
  page may only link inside docs/ or to benchmarks/.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.localspec")

INCLUDED = "benchmarks"  # the folder beside docs/ whose pages and images the site carries
SUFFIXES = (".md", ".png", ".svg")
# an inline Markdown link or image: [text](target) / ![alt](target), the target without spaces
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^(```|~~~)")


def _root(config) -> Path:
    return Path(config["docs_dir"]).resolve().parent


def on_files(files: Files, config, **kwargs) -> Files:
    root = _root(config)
    for path in sorted((root / INCLUDED).rglob("*")):
        if path.is_file() and path.suffix in SUFFIXES:
            uri = path.relative_to(root).as_posix()
            if files.get_file_from_path(uri) is not None:
                log.warning("docs/%s hides %s: rename one of them", uri, uri)
                continue
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def _rewrite(target: str, page_uri: str, root: Path) -> str:
    """A link target of the page at docs/`page_uri`, as the site needs it."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")):
        return target  # a URL, an anchor on the page, an absolute path (MkDocs checks those)
    path, hash_, anchor = target.partition("#")
    in_repo = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), path))
    if in_repo.startswith("docs/"):
        return target  # inside docs/: MkDocs checks it
    if not (in_repo.startswith(INCLUDED + "/") and (root / in_repo).is_file()
            and (root / in_repo).suffix in SUFFIXES):
        log.warning("docs/%s links to %s, outside docs/: link a page in docs/ or a results file in %s/ instead",
                    page_uri, target, INCLUDED)
        return target
    return posixpath.relpath(in_repo, posixpath.dirname(page_uri) or ".") + hash_ + anchor


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if page.file.generated_by is not None:
        return markdown  # a copied results page: its links are relative to its own folder already
    root = _root(config)
    out, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        if not fenced:
            line = LINK.sub(lambda m: m.group(1) + _rewrite(m.group(2), page.file.src_uri, root) + m.group(3), line)
        out.append(line)
    return "\n".join(out)
