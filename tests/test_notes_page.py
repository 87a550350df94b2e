"""The site's Design notes page (mkdocs_hooks.py): every Note the source defines is on it once, under a name no other
Note has, in the one format, and every ``Note [name]`` a page or the source cites is one of them. Needs no mkdocs."""

import collections
import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
SOURCES = sorted([*ROOT.glob("src/arraymp/*.py"), *ROOT.glob("packages/*/src/**/*.py")])
# a definition, found in the raw text: a line "Note [name]" underlined with "~", or "Note [name]: ..." (in a
# comment, at column 0: a comment inside a function or class cites Notes but defines none)
DEFINITION = re.compile(r'^(?:# |[ \t]*(?:""")?)Note \[([^\]\n]+)\](?:: |\n(?:# |[ \t]*)~)', re.M)
MENTION = re.compile(r"\bNote[\s#]+\[([^\]\[]+)\]")  # the name maybe broken over lines, of comments too
# The one format of a Note (issue 41; STYLE.md rule 9), in a docstring or a comment block at column 0 (``# `` off):
#     Note [name]
#     ~~~~~~~~~~~
#     Invariant: <what holds, stated so that a test could check it>. <then why, and how the code keeps it>
# "Rule: <the rule it sets>" instead where the Note states no invariant (a rationale, a measured trade-off). At most
# MAX_WORDS words: past it, cut repetition and history or split it into two Notes.
HEADING = re.compile(r"^Note \[([^\]\n]+)\](\n~+\n|: )", re.M)  # as mkdocs_hooks._DEFINITION, the separator kept
MAX_WORDS = 250

spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "mkdocs_hooks.py")
hooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hooks)


def where(path, text, m):
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"


def test_every_note_gathered_once():
    defined = collections.Counter((p.relative_to(ROOT).as_posix(), name) for p in SOURCES
                                  for name in DEFINITION.findall(p.read_text()))
    gathered = collections.Counter((n.path, n.name) for n in hooks.gather_notes())
    assert defined, "no Note found in the source"
    assert gathered == defined


def test_names_unique_and_texts_present():
    notes = hooks.gather_notes()
    paths = collections.defaultdict(list)
    for n in notes:
        paths[n.name].append(n.path)
    duplicates = {name: p for name, p in paths.items() if len(p) > 1}
    assert not duplicates, f"Notes defined more than once: {duplicates}"
    assert all(n.text for n in notes), [n.name for n in notes if not n.text]
    assert len({hooks.anchor(n.name) for n in notes}) == len(notes), "two Notes' names make one anchor"


def test_mentions_defined():
    names = {n.name for n in hooks.gather_notes()}
    dangling = [f"{where(p, text, m)}: Note [{name}]" for p in [*sorted((ROOT / "docs").rglob("*.md")), *SOURCES]
                for text in [p.read_text()] for m in MENTION.finditer(text)
                if (name := " ".join(m[1].replace("#", " ").split())) not in names]
    print("\n".join(dangling))
    assert not dangling, "mentions of Notes that no module defines:\n" + "\n".join(dangling)


def format_faults():
    """{name: what is wrong} for every Note that is not in the one format."""
    faults = {}
    for p in SOURCES:
        for block in hooks._blocks(p.read_text()):
            parts = HEADING.split(block)  # [before, name, separator, text, name, separator, text, ...]
            for name, sep, text in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
                wrong = []
                if sep != "\n" + "~" * len(f"Note [{name}]") + "\n":
                    wrong.append("no line of '~' as long as its heading under it")
                if not text.startswith(("Invariant: ", "Rule: ")):
                    wrong.append('its text does not start with "Invariant: " or "Rule: "')
                if (words := len(text.split())) > MAX_WORDS:
                    wrong.append(f"{words} words, over {MAX_WORDS}")
                if wrong:
                    faults[name] = f"{p.relative_to(ROOT)}: Note [{name}]: " + "; ".join(wrong)
    return faults


def test_note_format():
    wrong = [fault for _, fault in sorted(format_faults().items())]
    assert not wrong, "Notes not in the one format (see HEADING):\n" + "\n".join(wrong)
