"""Sphinx configuration for ddpstate's documentation site.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (README says so;
``tests/test_docs.py`` runs the same build in CI, warnings as errors).

Why Sphinx, and these extensions:

- Sphinx is what torch, safetensors and Accelerate document themselves with, and its
  ``autodoc`` reads the docstrings that already run as doctests, so the reference cannot drift
  from the code; ``napoleon`` reads their Google style (Args/Returns/Raises/Example).
- MyST parses Markdown, so the pages in ``docs/`` stay plain Markdown that reads the same on
  GitHub as on the site.
- furo: a maintained, accessible theme with a search box and dark mode, and no JavaScript
  framework to keep up with.
- No ``viewcode``: highlighted copies of every module add a sixth to the build's time in CI,
  and the source is one click away in the repository.
- ``nitpicky``: every cross-reference must resolve (a renamed function breaks the build).
  There is no network in CI, so no intersphinx: names of torch and the standard library
  cannot resolve and are listed in ``nitpick_ignore_regex`` below, reviewed by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ddpstate  # noqa: E402

project = "ddpstate"
author = "ddpstate developers"
copyright = "ddpstate developers"
release = version = ddpstate.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "**/_build"]

html_theme = "furo"
html_title = f"ddpstate {release}"

# Markdown: GitHub-style heading anchors, so `page.md#a-heading` links work on GitHub and here.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# undoc-members: every name of a module's __all__ gets an entry, documented or not.
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as fields of their class (a NamedTuple's fields are documented once).
napoleon_use_ivar = True

nitpicky = True
# Names that cannot resolve without intersphinx (no network): torch, the standard library
# and the third-party packages ddpstate's signatures mention.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|typing|typing_extensions|collections|os|pathlib|datetime|enum)\..*"),
    (r"py:.*", r"(fsspec|safetensors|numpy|concurrent|io|types|threading|signal)\..*"),
    # torch.distributed.checkpoint's plan and metadata types, as the inherited
    # StorageWriter/StorageReader signatures of ddpstate.dcp name them.
    (
        r"py:class",
        r"(SavePlan|SavePlanner|LoadPlan|LoadPlanner|Metadata|MetadataIndex|ReadItem|WriteItem"
        r"|WriteResult|StorageMeta)",
    ),
    # The frameworks ddpstate.integrations plugs into (their base classes and arguments).
    (r"py:.*", r"(lightning|transformers|accelerate)\..*"),
    # Names shown as they are written in the docstrings and signatures: `nn.Module` (torch),
    # private type variables of overloads.
    (r"py:.*", r"nn\..*"),
    (r"py:class", r"ddpstate\.[\w.]*\._[A-Z]\w*"),
    # ddpstate._fs.PathLike (str or os.PathLike), as signatures write it.
    (r"py:class", r"PathLike"),
]

# Each public object is documented once: the names of ``ddpstate.__all__`` on the package
# page, every other one on its public submodule's page. A signature or a base class names an
# object by where it is defined (``ddpstate.errors.DDPStateError``,
# ``ddpstate._manifest.CheckpointVerification``) and a docstring by its short name
# (:func:`barrier` in ``ddpstate.dist``); either resolves to the public entry of that name when
# there is exactly one.
PUBLIC_MODULES = (
    "ddpstate",
    *(f"ddpstate.{m}" for m in sorted(ddpstate._SUBMODULES)),
)


def _resolve_by_public_name(app, env, node, contnode):  # type: ignore[no-untyped-def]
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py":
        return None
    name = target.rsplit(".", 1)[-1] if target.startswith("ddpstate.") else target
    domain = env.get_domain("py")

    def public(name: str) -> list[str]:
        return [
            f"{module}.{name}"
            for module in PUBLIC_MODULES
            if f"{module}.{name}" in domain.objects
            and not domain.objects[f"{module}.{name}"].aliased
        ]

    # A method named inside its class's docstring (:meth:`restore`) where that class is shown
    # unindexed (the manager page): the method's entry is under the indexed class.
    cls = node.get("py:class")
    found = public(f"{cls}.{name}") if cls else []
    if len(found) != 1:
        found = public(name)
    if len(found) != 1:
        return None
    return domain.resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], found[0], node, contnode
    )


# A class's fields are documented once: by its docstring's Attributes section, which napoleon
# turns into the class's "Variables" list (type and description each). autodoc would list each
# field again as a bare attribute (a dataclass's annotations, with undoc-members). Its
# skip-member event is not told the class, so the fields the docstring documents are kept from
# the class's own docstring event, which autodoc emits just before choosing its members.
_DOCUMENTED_FIELDS: set[str] = set()
_IVAR = re.compile(r"^:ivar (\w+):")


def _note_documented_fields(app, what, name, obj, options, lines):  # type: ignore[no-untyped-def]
    if what in ("class", "exception"):
        _DOCUMENTED_FIELDS.clear()
        _DOCUMENTED_FIELDS.update(m.group(1) for line in lines if (m := _IVAR.match(line)))


def _skip_documented_fields(app, what, name, obj, skip, options):  # type: ignore[no-untyped-def]
    if what in ("class", "exception") and name in _DOCUMENTED_FIELDS and not callable(obj):
        return True
    return None


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("missing-reference", _resolve_by_public_name)
    # After napoleon (priority 500) has turned Attributes into :ivar: lines.
    app.connect("autodoc-process-docstring", _note_documented_fields, priority=900)
    app.connect("autodoc-skip-member", _skip_documented_fields)
