"""mkdocs hooks (``hooks:`` in mkdocs.yml): the repository's README.md is the site's home page, and links written for
the repository (``docs/x.md`` from the README, ``../README.md`` from a page) work on the site; a link to a file outside
docs/ (``../bench/README.md``) becomes its repository path in text. Only the site build uses this file: the Markdown
in the repository stays as it reads on GitHub."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
_LINK = re.compile(r"\[([^\]]*)\]\((?!https?://|#|mailto:)([^)\s]+)\)")


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, "index.md", content=(REPO / "README.md").read_text()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    source = page.file.src_uri
    page_dir = REPO if source == "index.md" else (DOCS / source).parent
    site_dir = (DOCS / source).parent

    def rewrite(match: re.Match[str]) -> str:
        text, target = match.groups()
        path, hash_sign, anchor = target.partition("#")
        resolved = (page_dir / path).resolve()
        if resolved == REPO / "README.md":
            resolved = DOCS / "index.md"
        if resolved.is_relative_to(DOCS):
            link = Path(resolved).relative_to(DOCS)
            relative = Path(*[".."] * len(site_dir.relative_to(DOCS).parts), link).as_posix()
            return f"[{text}]({relative}{hash_sign}{anchor})"
        return f"{text} (`{resolved.relative_to(REPO).as_posix()}` in the repository)"

    return _LINK.sub(rewrite, markdown)
