"""The test harness's forked ranks (``tests/preloaded_ranks.py``) run a script as a fresh interpreter would:
argv, environment, working directory, ``sys.path``, ``__main__``, output, atexit handlers, non-daemon threads
and the exit status; a launch whose environment differs in what is read at import starts plain processes."""
from __future__ import annotations

import subprocess
import sys

import preloaded_ranks
from helpers import ROOT, _env, run_processes

SCRIPT = """
import atexit, json, os, sys, threading, time
atexit.register(lambda: open(sys.argv[2], "a").write("atexit\\n"))
def late():
    time.sleep(0.3)
    open(sys.argv[2], "a").write("thread\\n")
threading.Thread(target=late).start()
print(json.dumps({"argv": sys.argv[1:], "x": os.environ.get("MMPIPE_X"), "cwd": os.getcwd(), "path0": sys.path[0],
                  "main": __name__, "file": __file__, "mmpipe": "mmpipe" in sys.modules}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_rank_runs_the_script_as_a_fresh_interpreter(tmp_path):
    import json
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    marks = tmp_path / "marks"
    env = _env({"MMPIPE_X": "42"})
    assert preloaded_ranks.usable(env)
    got = run_processes([[str(script), "3", str(marks)]], [env], timeout=60)
    fresh = subprocess.run([sys.executable, "-u", str(script), "3", str(tmp_path / "fresh")], cwd=ROOT, env=env,
                           capture_output=True, text=True)
    assert got.returncode == fresh.returncode == 3
    ours, theirs = json.loads(got.stdout), json.loads(fresh.stdout)
    assert ours.pop("argv") == ["3", str(marks)] and theirs.pop("argv") == ["3", str(tmp_path / "fresh")]
    assert ours == theirs == {"x": "42", "cwd": ROOT, "path0": str(tmp_path), "main": "__main__", "file": str(script),
                              "mmpipe": False}, (ours, theirs)
    assert got.stderr.strip() == fresh.stderr.strip() == "to stderr"
    assert marks.read_text().split() == (tmp_path / "fresh").read_text().split() == ["thread", "atexit"]


def test_an_environment_read_at_import_starts_plain_processes():
    env = _env(None)
    assert preloaded_ranks.usable(env)
    assert preloaded_ranks.usable(dict(env, RANK="1", MASTER_PORT="1234", MMPIPE_PLUGINS="x"))
    assert not preloaded_ranks.usable(dict(env, HF_HUB_CACHE="/elsewhere"))
    assert not preloaded_ranks.usable(dict(env, OMP_NUM_THREADS="7"))
    assert not preloaded_ranks.usable({k: v for k, v in env.items() if k != "PATH"})
