"""The documentation's links hold: every relative link of README.md and docs/*.md names a file that
exists, every `#anchor` (`#a` in the same file, `page.md#a` in another) names a heading of its target
as GitHub renders it, and README.md links every page of docs/. Links to http(s) and mailto are not
followed. Code blocks and inline code are not prose: links and headings there do not count.
"""
from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks and HTML comments."""
    text = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text (code spans and links reduced to their
    text), lower-cased, every character but letters, digits, `_`, `-` and spaces dropped, spaces -> `-`."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = LINK.sub(lambda m: m.group(1), text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in `path`; a repeated one gets -1, -2, ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in `path`'s prose."""
    out = []
    for n, line in prose_lines(path.read_text()):
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            out.append((n, m.group(2)))
    return out


def dead_links(path: Path) -> list[str]:
    dead = []
    for n, target in links(path):
        if re.match(r"^(https?:|mailto:)", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            dead.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    return dead


def test_the_links_are_read():
    """The reader finds links and anchors (a change of syntax must not make the tests below vacuous)."""
    readme = ROOT / "README.md"
    assert any(t.startswith("docs/") for _, t in links(readme))
    assert "two-commands-on-a-fresh-machine" in anchors(readme)
    assert slug("Before launching: `python -m rlhf.plan` and `python -m rlhf.env`") == \
        "before-launching-python--m-rlhfplan-and-python--m-rlhfenv"
    assert slug("DPO (offline preference optimisation)") == "dpo-offline-preference-optimisation"


def test_every_relative_link_and_anchor_resolves():
    dead = [d for path in doc_files() for d in dead_links(path)]
    assert not dead, "dead links in the documentation:\n" + "\n".join(dead)


def test_readme_links_every_docs_page():
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for _, t in links(readme) if not t.startswith("#")}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "no docs/*.md pages"
    missing = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked]
    assert not missing, "docs pages README.md does not link:\n" + "\n".join(missing)
