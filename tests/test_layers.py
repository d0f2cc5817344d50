"""The layers hold: the serving path (the runtime, trtspec.api, trtspec.serving, trtspec.blockpilot)
imports nothing from the measurement layer (trtspec.perf), neither when its modules load (directly
or through another module) nor later, inside a function."""

import ast
import json
import subprocess
import sys
from pathlib import Path

SERVING_PATH = ("trtspec.api", "trtspec.runtime", "trtspec.serving", "trtspec.blockpilot")
MEASUREMENT = "trtspec.perf"

# In a fresh interpreter (this one has loaded trtspec.perf for other tests): import every module of
# the serving path, then list what got loaded from the measurement layer and each module's file.
LOAD = f"""
import importlib, json, pkgutil, sys
files = {{}}
for name in {SERVING_PATH!r}:
    module = importlib.import_module(name)
    files[name] = module.__file__
    for found in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
        files[found.name] = getattr(importlib.import_module(found.name), "__file__", None)
loaded = sorted(m for m in sys.modules if m == {MEASUREMENT!r} or m.startswith({MEASUREMENT!r} + "."))
print(json.dumps({{"files": files, "loaded": loaded}}))
"""


def imported_names(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` anywhere in the file names (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_serving_path_imports_nothing_from_the_measurement_layer():
    result = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["loaded"] == [], f"loading the serving path loads {report['loaded']}"
    modules = {name: Path(file) for name, file in report["files"].items() if file and file.endswith(".py")}
    assert {"trtspec.api", "trtspec.blockpilot.load", "trtspec.serving.app",
            "trtspec.serving.triton_model", "trtspec.runtime.engine"} <= modules.keys()
    later = {name: sorted(n for n in imported_names(path) if n == MEASUREMENT or n.startswith(MEASUREMENT + "."))
             for name, path in modules.items()}
    assert not {name: found for name, found in later.items() if found}
