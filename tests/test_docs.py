"""Every command the README and docs/ show in a fenced shell block is run here, or listed with the
reason it is not (it trains for minutes, needs several nodes, or is the suite itself). A command
added to the docs that matches no rule below fails ``test_every_docs_command_has_a_rule``."""
from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest
from helpers import ROOT, TINY_CONFIGS, _env

RUN = "run"
LONG_RUN = ("trains the demo config for minutes; the same launch line runs on the tiny config in "
            "tests/test_parity.py and tests/test_launch.py")
RULES = [  # (command regex, RUN or the reason it is not run here)
    (r"^mmpipe data synth ", RUN),
    (r"^python launch/train\.py --config configs/tiny_vlm\.yaml .*optim\.train_type=lora", RUN),
    (r"^mmpipe export --run runs/tiny_vlm ", RUN),
    (r"^mmpipe export --run runs/demo ", "needs make demo's run; test_docs_python_snippet trains and exports one"),
    (r"^mmpipe data check ", RUN),
    (r"^mmpipe data prepare ", RUN),
    (r"^pip install ", "installs the package; .ci/run does it on a fresh machine"),
    (r"^make (test|test-fast)$", "the test suite itself"),
    (r"^make demo(-vlm|-qwen|-qwen3_5)?$", "trains for minutes (the demo); its parts run in tests/test_parity.py and test_vlm_runs.py"),
    (r"^mmpipe plan --config configs/demo\.yaml$", "profiles every layer of the demo model (a minute); "
                                                    "tests/test_balance_runs.py runs mmpipe plan on the tiny config"),
    (r"^mmpipe plan .*--run ", "needs a finished demo run (make demo)"),
    (r"^mmpipe plan --config configs/(clip_vit_l14|llava_1_5_7b|qwen2_5_vl_7b|qwen3_5_9b|qwen3_vl_8b|siglip_b16)\.yaml --world 8 --memory-gb 80$",
     RUN),
    (r"^mmpipe plan --config configs/siglip_b16\.yaml --world (64|256) --memory-gb 80$", RUN),
    (r"^mmpipe plan --config configs/(qwen3_5_35b_a3b|qwen3_vl_30b_a3b)\.yaml --world (8|16) --memory-gb 80$", RUN),
    (r"^mmpipe plan --config configs/llava_1_5_7b\.yaml --world 8 --memory-gb 80 --gpu-kernels --set optim\.train_type=lora$",
     RUN),
    (r"^mmpipe plan .*--world ", "measures collectives at 4 ranks (minutes); tests/test_layout.py runs --world 2"),
    (r"^mmpipe bench ", "a benchmark (minutes): results in BENCHMARKS.md"),
    (r"^mmpipe generate --run runs/demo_vlm ", "needs make demo-vlm's run; tests/test_vlm_runs.py generates from a run"),
    (r"^mmpipe generate --run runs/demo_qwen ", "needs make demo-qwen's run; tests/test_qwen2_5_vl.py generates from a run"),
    (r"^mmpipe generate --run runs/demo_qwen3_5 ", "needs make demo-qwen3_5's run; tests/test_qwen3_5.py generates from a run"),
    (r"^(deepspeed|torchrun|accelerate launch|python launch/train\.py) .*--config configs/demo\.yaml", LONG_RUN),
    (r"--config C\b", "C stands for the reader's config; these launch lines run on the tiny config in "
                      "tests/test_launch.py, test_faults.py (--stop-at, --resume), test_new_user.py (--overwrite) and "
                      "test_clusters.py (srun, mpirun, torchrun --max-restarts, --resume auto)"),
    (r"^CONFIG=\S+ sbatch launch/slurm/train\.sbatch", "needs a Slurm cluster of GPU nodes; tests/test_clusters.py "
                                                        "submits the file to a real one-node Slurm cluster"),
    (r"^kubectl apply -f launch/k8s/pytorchjob\.yaml$", "needs a Kubernetes cluster with Kubeflow's training "
                                                        "operator; tests/test_clusters.py runs the manifest's command "
                                                        "with the variables the operator sets"),
]
PLACEHOLDERS = {"C": "configs/demo.yaml"}  # a docs placeholder, where a run rule needs a value


def docs_commands() -> list:
    """(file, command) for every line of a fenced bash block and every ``$ `` line of another block."""
    out = []
    for path in ["README.md", "ARCHITECTURE.md"] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        f = os.path.relpath(os.path.join(ROOT, path), ROOT)
        for m in re.finditer(r"```(\w*)\n(.*?)```", open(os.path.join(ROOT, f)).read(), re.S):
            lang, body = m.group(1), m.group(2).replace("\\\n", " ")
            for line in body.splitlines():
                if lang in ("bash", "sh", "shell"):
                    cmd = "" if line.lstrip().startswith("#") else line.split(" #")[0].strip()
                else:
                    cmd = line[2:].strip() if line.startswith("$ ") else ""
                if cmd:
                    out.append((f, cmd))
    return out


