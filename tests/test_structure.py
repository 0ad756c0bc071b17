"""The shape of the package: no import cycle among mmpipe's modules (function-level imports
included) and no function longer than 80 lines."""
from __future__ import annotations

import ast
import re
import os

from helpers import ROOT

PKG = os.path.join(ROOT, "mmpipe")
MAX_LINES = 80


def _modules() -> dict:
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(name: str, path: str, mods: dict) -> set:
    """The mmpipe modules ``name`` imports, anywhere in it (function-level imports included)."""
    tree = ast.parse(open(path).read())
    return {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for t in _targets(name, path.endswith("__init__.py"), node, mods) if isinstance(t, str) and t != name}


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_mmpipe_modules():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    # the check can fail: a cycle planted in a copy of the graph is found
    planted = dict(graph, **{"mmpipe.errors": graph["mmpipe.errors"] | {"mmpipe.config.schema"}})
    assert any({"mmpipe.config.schema", "mmpipe.errors"} <= set(c) for c in _cycles(planted))
    assert _cycles(graph) == []


def test_no_function_longer_than_80_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert long == []


# --------------------------------------------------------------------------------------------
# the floor plan: layers as folders, imports running one way
# --------------------------------------------------------------------------------------------
ORDER = ["ground", "parallel", "config", "data", "families", "planning", "train", "api"]
# each folder may import the ones before it in ORDER (and itself); cli and bench sit on top
ALLOWED = {layer: set(ORDER[:i + 1]) for i, layer in enumerate(ORDER)}
ALLOWED["cli"] = set(ORDER) | {"cli", "bench"}
ALLOWED["bench"] = set(ORDER) | {"bench"}
# a family says what its layers compute, never how they run: the one layer executor and the
# single-process model live in parallel/ and take a family, not the other way round
ALLOWED["families"] -= {"parallel"}
ROOT_MODULES = {"mmpipe": "api", "mmpipe.errors": "ground", "mmpipe._version": "ground"}
MAX_ATTRIBUTES = 20


def layer_of(module: str) -> str:
    if module in ROOT_MODULES:
        return ROOT_MODULES[module]
    return module.split(".")[1]


def against_the_table(graph: dict) -> list:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if layer_of(d) not in ALLOWED[layer_of(m)])


def test_the_package_root_holds_only_the_api_errors_and_version():
    mods = _modules()
    assert {m for m in mods if m.count(".") == 1 and not os.path.isdir(os.path.join(PKG, m.split(".")[1]))} == \
        {"mmpipe.errors", "mmpipe._version"}
    assert {layer_of(m) for m in mods} <= set(ALLOWED)


def test_imports_between_folders_follow_the_table():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    # the check can fail: the data layer importing the trainer is an arrow running back up
    planted = dict(graph, **{"mmpipe.data.loader": graph["mmpipe.data.loader"] | {"mmpipe.train.trainer"}})
    assert against_the_table(planted) == ["mmpipe.data.loader -> mmpipe.train.trainer"]
    assert against_the_table(graph) == []


def class_attributes(cls: ast.ClassDef) -> set:
    """The names a class holds: annotated class-level fields (dataclasses) and ``self.X = ...``."""
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


def big_classes(sources: dict) -> list:
    """Classes over the limit; a config section (a ``Section`` subclass) is exempt: its fields are
    the user's keys of one YAML section, not state."""
    out = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if any(getattr(b, "id", None) == "Section" for b in getattr(node, "bases", [])):
                continue
            if isinstance(node, ast.ClassDef) and len(class_attributes(node)) > MAX_ATTRIBUTES:
                out.append(f"{name}.{node.name}: {len(class_attributes(node))} attributes")
    return out


def test_no_class_holds_more_than_20_attributes():
    planted = "class Big:\n    def __init__(self):\n" + "".join(f"        self.a{i} = {i}\n" for i in range(21))
    assert big_classes({"planted": planted}) == ["planted.Big: 21 attributes"]
    assert big_classes({m: open(p).read() for m, p in _modules().items()}) == []


def test_the_trainer_is_wiring_and_a_loop():
    assert sum(1 for _ in open(os.path.join(PKG, "train", "trainer.py"))) < 250


