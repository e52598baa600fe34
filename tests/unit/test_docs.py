"""The README, docs/ and tests/README.md as a new user reads them: the minimal spec the README
shows is specs/minimal.yaml, word for word, and compiles; every relative link resolves to a
file, every repository path they name (`tests/...py`, `runtime/step.py`) exists, and
tests/README.md says where every module of the package is tested."""
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MINIMAL = REPO / "specs" / "minimal.yaml"
PAGES = [REPO / "README.md", REPO / "tests" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_PATH = re.compile(r"([\w.-]+/)+[\w.-]+\.(py|yaml|md|csv|json)")
_OUT_PATHS = ("checkpoint/manifest.json",)  # inside a compiled program's OUT/, as OUT/...


def _yaml_blocks(text: str) -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", text, re.M | re.S)


def test_readme_shows_the_minimal_spec_verbatim():
    assert MINIMAL.read_text() in _yaml_blocks((REPO / "README.md").read_text())


@pytest.mark.timeout(300)
def test_readme_minimal_spec_compiles(tools, tmp_path):
    out = tmp_path / "pz-llama"
    res = tools.parallelize(tools.examples / "llama" / "model.py", MINIMAL, out)
    assert res.code == 0, res.explain()
    plan = json.loads((out / "plan.json").read_text())
    assert plan["mesh"] == {"dp": 1, "tp": 2, "pp": 2}, plan["mesh"]
    assert (out / "run.py").is_file() and (out / "checkpoint" / "manifest.json").is_file()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert broken == [], f"{page.relative_to(REPO)}: links to missing files: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_paths_named_in_code_spans_exist(page):
    """A path in backticks is relative to the repository, to parallelizer/ (the decision
    records' `runtime/step.py`) or to the page's folder (tests/README.md's `unit/...`);
    OUT/... names a compiled program's files."""
    missing = []
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # fenced blocks out
    for span in re.findall(r"`([^`]+)`", prose):
        for word in re.split(r"[\s,()]+", span):
            if not _PATH.fullmatch(word) or word.startswith("OUT/") or word in _OUT_PATHS:
                continue
            if not any((base / word).exists() for base in (REPO, REPO / "parallelizer", page.parent)):
                missing.append(word)
    assert missing == [], f"{page.relative_to(REPO)} names paths that do not exist: {missing}"


def test_tests_readme_names_every_module():
    """tests/README.md's map: each module by its path under parallelizer/ (a module of a
    subpackage may be named beside the subpackage's folder)."""
    text = (REPO / "tests" / "README.md").read_text()
    root = REPO / "parallelizer"
    missing = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.name in ("__init__.py", "__main__.py"):
            continue
        folder = f"`{rel.parent}/`" if rel.parent != Path(".") else None
        if f"`{rel}`" not in text and not (folder and folder in text and f"`{rel.name}`" in text):
            missing.append(str(rel))
    assert missing == [], f"tests/README.md does not say where these are tested: {missing}"
