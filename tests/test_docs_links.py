"""The repository stands on its own: no file cites a text outside it, and every relative
link in its Markdown resolves.

- No tracked file names the old design texts that lived beside the repository (their
  names are built below, so this file does not name them either): a user of a clone
  cannot follow such a citation. Point to docs/reference.md or the doc that says it.
- Every relative Markdown link (`[text](path)`, `[text](path#anchor)`, `[text](#anchor)`)
  in every tracked `*.md` file, outside fenced code, names a tracked file or folder, and
  its anchor names a heading of the target (GitHub's anchor rule).
- Every repository path cited anywhere in a tracked text file (code docstrings and
  comments, configs, scripts, docs: a path that starts with one of the repository's
  top-level folders, such as `tests/vllm_plugin/conftest.py`) names a tracked file or folder,
  except the few a user or a run creates (`CREATED_PATHS`). Patterns (`*`, `{a,b}`,
  `<name>`) and prefixes in code are not citations of one file and are skipped.
- No tracked file names an issue of the project's tracker (the word issue and its number): a
  reader of a clone cannot open it. Say what the code or test does instead.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTSIDE_TEXTS = tuple(name + ".md" for name in ("SPEC", "DESIGN"))
# Paths that are cited but made by the user or a run, never tracked.
CREATED_PATHS = (
    "docker/secrets",  # the Compose files' secrets: the user makes them (docker/compose*.yaml)
    "docs/results.json.lock",  # taken by `kvgate bench results` while it writes the page
)
# Old paths the changelog's table of renames names beside their new ones (it alone may).
RENAMED_PATHS = ("tests/" + "vllm", "kvgate_" + "vllm")  # spelled in parts: this file cites neither
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if (REPO / line).is_file()]


def tracked_lines():
    """(file, line number, line) of every tracked text file, in `git ls-files` order."""
    for name in tracked():
        try:
            text = (REPO / name).read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            yield name, number, line


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(path.read_text()):
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = github_anchor(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def prose_lines(text: str):
    """The lines of a Markdown text outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def test_no_file_cites_texts_outside_the_repository():
    citing = [
        f"{name}:{number}: {line.strip()}"
        for name, number, line in tracked_lines()
        if any(outside in line for outside in OUTSIDE_TEXTS)
    ]
    assert not citing, "these lines cite texts outside the repository; point to docs/ instead:\n" + "\n".join(citing)


def test_every_relative_markdown_link_resolves():
    files = set(tracked())
    folders = {str(Path(name).parent) for name in files} | {
        str(parent) for name in files for parent in Path(name).parents
    }
    broken = []
    for name in sorted(n for n in files if n.endswith(".md")):
        source = REPO / name
        for line in prose_lines(source.read_text()):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path_part, _, anchor = target.partition("#")
                resolved = (source.parent / path_part).resolve() if path_part else source
                try:
                    relative = str(resolved.relative_to(REPO))
                except ValueError:
                    broken.append(f"{name}: {target} leaves the repository")
                    continue
                if relative not in files and relative not in folders:
                    broken.append(f"{name}: {target} names no tracked file or folder")
                elif anchor and relative.endswith(".md") and anchor not in anchors(resolved):
                    broken.append(f"{name}: {target} names no heading of {relative}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def cited_paths(line: str, top_folders: list[str]) -> list[str]:
    """The repository paths `line` cites: words that start with a top-level folder and a
    slash. Left out: patterns, and prefixes in code (a string literal that ends in `.` or
    `/`, such as `startswith("docs/results.")`)."""
    folders = "|".join(map(re.escape, top_folders))
    pattern = r"(?<![\w./-])(?:" + folders + r")/[\w./*{}<>-]*[\w*}>]"
    cited = []
    for match in re.finditer(pattern, line):
        path, after = match.group(), line[match.end() : match.end() + 2]
        if not any(mark in path for mark in "*{}<>") and after not in ('."', ".'", '/"', "/'"):
            cited.append(path)
    return cited


def test_every_cited_repository_path_exists():
    files = set(tracked())
    folders = {str(parent) for name in files for parent in Path(name).parents if str(parent) != "."}
    top_folders = sorted({name.split("/", 1)[0] for name in files if "/" in name})
    missing = []
    for name, number, line in tracked_lines():
        for path in cited_paths(line, top_folders):
            created = any(path == c or path.startswith(c + "/") for c in CREATED_PATHS)
            renamed = name == "CHANGELOG.md" and path.rstrip("/") in RENAMED_PATHS
            if path not in files and path not in folders and not created and not renamed:
                missing.append(f"{name}:{number}: {path}")
    assert not missing, "these lines cite repository paths that do not exist:\n" + "\n".join(missing)


def test_no_file_cites_tracker_issues():
    citing = [
        f"{name}:{number}: {line.strip()}"
        for name, number, line in tracked_lines()
        if re.search(r"\bissues?[ \t]+#?\d+|\bissue[ \t]*#\d+", line, re.IGNORECASE)
    ]
    assert not citing, "these lines cite tracker issues; say what is meant instead:\n" + "\n".join(citing)
