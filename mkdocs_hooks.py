"""mkdocs hooks for the documentation site (mkdocs.yml ``hooks``): our docstrings are written for plain text and
Sphinx alike, so the API pages drop Sphinx's cross-reference roles (``:class:`X``` renders as ``X`` in code)."""

import re

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):(<code>)")


def on_page_content(html, page, config, files):
    return _ROLE.sub(r"\1", html)
