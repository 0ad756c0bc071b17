"""What a fresh install needs: every third-party module mmpipe/ imports (at the top of a file or
inside a function) is declared in setup.py, directly or through what a declared package requires;
an optional import a run needs is checked before the run writes anything."""
from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import sys

import pytest
from helpers import ROOT, TINY_VLM

from mmpipe.errors import ConfigError

# import names whose distribution is named otherwise (used when the module is not installed here)
ALIAS = {"PIL": "pillow", "open_clip": "open-clip-torch", "open_clip_train": "open-clip-torch", "yaml": "pyyaml"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules(root: str) -> dict:
    """Top-level module name -> the files importing it (absolute imports only)."""
    out: dict = {}
    for d, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            for n in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                    [n.module] if isinstance(n, ast.ImportFrom) and not n.level and n.module else []
                for m in names:
                    out.setdefault(m.split(".")[0], set()).add(os.path.relpath(path, root))
    return out


def declared_distributions(setup_py: str, extras: bool = True) -> set:
    """Every distribution setup.py names (install_requires, and with ``extras`` its extras) and, as
    installed here, everything those require."""
    import setuptools
    seen = {}

    def fake_setup(**kw):
        seen.update(kw)
    real, setuptools.setup = setuptools.setup, fake_setup
    try:
        exec(compile(open(setup_py).read(), setup_py, "exec"), {"__name__": "__setup__"})
    finally:
        setuptools.setup = real
    reqs = list(seen.get("install_requires", []))
    reqs += [r for rs in seen.get("extras_require", {}).values() for r in rs] if extras else []
    todo, closure = [_norm(re.match(r"[A-Za-z0-9_.\-]+", r).group(0)) for r in reqs], set()
    while todo:
        n = todo.pop()
        if n in closure:
            continue
        closure.add(n)
        try:
            more = md.requires(n) or []
        except md.PackageNotFoundError:
            continue
        todo += [_norm(re.match(r"[A-Za-z0-9_.\-]+", r).group(0)) for r in more if "extra ==" not in r]
    return closure


def undeclared(root: str, setup_py: str, optional: tuple = ("bench",)) -> dict:
    """Imports setup.py does not install: the package's own modules need ``install_requires``; those
    under an ``optional`` folder (the benches, whose peers come with ``[peers]``) may use an extra."""
    core, everything = declared_distributions(setup_py, extras=False), declared_distributions(setup_py)
    dist_of, missing = md.packages_distributions(), {}
    for m, files in sorted(imported_modules(root).items()):
        if m in sys.stdlib_module_names or m == os.path.basename(root) or m == "__future__":
            continue
        dists = [_norm(d) for d in dist_of.get(m, [])] or [_norm(ALIAS.get(m, m))]
        for f in sorted(files):
            want = everything if f.split(os.sep)[0] in optional else core
            if not any(d in want for d in dists):
                missing[m] = f"{f} imports {m} (distribution {'/'.join(dists)})"
                break
    return missing


def test_every_third_party_import_of_mmpipe_is_declared_in_setup_py():
    missing = undeclared(os.path.join(ROOT, "mmpipe"), os.path.join(ROOT, "setup.py"))
    assert not missing, "undeclared in setup.py: " + "; ".join(missing.values())


def test_the_check_finds_an_undeclared_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import torch\n\ndef f():\n    import peft\n    from yaml import safe_load\n")
    (pkg / "bench").mkdir()
    (pkg / "bench" / "b.py").write_text("import pytest\n")
    (tmp_path / "setup.py").write_text('from setuptools import setup\nsetup(name="pkg", install_requires=["torch"], '
                                       'extras_require={"x": ["pyyaml", "pytest"]})\n')
    missing = undeclared(str(pkg), str(tmp_path / "setup.py"))
    assert set(missing) == {"peft", "yaml"}  # yaml only in an extra, imported by a core module; pytest: a bench's


def test_lora_without_peft_is_one_line_before_the_run_dir_is_written(tiny_chat_data, tmp_path, monkeypatch):
    from mmpipe.config.schema import load_config
    from mmpipe.train.setup import validate
    out = tmp_path / "run"
    cfg = load_config(TINY_VLM, overrides=[f"data.train={tiny_chat_data['train']}", f"train.output_dir={out}",
                                           "optim.train_type=lora", "parallel.pipeline_stages=1"])
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError, as without the package
    with pytest.raises(ConfigError, match="needs peft"):
        validate(cfg, resume=False, stop_at=None, overwrite=False)
    assert not out.exists()