def family_name_tests(sources: dict, names: set) -> list:
    """Outside ``families/``: comparisons with a family name (``== "vlm"``, ``in ("clip", "vlm")``)
    and hard-coded lists of family names; the registry (``config/registry.py``) lists the built-ins."""
    out = []
    for mod, text in sources.items():
        if mod.startswith("mmpipe.families") or mod == "mmpipe.config.registry":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    elts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    if any(isinstance(e, ast.Constant) and e.value in names for e in elts):
                        out.append(f"{mod}:{node.lineno}")
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                if sum(isinstance(e, ast.Constant) and e.value in names for e in node.elts) >= 2:
                    out.append(f"{mod}:{node.lineno}")
    return sorted(set(out))


def test_no_family_name_is_tested_outside_families():
    from mmpipe.config.registry import BUILTIN
    names = set(BUILTIN)
    planted = {"mmpipe.train.x": 'if cfg.model.type == "vlm":\n    pass\nKINDS = ("clip", "vlm")\n'}
    assert family_name_tests(planted, names) == ["mmpipe.train.x:1", "mmpipe.train.x:3"]
    assert family_name_tests({m: open(p).read() for m, p in _modules().items()}, names) == []


def test_every_built_in_family_has_a_tiny_config_for_the_shared_tests():
    from helpers import TINY_CONFIGS

    from mmpipe.config.registry import BUILTIN
    assert set(TINY_CONFIGS) == set(BUILTIN) and all(os.path.isfile(p) for p in TINY_CONFIGS.values())


def owners_of(sources: dict, pattern: str) -> set:
    """The modules whose source matches ``pattern`` (a regular expression)."""
    return {m for m, text in sources.items() if re.search(pattern, text)}


def test_the_pipeline_order_lives_in_one_module_and_deepspeed_is_initialized_in_one():
    """DeepSpeed's schedule classes are named only by ``parallel/schedules.py`` (which reproduces them) and
    ``parallel/ds_compat.py`` (which installs a stream as the engine's); the re-derivations of 1F1B that
    ``schedules`` replaced are gone; ``deepspeed.initialize`` is called only by the runtime."""
    sources = {m: open(p).read() for m, p in _modules().items()}
    schedule_classes = r"\b(TrainSchedule|InferenceSchedule)\b"
    assert owners_of(dict(sources, planted="S.TrainSchedule(micro_batches=2)"), schedule_classes) == \
        {"mmpipe.parallel.schedules", "mmpipe.parallel.ds_compat", "planted"}
    assert owners_of(sources, schedule_classes) <= {"mmpipe.parallel.schedules", "mmpipe.parallel.ds_compat"}
    assert owners_of(sources, r"def (in_flight|one_f_one_b|_ds_streams|_gpipe_streams)\b") == set()
    assert owners_of(sources, r"deepspeed\.initialize\(") == {"mmpipe.parallel.runtime"}


# --------------------------------------------------------------------------------------------
# function-level imports between mmpipe modules (ARCHITECTURE.md: at the top of each file, unless
# the import would pull a heavy third-party package at import time)
# --------------------------------------------------------------------------------------------
HEAVY = {"deepspeed", "transformers", "matplotlib", "peft", "av", "open_clip", "torchvision", "safetensors",
         "tokenizers", "PIL", "webdataset", "tensorboard", "huggingface_hub", "scipy"}


def _targets(name: str, is_pkg: bool, node, mods) -> list:
    """What an import statement imports: mmpipe module names, or ("ext", top-level package)."""
    pkg = name if is_pkg else name.rsplit(".", 1)[0]
    out = []
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = pkg.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        for a in node.names:
            hit = next((c for c in (f"{base}.{a.name}", base) if c in mods), None)
            out.append(hit or ("ext", base.split(".")[0]))
    else:
        out += [a.name if a.name in mods else ("ext", a.name.split(".")[0]) for a in node.names]
    return out


