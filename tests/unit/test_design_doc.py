"""Code that cites docs/design.md names sections that exist there (the notes live in the repo)."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
CITATION = re.compile(r'docs/design\.md,? "([^"]+)"')
BENCHMARKS_CITATION = re.compile(r'BENCHMARKS\.md,? "([^"]+)"')
SOURCES = ("megatron_ext/**/*.py", "tools/*.py", "tools/*.sh", "tests/**/*.py", "examples/*")
LINE_BREAK = re.compile(r"[ \t]*\n[ \t]*(?:#+[ \t]*)?")  # a citation may wrap, also inside a comment


def _flat(path: pathlib.Path) -> str:
    """The file's text with line breaks (and a wrapped comment's leading #) read as one space."""
    return LINE_BREAK.sub(" ", path.read_text())


def test_every_cited_design_section_exists():
    headings = {line[3:].strip() for line in (REPO / "docs" / "design.md").read_text().splitlines()
                if line.startswith("## ")}
    cited = {}
    for path in [*REPO.glob("megatron_ext/**/*.py"), *REPO.glob("tools/*.py"), *REPO.glob("tests/**/*.py"),
                 REPO / "BENCHMARKS.md", REPO / "README.md"]:
        for name in CITATION.findall(_flat(path)):
            cited.setdefault(name, path.relative_to(REPO))
    assert len(cited) >= 6, f"expected the code to cite the design notes, found {sorted(cited)}"
    missing = {name: str(path) for name, path in cited.items() if name not in headings}
    assert not missing, f"cited sections missing from docs/design.md: {missing}; headings: {sorted(headings)}"


def test_no_citation_of_a_design_file_outside_the_repo():
    offenders = [str(p.relative_to(REPO)) for p in [*REPO.glob("megatron_ext/**/*.py"), *REPO.glob("tools/*.py")]
                 if re.search(r"\bDESIGN(\.md)?\b", p.read_text())]
    assert not offenders, f"cite docs/design.md instead of DESIGN.md in: {offenders}"


def _sources():
    return [p for pattern in SOURCES for p in REPO.glob(pattern) if p.is_file()]


def test_no_path_outside_the_repo_is_cited():
    outside = re.compile(r"\.\./shared|KINDS\.md")
    offenders = [str(p.relative_to(REPO)) for p in [*_sources(), REPO / "README.md", REPO / "BENCHMARKS.md"]
                 if outside.search(p.read_text())]
    assert not offenders, f"these cite files outside the repository: {offenders}"


def test_every_cited_benchmarks_section_exists():
    text = (REPO / "BENCHMARKS.md").read_text()
    headings = {line[3:].strip() for line in text.splitlines() if line.startswith("## ")}
    leads = re.findall(r"\*\*([^*]+)\*\*", text)  # a bold paragraph lead names a part of a section too
    cited = {name: str(p.relative_to(REPO)) for p in [*_sources(), REPO / "README.md", REPO / "docs" / "design.md"]
             for name in BENCHMARKS_CITATION.findall(_flat(p))}
    assert cited, "expected the code to cite BENCHMARKS.md sections"
    missing = {name: path for name, path in cited.items()
               if name not in headings and not any(h.startswith(name + " (") for h in headings)  # date left out
               and not any(lead.startswith(name) for lead in leads)}
    assert not missing, f"cited sections missing from BENCHMARKS.md: {missing}"
