"""Every link of the README and the docs leads somewhere: a file of this
repository (and, for a Markdown file, a heading of it) or a public URL."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def _slug(heading):
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _prose(path):
    """(line number, line) of ``path`` outside fenced code blocks."""
    code = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            code = not code
        elif not code:
            yield number, line


def _anchors(path):
    return {_slug(line.lstrip("#")) for _, line in _prose(path) if re.match(r"#{1,6} ", line)}


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "tutorials").rglob("*.md"))]


def test_every_link_resolves():
    broken = []
    for page in _pages():
        for number, line in _prose(page):
            for _, target in LINK.findall(line):
                if re.match(r"[a-z]+://", target):
                    continue
                path, _, anchor = target.partition("#")
                full = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(ROOT)}:{number}: {target}"
                if not full.exists() or ROOT not in full.parents and full != ROOT:
                    broken.append(where + " (no such file in the repository)")
                elif anchor and full.suffix == ".md" and anchor not in _anchors(full):
                    broken.append(where + " (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_door():
    """The README stays short; the rest is in docs/, listed by docs/index.md."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    index = (ROOT / "docs" / "index.md").read_text()
    for guide in sorted((ROOT / "docs" / "guide").glob("*.md")):
        assert f"(guide/{guide.name})" in index, f"docs/index.md does not list {guide.name}"