def rule_for(cmd: str):
    hits = [what for pattern, what in RULES if re.search(pattern, cmd)]
    return hits[0] if hits else None


def test_every_docs_command_has_a_rule():
    assert len(docs_commands()) > 20
    assert rule_for("mmpipe frobnicate --now") is None  # the check can fail
    assert [c for c in docs_commands() if rule_for(c[1]) is None] == []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory shaped like the repository root (configs, launch, ds_configs) where the docs'
    relative paths (data/synth, cache/) are written."""
    d = tmp_path_factory.mktemp("docs")
    for name in ("configs", "launch", "ds_configs"):
        os.symlink(os.path.join(ROOT, name), d / name)
    return d


def _argv(cmd: str) -> list:
    argv = [PLACEHOLDERS.get(a, a) for a in shlex.split(cmd)]
    return [sys.executable, "-m", "mmpipe.cli.main"] + argv[1:] if argv[0] == "mmpipe" else argv


# in the docs' order, so the data the later commands read was written by the earlier ones
@pytest.mark.parametrize("where,cmd", docs_commands(), ids=lambda v: v if "/" in v or v.endswith(".md") else None)
def test_docs_command(where, cmd, workdir):
    what = rule_for(cmd)
    if what != RUN:
        pytest.skip(what or "no rule")
    proc = subprocess.run(_argv(cmd), cwd=workdir, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{where}: {cmd}\n{(proc.stdout + proc.stderr)[-2000:]}"


def python_snippets() -> list:
    """(file, code) of every fenced python block of the README and docs/."""
    out = []
    for path in ["README.md", "ARCHITECTURE.md"] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        f = os.path.relpath(os.path.join(ROOT, path), ROOT)
        out += [(f, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", open(os.path.join(ROOT, f)).read(), re.S)]
    return out


@pytest.mark.parametrize("where,code", python_snippets(), ids=lambda v: v if v.endswith(".md") else None)
def test_docs_python_snippet(where, code, tmp_path):
    """Each Python snippet runs as written, in a directory holding what it names: ``runs/demo`` (the demo
    config trained two steps at P = 1) and its ``mmpipe export --format mmpipe`` in ``exported/``."""
    for name in ("configs", "launch", "ds_configs"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    steps = []
    if "runs/demo" in code:
        steps += [["mmpipe", "data", "synth", "--out", "data/synth", "--n", "120", "--size", "32"],
                  ["python", "launch/train.py", "--config", "configs/demo.yaml", "--set", "parallel.pipeline_stages=1",
                   "--set", "train.steps=2", "--set", "train.eval_every=0", "--set", "log.progress=false"]]
    if "exported/" in code:
        steps.append(["mmpipe", "export", "--run", "runs/demo", "--out", "exported/", "--format", "mmpipe"])
    for argv in steps + [["python", "-c", code]]:
        argv = [sys.executable, "-m", "mmpipe.cli.main"] + argv[1:] if argv[0] == "mmpipe" else [sys.executable] + argv[1:]
        proc = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{where}: {' '.join(argv[:6])}\n{(proc.stdout + proc.stderr)[-2000:]}"


def test_no_family_page_lists_as_missing_the_analytic_flops_its_runs_log():
    """A family whose layers describe their arithmetic (``Family.matmuls``: its runs log ``tflops``) is not
    said to lack analytic FLOPs on its page (docs/qwen2_5_vl.md said so after they landed)."""
    import re

    import mmpipe
    from mmpipe.config.resolve import build_family
    from mmpipe.families.base import MicroBatch
    for name, page in (("qwen2_5_vl", "qwen2_5_vl.md"), ("qwen3_5", "qwen3_5.md"), ("qwen3_vl", "qwen3_vl.md"), ("vlm", "vlm.md"),
                       ("siglip", "siglip.md"), ("qwen3_5_moe", "qwen_moe.md"), ("qwen3_vl_moe", "qwen_moe.md")):
        sets = (["model.text.vocab_size=200"] if name == "siglip" else
                ["model.llm.vocab_size=200", "model.image_token_id=199"])
        fam = build_family(mmpipe.load_config(TINY_CONFIGS[name], sets).model, 0)
        fam.matmuls(fam.layer_names()[0], MicroBatch(1, 8, 1))  # describes its arithmetic (raises otherwise)
        text = open(os.path.join(ROOT, "docs", page)).read()
        for para in re.findall(r"\*\*Not yet\*\*.*?(?:\n\n|$)", text, re.S):
            assert "FLOP" not in para, (page, para)