def needless_lazy_imports(sources: dict) -> list:
    """``module:line -> imported`` for each import of an mmpipe module inside a function that could be at the top:
    the module is imported at the top already, or importing it there adds no heavy package (``HEAVY``, through the
    imported module's own top-level imports) to what the importing module pulls in and makes no import cycle."""
    mods = set(sources)
    top, lazy = {}, {}
    for m, (text, is_pkg) in sources.items():
        tree = ast.parse(text)
        body = {id(n) for n in tree.body}
        top[m] = [t for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for t in _targets(m, is_pkg, n, mods)]
        lazy[m] = [(t, n.lineno) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   and id(n) not in body for t in _targets(m, is_pkg, n, mods) if isinstance(t, str) and t != m]

    def reached(m, seen) -> set:  # the modules importing ``m`` imports (its packages' too), itself included
        if m not in seen:
            seen.add(m)
            parents = [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)]
            for d in [p for p in parents if p in mods] + [t for t in top[m] if isinstance(t, str)]:
                reached(d, seen)
        return seen
    closure = {m: reached(m, set()) for m in mods}
    heavy = {m: {t[1] for d in closure[m] for t in top[d] if isinstance(t, tuple) and t[1] in HEAVY} for m in mods}
    # (at the top, an import whose module imports the importing one back, or its package, would be a cycle)
    return sorted(f"{m}:{line} -> {dep}" for m, deps in lazy.items() for dep, line in deps
                  if dep in top[m] or (heavy[dep] <= heavy[m] and m not in closure[dep]))


def test_imports_between_mmpipe_modules_are_at_the_top_unless_they_would_pull_a_heavy_package():
    sources = {m: (open(p).read(), p.endswith("__init__.py")) for m, p in _modules().items()}
    # the check can fail: a light module imported in a function, and one imported twice
    planted = dict(sources, **{"mmpipe.train.planted": (
        "from mmpipe.errors import ConfigError\n\ndef f():\n    from mmpipe.errors import MmpipeError\n"
        "    from mmpipe.parallel.schedules import stream\n", False)})
    assert needless_lazy_imports(planted) == ["mmpipe.train.planted:4 -> mmpipe.errors",
                                              "mmpipe.train.planted:5 -> mmpipe.parallel.schedules"]
    assert needless_lazy_imports(sources) == []


def schedule_defaults(sources: dict, names: set) -> list:
    """Outside ``parallel/schedules.py``: a schedule's name as a default (a function argument's, a record field's),
    and DeepSpeed's order named at all outside the benches (which name the orders they compare): every reader takes
    the run's ``Order``."""
    out = []
    for mod, text in sources.items():
        if mod == "mmpipe.parallel.schedules":
            continue
        for node in ast.walk(ast.parse(text)):
            defaults = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defaults = node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                defaults = [node.value]
            if any(isinstance(d, ast.Constant) and d.value in names for d in defaults):
                out.append(f"{mod}:{node.lineno}")
            if isinstance(node, ast.Constant) and node.value == "1f1b" and not mod.startswith("mmpipe.bench"):
                out.append(f"{mod}:{node.lineno}")
    return sorted(set(out))


def test_no_schedule_default_outside_the_schedules_module():
    from mmpipe.parallel.schedules import SCHEDULES
    names = set(SCHEDULES)
    planted = {"mmpipe.planning.x": 'def predict(prof, schedule: str = "1f1b"):\n    pass\n'}
    assert schedule_defaults(planted, names) == ["mmpipe.planning.x:1"]
    assert schedule_defaults({m: open(p).read() for m, p in _modules().items()}, names) == []


def sibling_imports(graph: dict, families: dict) -> list:
    """(module, imported) where one family's modules import another's: ``families`` maps a family to the
    module names (or packages) that are its own (what two families share lives in a module of neither)."""
    own = {p: fam for fam, prefixes in families.items() for p in prefixes}

    def family_of(module: str):
        return next((f for p, f in own.items() if module == p or module.startswith(p + ".")), None)
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if family_of(m) and family_of(t) and family_of(m) != family_of(t))


def test_no_qwen_family_imports_a_sibling():
    """Qwen3.5 and Qwen3-VL compose what they share (``qwen3_vision``, ``hf_config``) beside Qwen2.5-VL's base
    rather than stacking on each other; a MoE sibling is one more part, not a floor."""
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    q = "mmpipe.families.qwen_vl."
    # (a family's module; a MoE family's config section extends its dense sibling's text fields: shared sections)
    families = {name: (q + name,) for name in ("qwen3_5", "qwen3_vl", "qwen3_5_moe", "qwen3_vl_moe")}
    planted = dict(graph, **{q + "qwen3_vl": graph[q + "qwen3_vl"] | {q + "qwen3_5"}})  # the check can fail
    assert sibling_imports(planted, families) == [(q + "qwen3_vl", q + "qwen3_5")]
    assert sibling_imports(graph, families) == []
