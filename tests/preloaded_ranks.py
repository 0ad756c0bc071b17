"""Ranks forked from a process that has already imported torch, DeepSpeed and transformers.

A launched rank spends ~7 s of CPU importing those three before it runs a line of mmpipe; a tiny run trains
in under two. Each pytest worker keeps one server (multiprocessing's fork server, its own instance) that imported
them once; a rank is a fork of it that then runs ``python -u script args`` as a fresh interpreter would: its
own argv, environment, working directory, ``sys.path`` (the script's folder, PYTHONPATH, the interpreter's
own), unbuffered stdout/stderr into the given files, ``__main__``, and at the end the interpreter's shutdown
(non-daemon threads joined, atexit handlers run) and exit status. mmpipe itself is not preloaded: every
module of the package is imported by the rank, reading its environment then.

A launch whose environment differs from the server's in anything that is read at import (HF_*, OMP_*,
TORCH_*, ...) is not forked: ``usable`` says so and the caller starts plain processes. Only the launch
contract's variables, PYTHONPATH, MMPIPE_* and pytest's own may differ.

This module is light on purpose (the forked child unpickles its target from here)."""
from __future__ import annotations

import io
import os
import sys

PRELOAD = ["torch", "deepspeed", "deepspeed.runtime.pipe.engine", "transformers", "transformers.modeling_utils",
           "transformers.models.clip.modeling_clip", "transformers.models.bert.modeling_bert",
           "transformers.models.llama.modeling_llama", "transformers.models.siglip.modeling_siglip",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
           "transformers.models.qwen3_5.modeling_qwen3_5", "transformers.models.qwen3_vl.modeling_qwen3_vl",
           "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
           "tokenizers", "safetensors.torch", "PIL.Image"]
MAY_DIFFER = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "PYTHONPATH",
              # set by mmpipe.data.tokenizer when a test imports it (read by tokenizers when it forks, not at import)
              "TOKENIZERS_PARALLELISM",
              # set to torch's own default (/tmp/torchinductor_<user>) by importing transformers' MoE modules (through
              # torch._inductor): read when inductor compiles, and then the same value torch would compute
              "TORCHINDUCTOR_CACHE_DIR",
              # set to "1" by ``import deepspeed`` (which the server has done): a worker importing it after the server
              # started gets the value every rank gets
              "PYTORCH_NVML_BASED_CUDA_CHECK"}
MAY_DIFFER_PREFIXES = ("MMPIPE_", "PYTEST_")

_server = None  # (ForkServer, the environment it started with, a fresh interpreter's sys.path)


def _may_differ(key: str) -> bool:
    return key in MAY_DIFFER or key.startswith(MAY_DIFFER_PREFIXES)


def _start():
    global _server
    if _server is None:
        import json
        import subprocess
        from multiprocessing import forkserver
        env = dict(os.environ)
        env.setdefault("DS_ACCELERATOR", "cpu")  # as every launch's environment (helpers._env)
        clean = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        fresh = json.loads(subprocess.check_output([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
                                                   env=clean, text=True))
        server = forkserver.ForkServer()
        server.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.update(env)  # the server imports under the launches' environment
        try:
            server.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server = (server, env, fresh)
    return _server


def usable(env: dict) -> bool:
    """Whether a rank with environment ``env`` may be forked from this worker's server (started here)."""
    base = _start()[1]
    return all(_may_differ(k) for k in set(env) ^ set(base)) and \
        all(env[k] == base[k] or _may_differ(k) for k in set(env) & set(base))


def start(argv: list, env: dict, cwd: str, stdout: str, stderr: str):
    """``python -u argv...`` forked from the server: a started multiprocessing process (pid, exitcode,
    terminate, kill)."""
    server, _, fresh = _start()
    path = [os.path.dirname(os.path.abspath(os.path.join(cwd, argv[0])))]
    path += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + fresh
    proc = _Process(target=_rank_main, args=(list(argv), dict(env), cwd, path, stdout, stderr))
    proc._server = server
    proc.start()
    return proc


def _rank_main(argv, env, cwd, path, stdout, stderr):
    import runpy
    import threading
    import traceback
    for fd, name in ((1, stdout), (2, stderr)):
        f = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True, line_buffering=True,
                                  errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = list(argv)
    sys.path[:] = path
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # what the interpreter does at exit
        threading._shutdown()
        import atexit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _popen_class():
    from multiprocessing import popen_forkserver, spawn, util
    from multiprocessing.context import reduction, set_spawning_popen

    class Popen(popen_forkserver.Popen):
        def _launch(self, process_obj):  # popen_forkserver.Popen._launch, on this process's own server
            prep = spawn.get_preparation_data(process_obj._name)
            prep.pop("init_main_from_path", None)  # the rank runs its own __main__
            prep.pop("init_main_from_name", None)
            buf = io.BytesIO()
            set_spawning_popen(self)
            try:
                reduction.dump(prep, buf)
                reduction.dump(process_obj, buf)
            finally:
                set_spawning_popen(None)
            self.sentinel, w = process_obj._server.connect_to_new_process(self._fds)
            parent_w = os.dup(w)
            self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            from multiprocessing import forkserver
            self.pid = forkserver.read_signed(self.sentinel)
    return Popen


def _process_base():
    from multiprocessing import process
    return process.BaseProcess


class _Process(_process_base()):
    _start_method = "forkserver"

    def __getstate__(self):  # the server handle stays with the parent
        state = dict(self.__dict__)
        state.pop("_server", None)
        return state

    @staticmethod
    def _Popen(process_obj):
        return _popen_class()(process_obj)
