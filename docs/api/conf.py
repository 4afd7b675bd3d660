"""Sphinx configuration of attnkit's API reference: `make docs` builds it into site/api/ (static HTML, offline).

Built from the docstrings with autodoc (Google-style sections through napoleon). `make docs` runs sphinx-build with
-n -W: a cross-reference that resolves to nothing (``:func:`attnkit.nope```) fails the build, and so does any
other warning. Names outside attnkit (torch, numpy, the standard library) cannot be resolved offline (intersphinx
would fetch their inventories), so only those are exempt, by the patterns below.
"""

from __future__ import annotations

import attnkit

project = "attnkit"
release = version = attnkit.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_default_options = {"members": True, "undoc-members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
default_role = "code"  # `x` in a docstring is code, as in Markdown
html_theme = "alabaster"
html_theme_options = {"page_width": "1100px", "sidebar_width": "240px"}
html_static_path: list[str] = []
html_copy_source = False
html_show_sourcelink = False
html_show_sphinx = False
nitpicky = True
nitpick_ignore_regex = [
    # outside attnkit: no inventory to resolve them against offline
    (r"py:(class|obj|data|func|meth|attr|exc|mod)", r"(torch|numpy|np|matplotlib|transformers|deepspeed|ray)(\..*)?"),
    (
        r"py:(class|obj|data)",
        r"(typing|collections\.abc|contextlib|contextvars|os|pathlib|dataclasses|enum|datetime|types)\..*",
    ),
    (r"py:class", r"timedelta"),
    (r"py:(class|obj)", r"(MaskFn|ScoreFn)"),  # type aliases of attnkit.mods.base, written out in its page
    # private names in signatures (a return type such as attnkit.recording._Record) have no page of their own
    (r"py:(class|obj)", r"(.*\.)?_[A-Za-z]\w*"),
    (r"py:(class|obj)", r"(Tensor|Module|nn\.Module|Any|Callable|Sequence|Mapping|Iterator|Generator|Path|PathLike)"),
    (r"py:(class|obj)", r"(int|float|str|bool|bytes|dict|list|tuple|set|None|object|type|slice|range|Ellipsis)"),
]
