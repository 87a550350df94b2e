"""mkdocs hooks for the documentation site (mkdocs.yml ``hooks``): our docstrings are written for plain text and
Sphinx alike, so the API pages drop Sphinx's cross-reference roles (``:class:`X``` renders as ``X`` in code).

The long reasoning of the source is in named Notes, which its comments, docstrings and pages cite as
``Note [name]``: the site has a page of them, notes.md, made at each build from the source, and every mention of
one on any page links to it; a mention of a Note that no source defines fails the strict build."""

import ast
import io
import itertools
import logging
import re
import tokenize
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).parent
SOURCES = ["src/arraymp/*.py", "packages/*/src/**/*.py"]  # the modules whose Notes make the page

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):(<code>)")
# A Note's definition starts a line of a docstring or a module-level comment block: a heading underlined with "~",
# or "Note [name]: " and its first words. Its text runs to the next definition or the end of the block (diagrams and
# all: an inline Note often goes on past a blank line).
_DEFINITION = re.compile(r"^Note \[([^\]\n]+)\](?:\n~+\n|: )", re.M)
_MENTION = re.compile(r"\bNote\s+\[([^\]<]+)\]")  # in a page's HTML, the name maybe broken over lines

log = logging.getLogger("mkdocs.hooks.notes")
_names: list[str] = []  # of the Notes gathered for this build (on_files)


class Note(NamedTuple):
    name: str
    path: str  # of its module, from the repository's root
    text: str


def _blocks(source):
    """The docstrings and the module-level comment blocks (comments in a row at column 0, without '# ') of a
    module's source: a comment inside a function or class cites Notes but defines none."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield ast.get_docstring(node) or ""
    comments = [(tok.start[0], tok.string[1:].removeprefix(" "))
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT and tok.start[1] == 0]
    for _, run in itertools.groupby(enumerate(comments), lambda ic: ic[1][0] - ic[0]):
        yield "\n".join(line for _, (_, line) in run)


def gather_notes(root=ROOT):
    """Every Note the modules of ``SOURCES`` under ``root`` define, module by module
    (sorted by path): the docstrings' (the module's first), then the comments'."""
    notes = []
    for path in sorted(p for pattern in SOURCES for p in root.glob(pattern)):
        for block in _blocks(path.read_text()):
            parts = _DEFINITION.split(block)  # [before, name, text, name, text, ...]
            for name, text in zip(parts[1::2], parts[2::2], strict=True):
                notes.append(Note(name, path.relative_to(root).as_posix(), text.strip()))
    return notes


def anchor(name):
    """The id of a Note's section on notes.md: its name in lower case, other characters '-'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def notes_page(notes):
    """The Markdown of notes.md: a section per Note, its text as written (diagrams kept) in a code block."""
    parts = ["# Design notes\n\nThe long reasoning of the source code, in named Notes that its comments, "
             "docstrings and these pages cite by name. Generated from the source at each build.\n"]
    for n in notes:
        parts.append(f"## {n.name} {{#{anchor(n.name)}}}\n\nIn `{n.path}`:\n\n````text\n{n.text}\n````\n")
    return "\n".join(parts)


def on_files(files, config):
    from mkdocs.structure.files import File

    global _names
    notes = gather_notes()
    _names = [n.name for n in notes]
    for name in sorted({name for name in _names if _names.count(name) > 1}):
        log.warning("Note [%s] is defined twice: %s", name, ", ".join(n.path for n in notes if n.name == name))
    files.append(File.generated(config, "notes.md", content=notes_page(notes)))
    return files


def on_page_content(html, page, config, files):
    url = files.get_file_from_path("notes.md").url_relative_to(page.file)

    def link(m):
        name = " ".join(m[1].split())
        if name not in _names:
            log.warning("%s mentions Note [%s], which no module defines", page.file.src_uri, name)
            return m[0]
        return f'<a href="{url}#{anchor(name)}">{m[0]}</a>'

    return _MENTION.sub(link, _ROLE.sub(r"\1", html))
