"""No top-level function or class of the library is defined and never used: each is referenced from the library
or the scripts (tests do not count: code only tests reach is dead to users). The exceptions are listed with
their reason, so a new one is a decision, not an accident."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("neuron_opt", "models", "kernels_nki")
USERS = (*LIBRARY, "scripts")

# name -> why it stays although nothing in the library or scripts calls it
ALLOWED = {
    "__getattr__": "module-level lazy attributes (neuron_opt.LLM): Python calls it",
    "NkiSimOps": "the eager whole-model check of the NKI kernels (the reference for ops=nki's kernel choice)",
    "generate_ids": "runtime/generate.py's single-sequence reference loop: the oracle the engine is tested against",
}
# modules whose public names are an API others' code calls (the NKI front end kernels are written against)
API_MODULES = ("neuron_opt/nki_sim/language.py", "neuron_opt/nki_sim/isa.py")


def unused_definitions() -> dict[str, list[str]]:
    defs: dict[str, list[str]] = {}
    used: set[str] = set()
    for pkg in USERS:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(p.relative_to(ROOT))
            tree = ast.parse(p.read_text())
            if pkg in LIBRARY:
                for node in tree.body:
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                        public_api = rel in API_MODULES and not node.name.startswith("_")
                        oracle = pkg == "kernels_nki" and node.name.endswith("_ref")  # what kernel tests compare to
                        if not public_api and not oracle and node.name not in ALLOWED:
                            defs.setdefault(node.name, []).append(f"{rel}:{node.lineno}")
            for node in ast.walk(tree):
                if isinstance(node, ast.Name):
                    used.add(node.id)
                elif isinstance(node, ast.Attribute):
                    used.add(node.attr)
                elif isinstance(node, ast.alias):
                    used.add(node.name.rpartition(".")[2])
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    used.add(node.value)  # getattr(module, "name"), __all__
    return {n: where for n, where in defs.items() if n not in used}


def test_every_library_function_and_class_is_used():
    assert unused_definitions() == {}
