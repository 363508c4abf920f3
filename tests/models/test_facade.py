"""`dflash.models`, the users' one import: every name it imports is public (in `__all__`, so
`from dflash.models import *` gives it), is its home room's own object, and comes from the rooms the
facade names (drafter, target, objective; the mask token's vocabulary from data)."""
import ast
import importlib

import dflash.models as facade

ROOMS = {"drafter", "target", "objective", "data"}


def imported_names():
    """(module, name) of every `from dflash.X import name` in the facade, read from its source."""
    tree = ast.parse(open(facade.__file__, encoding="utf-8").read())
    return [(node.module, alias.asname or alias.name) for node in tree.body if isinstance(node, ast.ImportFrom)
            for alias in node.names]


def test_every_name_of_the_facade_is_public_and_its_rooms_own():
    names = imported_names()
    assert sorted(name for _, name in names) == sorted(facade.__all__)
    for module, name in names:
        assert module.split(".")[1] in ROOMS, f"{name} comes from {module}, outside the facade's rooms"
        assert getattr(facade, name) is getattr(importlib.import_module(module), name), name


def test_a_star_import_gives_every_public_name():
    scope = {}
    exec("from dflash.models import *", scope)
    assert {k for k in scope if not k.startswith("__")} == set(facade.__all__)
