"""The documentation a user finds their way in: every link resolves, and
every setting and command-line flag is documented."""

import pathlib
import re
import subprocess
import sys

import pytest

from jaxps._src import config

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"] + sorted(
    (ROOT / "docs").glob("*.md")
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    fence, found = False, set()
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            found.add(_slug(line.lstrip("#")))
    return found


def _docs_text() -> str:
    return "\n".join(p.read_text() for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, broken


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in "\n".join(lines), page.name


def test_every_setting_is_documented():
    settings = (ROOT / "docs" / "settings.md").read_text()
    missing = [v for v in config.ENV.values() if f"`{v}`" not in settings]
    assert not missing, missing


@pytest.mark.parametrize(
    "command",
    [["-m", "jaxps.servers"], ["-m", "jaxps._src.launch"]],
    ids=["jaxps-server", "jaxps-launch"],
)
def test_every_flag_is_documented(command):
    usage = subprocess.run(
        [sys.executable, *command, "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    # the flags of the usage lines: "[--flag ...]" (not the examples')
    flags = set(re.findall(r"\[(--[a-z][a-z-]*[a-z])", usage))
    text = _docs_text()
    missing = sorted(f for f in flags if not re.search(rf"{f}(?![\w-])", text))
    assert not missing, missing
