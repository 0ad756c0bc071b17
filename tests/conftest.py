"""Shared fixtures: a tiny synthetic data set (with one missing and one corrupt image), the tiny
config, and the multi-process runs, each launched once per session and shared by the tests."""
from __future__ import annotations

import json

import pytest
from helpers import TINY_CONFIGS, Runs


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """80 synthetic pairs + a missing image and a corrupt JPEG in the training manifest."""
    from mmpipe.data.synth import synth
    out = tmp_path_factory.mktemp("tinydata")
    info = synth(str(out), 80, val_fraction=0.1, size=48, seed=1, progress=False)
    with open(out / "images" / "corrupt.jpg", "wb") as fh:
        fh.write(b"\xff\xd8\xff\xe0 this is not a jpeg at all" * 3)
    with open(info["train"], "a") as fh:
        fh.write(json.dumps({"image": "images/does_not_exist.jpg", "text": "a small red circle"}) + "\n")
        fh.write(json.dumps({"image": "images/corrupt.jpg", "text": "a large blue square"}) + "\n")
    return {"dir": str(out), "train": info["train"], "val": info["val"]}


@pytest.fixture(scope="session")
def tiny_chat_data(tmp_path_factory):
    """70 synthetic chat samples (ms-swift JSONL; about a third text-only, so some micro-batches
    hold no image) + three unusable lines: a missing image, a corrupt JPEG, an <image> count that
    does not match the images."""
    from mmpipe.data.synth import synth_vlm
    out = tmp_path_factory.mktemp("tinychat")
    info = synth_vlm(str(out), 70, val_fraction=0.1, size=32, seed=1, text_only=0.3, progress=False)
    _add_unusable_chat_lines(out, info["train"])
    return {"dir": str(out), "train": info["train"], "val": info["val"]}


def _add_unusable_chat_lines(out, train: str) -> None:
    """A missing image, a corrupt JPEG and an <image> count that does not match the images."""
    with open(out / "images" / "corrupt.jpg", "wb") as fh:
        fh.write(b"\xff\xd8\xff\xe0 this is not a jpeg at all" * 3)
    turn = [{"role": "user", "content": "<image>\nwhat colour is the shape?"}, {"role": "assistant", "content": "red"}]
    with open(train, "a") as fh:
        fh.write(json.dumps({"messages": turn, "images": ["images/does_not_exist.jpg"]}) + "\n")
        fh.write(json.dumps({"messages": turn, "images": ["images/corrupt.jpg"]}) + "\n")
        fh.write(json.dumps({"messages": turn, "images": []}) + "\n")


# image sizes (w, h) of the native-resolution chat data: 4 to 16 image tokens each at the tiny
# Qwen2.5-VL's pixel bounds, several sizes in most micro-batches
MIXED_SIZES = [(32, 32), (80, 32), (32, 96), (120, 60), (56, 140), (100, 100), (200, 40)]


@pytest.fixture(scope="session")
def tiny_native_chat_data(tmp_path_factory):
    """``tiny_chat_data``'s kind of samples and unusable lines, its images of ``MIXED_SIZES``: what a
    native-resolution family trains on."""
    from mmpipe.data.synth import synth_vlm
    out = tmp_path_factory.mktemp("tinynative")
    info = synth_vlm(str(out), 70, val_fraction=0.1, seed=1, text_only=0.3, progress=False, sizes=MIXED_SIZES)
    _add_unusable_chat_lines(out, info["train"])
    return {"dir": str(out), "train": info["train"], "val": info["val"]}


@pytest.fixture(scope="session")
def runs(tmp_path_factory, tiny_data):
    return Runs(tmp_path_factory.mktemp("runs"), tiny_data)


# Model families the shared grouped-clipping tests run on: name -> the module that registers it
# (None: built in). A plugin module defines its family and ``FAMILY_CONFIG`` (a tiny run config).
FAMILIES = {"clip": None, "toy": "test_toy_family"}
# ... and the layout-parity and resume tests: every built-in and the plugin families
PARITY_FAMILIES = {**FAMILIES, **{name: None for name in TINY_CONFIGS}}


@pytest.fixture(scope="session")
def family_runs_of(tmp_path_factory, tiny_data, tiny_chat_data, tiny_native_chat_data, runs):
    """family name -> its Runs (CLIP's are the shared ``runs``)."""
    cache = {"clip": runs}

    def get(name: str) -> Runs:
        if name not in cache:
            d = tmp_path_factory.mktemp(f"runs_{name}")
            if name in TINY_CONFIGS:  # a built-in, on the tiny data of its format
                from mmpipe.config.registry import get_family
                fam = get_family(name)
                native = fam.data_format == "chat" and fam.pixels(fam.config_class(), None).cache_size is None
                data = tiny_native_chat_data if native else tiny_chat_data if fam.data_format == "chat" else tiny_data
                cache[name] = Runs(d, data, TINY_CONFIGS[name])
                return cache[name]
            import importlib
            module = FAMILIES[name]
            cfg = d / f"{name}.yaml"
            cfg.write_text(importlib.import_module(module).FAMILY_CONFIG)
            cache[name] = Runs(d, tiny_data, str(cfg), env={"MMPIPE_PLUGINS": module})
        return cache[name]
    return get


@pytest.fixture(params=list(FAMILIES))
def family(request):
    """A registered family's name; tests taking it run once per family."""
    if FAMILIES[request.param]:
        import importlib
        importlib.import_module(FAMILIES[request.param])
    return request.param


@pytest.fixture(params=list(PARITY_FAMILIES))
def parity_family(request):
    if PARITY_FAMILIES[request.param]:
        import importlib
        importlib.import_module(FAMILIES[request.param])
    return request.param


# ---- the `dist` marker: tests that start processes (a launcher, torchrun, a subprocess run) --------
DIST_FIXTURES = {"runs", "family_runs_of"}
DIST_CALLS = ("launch(", "subprocess.", "torchrun", "mp.spawn", "run_cpu(")


def pytest_configure(config):
    config.addinivalue_line("markers", "dist: starts processes (launchers, torchrun, subprocess runs); "
                                       "`make test-fast` leaves these out")


# ---- two pytest-xdist workers (`make test`: -n 2 --dist loadfile): a module's tests stay on one
# worker (its module-scoped runs are made once); session-scoped runs are made per worker; every launch
# takes a free rendezvous port (helpers.launch), never the launchers' default.


def pytest_collection_modifyitems(config, items):
    import inspect
    for item in items:
        fn = getattr(item, "function", None)
        src = inspect.getsource(fn) if fn is not None else ""
        if DIST_FIXTURES & set(getattr(item, "fixturenames", ())) or any(c in src for c in DIST_CALLS):
            item.add_marker(pytest.mark.dist)



# ---- where the suite's time goes: each module's setup + call + teardown, summed, printed at the end (the table in
# docs/testing.md is this output of a `make test` run) ------------------------------------------------------
_MODULE_SECONDS: dict = {}


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.write_sep("=", "slowest test modules (setup + call + teardown, summed over workers)")
    for module, s in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{s:8.1f} s  {100 * s / total:4.1f}%  {module}")
    terminalreporter.write_line(f"{total:8.1f} s in all, {len(_MODULE_SECONDS)} modules")
