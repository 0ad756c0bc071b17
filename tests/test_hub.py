"""Hub ids where a config takes pretrained weights (``mmpipe.config.hub``): a cache laid out as
huggingface_hub lays it out (``models--org--name/refs/main``, ``snapshots/<commit>/``), built here from
tiny save_pretrained directories, with ``HF_HUB_CACHE`` set and ``HF_HUB_OFFLINE=1``: nothing touches the
network. The id resolves to its snapshot, ``@revision`` to another, the run's config.yaml keeps the pin,
a run given the id trains as the same directory given by path, and each way it can fail is one line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, TINY, TINY_VLM, _env, train_losses

import mmpipe
from mmpipe.errors import ConfigError

C1, C2 = "1" * 40, "2" * 40


def _tiny_clip_dir(path: str, scale: float, tok) -> None:
    """A tiny CLIPModel directory with its tokenizer (one trained on the test captions)."""
    from transformers import CLIPConfig, CLIPModel

    from mmpipe.data.tokenizer import eos_id
    cfg = CLIPConfig(text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                      vocab_size=len(tok), max_position_embeddings=16, eos_token_id=eos_id(tok),
                                      bos_token_id=None, pad_token_id=0),
                     vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, image_size=32, patch_size=8),
                     projection_dim=16, logit_scale_init_value=scale)
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def _snapshot(cache: str, repo: str, commit: str, src: str, ref: str = None) -> str:
    base = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snap = os.path.join(base, "snapshots", commit)
    shutil.copytree(src, snap)
    if ref:
        os.makedirs(os.path.join(base, "refs"), exist_ok=True)
        with open(os.path.join(base, "refs", ref), "w") as fh:
            fh.write(commit)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_data):
    from mmpipe.data.manifest import read_manifest
    from mmpipe.data.tokenizer import train_tokenizer
    d = tmp_path_factory.mktemp("hub")
    cache = str(d / "cache")
    tok = train_tokenizer([s.text for s in read_manifest(tiny_data["train"])], 300, str(d / "tokenizer"))
    _tiny_clip_dir(str(d / "clip_a"), 2.6592, tok)
    _tiny_clip_dir(str(d / "clip_b"), 1.0, tok)
    snaps = {"main": _snapshot(cache, "tiny-org/clip", C1, str(d / "clip_a"), "main"),
             "v2": _snapshot(cache, "tiny-org/clip", C2, str(d / "clip_b"), "v2")}
    return {"cache": cache, "snaps": snaps, "path_a": str(d / "clip_a")}


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", hub["cache"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_an_id_resolves_to_its_snapshot_and_a_revision_to_another(offline):
    cfg = mmpipe.load_config(TINY, ["model.pretrained=tiny-org/clip"])
    assert cfg.model.pretrained == offline["snaps"]["main"]
    assert cfg.hub == {"model.pretrained": f"tiny-org/clip@{C1}"}
    cfg = mmpipe.load_config(TINY, ["model.pretrained=tiny-org/clip@v2"])
    assert cfg.model.pretrained == offline["snaps"]["v2"] and cfg.hub["model.pretrained"] == f"tiny-org/clip@{C2}"
    cfg = mmpipe.load_config(TINY, [f"model.pretrained=tiny-org/clip@{C2}"])  # the pin a run's config.yaml keeps
    assert cfg.model.pretrained == offline["snaps"]["v2"]
    cfg = mmpipe.load_config(TINY, [f"model.pretrained={offline['path_a']}"])  # a local directory: as given
    assert cfg.model.pretrained == offline["path_a"] and cfg.hub == {}


def test_a_local_directory_named_like_an_id_wins(offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(offline["path_a"], "tiny-org/clip")
    cfg = mmpipe.load_config(TINY, ["model.pretrained=tiny-org/clip"])
    assert cfg.model.pretrained == "tiny-org/clip" and cfg.hub == {}


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_a_resume_refuses_a_hub_id_that_moved():
    from mmpipe.train.resume_checks import check_hub
    check_hub("ck", {"model.pretrained": f"a/b@{C1}"}, {"model.pretrained": f"a/b@{C1}"})
    check_hub("ck", {"model.pretrained": f"a/b@{C1}"}, {})  # now given by path: the fingerprints decide
    with pytest.raises(mmpipe.errors.MmpipeError) as e:
        check_hub("ck", {"model.pretrained": f"a/b@{C1}"}, {"model.pretrained": f"a/b@{C2}"})
    assert f"--set model.pretrained=a/b@{C1}" in _one_line(e)


@pytest.mark.parametrize("error,words", [
    ("GatedRepoError", ["gated", "HF_TOKEN"]),
    ("RepositoryNotFoundError", ["not found on the hub", "HF_TOKEN"]),
    ("RevisionNotFoundError", ["no revision 'v7'", "@main"]),
])
def test_what_the_hub_answers_is_one_line(hub, tmp_path, monkeypatch, error, words):
    """Online (nothing reaches a hub from here: huggingface_hub's own exceptions stand in for its answers):
    a gated or private repository without a token, and a revision the hub does not have, are one line
    naming the id and the fix."""
    import importlib

    from huggingface_hub import errors
    httpx = importlib.import_module(errors.HfHubHTTPError.__mro__[1].__module__.split(".")[0])  # (httpx or httpx2)

    import mmpipe.config.hub as hubmod
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co"))

    def answer(repo, revision, cache, patterns, local_only):
        if local_only:
            raise FileNotFoundError(repo)
        raise getattr(errors, error)("the hub's answer", response=response)
    monkeypatch.setattr(hubmod, "_snapshot", answer)
    with pytest.raises(ConfigError) as e:
        mmpipe.load_config(TINY, ["model.pretrained=tiny-org/private@v7"])
    msg = _one_line(e)
    assert "model.pretrained" in msg and "tiny-org/private" in msg and all(w in msg for w in words), msg


def test_each_failure_is_one_line(offline, tmp_path):
    with pytest.raises(ConfigError) as e:  # not cached, offline
        mmpipe.load_config(TINY, ["model.pretrained=tiny-org/absent"])
    msg = _one_line(e)
    assert "model.pretrained" in msg and "tiny-org/absent" in msg and "huggingface-cli download tiny-org/absent" in msg
    assert "HF_HUB_OFFLINE" in msg
    with pytest.raises(ConfigError) as e:  # a revision the cache does not have
        mmpipe.load_config(TINY, ["model.pretrained=tiny-org/clip@v9"])
    assert "--revision v9" in _one_line(e)
    # a snapshot whose index names a shard it lacks
    snap = _snapshot(offline["cache"], "tiny-org/sharded", "3" * 40, offline["path_a"], "main")
    with open(os.path.join(snap, "model.safetensors.index.json"), "w") as fh:
        json.dump({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}, fh)
    with pytest.raises(ConfigError) as e:
        mmpipe.load_config(TINY, ["model.pretrained=tiny-org/sharded"])
    msg = _one_line(e)
    assert "model-00002-of-00002.safetensors" in msg and "huggingface-cli download tiny-org/sharded" in msg


def test_a_value_that_is_neither_a_directory_nor_an_id_and_a_mistyped_directory_say_so(offline, tmp_path, monkeypatch):
    """A value that is no directory and no id (a bare name, a trailing @, the model page's address) says so in one
    line (the address: with the id to give); an id-shaped value (a mistyped relative directory) says first that no
    such directory is here, then the hub's answer; no message claims "nothing is downloaded"."""
    monkeypatch.chdir(tmp_path)
    for value, words in (("Qwen2.5-VL-3B-Instruct", [f"neither a local save_pretrained directory (there is none at "
                                                     f"{tmp_path}/Qwen2.5-VL-3B-Instruct) nor a hub id"]),
                         ("Qwen/Qwen2.5-VL-3B-Instruct@", ["neither a local", "nor a hub id (org/name"]),
                         ("https://huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct", ["is a web address: give the hub id "
                                                                                 "Qwen/Qwen2.5-VL-3B-Instruct"]),
                         ("checkpoints/qwen_base", [f"no directory checkpoints/qwen_base here (cwd {tmp_path}); as a "
                                                   "hub id: checkpoints/qwen_base is not in the Hugging Face cache"])):
        with pytest.raises(ConfigError) as e:
            mmpipe.build_model(mmpipe.load_config(TINY_VLM, [f"model.pretrained={value}"]))
        msg = _one_line(e)
        assert msg.startswith("model.pretrained: ") and all(w in msg for w in words), msg
        assert "nothing is downloaded" not in msg


def _train(tiny_data, out: str, env: dict, cwd: str, sets: list, flags=()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "--config", TINY,
           "--set", f"data.train={tiny_data['train']}", "--set", f"data.val={tiny_data['val']}",
           "--set", f"train.output_dir={out}", "--set", "parallel.pipeline_stages=1", "--set", "train.steps=3",
           "--set", "train.eval_every=0"]
    for item in sets:
        cmd += ["--set", item]
    return subprocess.run(cmd + list(flags), capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


@pytest.mark.dist
def test_a_run_given_the_id_trains_as_the_directory_pins_it_and_resumes_and_exports(hub, tiny_data, tmp_path,
                                                                                        monkeypatch):
    """The same CLIP trained from ``tiny-org/clip`` (offline, from the cache) and from the directory the
    snapshot was made from: the same losses. The run's config.yaml keeps ``tiny-org/clip@<commit>``; after
    ``main`` moves upstream to another commit, a resume given the id is refused in one line, one given the
    pin continues to the end, and the run exports."""
    import yaml

    from mmpipe.train.export import export
    cache = str(tmp_path / "cache")
    shutil.copytree(hub["cache"], cache)  # (this test moves refs/main)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = dict(_env(), HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1")
    outs = {}
    for name, value in (("id", "tiny-org/clip"), ("path", hub["path_a"])):
        outs[name] = str(tmp_path / name)
        proc = _train(tiny_data, outs[name], env, str(tmp_path), [f"model.pretrained={value}"], ["--stop-at", "2"])
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert train_losses(outs["id"]) == train_losses(outs["path"])
    with open(os.path.join(outs["id"], "config.yaml")) as fh:
        assert yaml.safe_load(fh)["model"]["pretrained"] == f"tiny-org/clip@{C1}"
    with open(os.path.join(cache, "models--tiny-org--clip", "refs", "main"), "w") as fh:
        fh.write(C2)  # upstream's main moved
    proc = _train(tiny_data, outs["id"], env, str(tmp_path), ["model.pretrained=tiny-org/clip"], ["--resume"])
    assert proc.returncode != 0
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("mmpipe: error:")]
    assert line and f"tiny-org/clip@{C2}" in line[0] and f"--set model.pretrained=tiny-org/clip@{C1}" in line[0], \
        proc.stderr[-2000:]
    proc = _train(tiny_data, outs["id"], env, str(tmp_path), [f"model.pretrained=tiny-org/clip@{C1}"], ["--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(train_losses(outs["id"])) == 3
    export(outs["id"], str(tmp_path / "exported"))
    from transformers import CLIPModel
    assert CLIPModel.from_pretrained(str(tmp_path / "exported")).config.projection_dim == 16


FAKE_DOWNLOAD = r'''
import os, shutil, sys, time
import mmpipe.config.hub as hub
src, log = sys.argv[1], sys.argv[2]

def slow_download(value, repo, revision, cache, patterns, key):  # as the hub would: files land one by one
    with open(log, "a") as fh:
        fh.write(f"download {os.getpid()}\n")
    base = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snap = os.path.join(base, "snapshots", "4" * 40)
    os.makedirs(snap, exist_ok=True)
    for name in sorted(os.listdir(src), key=lambda n: n != "config.json"):  # config.json first: a reader
        time.sleep(0.5)                                                       # too early would see it alone
        shutil.copy(os.path.join(src, name), os.path.join(snap, name))
    os.makedirs(os.path.join(base, "refs"), exist_ok=True)
    with open(os.path.join(base, "refs", "main"), "w") as fh:
        fh.write("4" * 40)
    return snap

hub._download = slow_download
r = hub.resolve("tiny-org/slow", "model.pretrained")
complete = sorted(os.listdir(r.path)) == sorted(os.listdir(src))
with open(log, "a") as fh:
    fh.write(f"read {os.getpid()} {r.path} {r.pin} {complete}\n")
'''


def test_processes_of_a_machine_download_once_and_read_the_same_snapshot(hub, tmp_path):
    """Three processes resolve an id missing from the cache at once (online; the download faked, slow,
    file by file): one downloads, the others wait for it and then read the complete snapshot."""
    cache, log = str(tmp_path / "cache"), str(tmp_path / "log")
    script = tmp_path / "resolve.py"
    script.write_text(FAKE_DOWNLOAD)
    env = dict(_env(), HF_HUB_CACHE=cache)
    env.pop("HF_HUB_OFFLINE", None)
    procs = [subprocess.Popen([sys.executable, str(script), hub["path_a"], log], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    lines = open(log).read().splitlines()
    assert sum(line.startswith("download ") for line in lines) == 1, lines
    reads = [line.split() for line in lines if line.startswith("read ")]
    assert len(reads) == 3 and len({r[2] for r in reads}) == 1 and all(r[4] == "True" for r in reads), reads
    assert all(r[3] == "tiny-org/slow@" + "4" * 40 for r in reads)


def test_plan_sizes_a_model_from_its_config_files_alone(offline, tmp_path, capsys):
    """``mmpipe plan`` on an id whose cached snapshot holds its config files and a sharded checkpoint's index
    but no weights sizes the model (on the meta device); training from the same id, offline, is refused in
    one line naming the missing shard."""
    from safetensors import safe_open

    from mmpipe.cli.main import main
    snap = _snapshot(offline["cache"], "tiny-org/config-only", "6" * 40, offline["path_a"], "main")
    with safe_open(os.path.join(snap, "model.safetensors"), "pt") as fh:
        names = list(fh.keys())
    with open(os.path.join(snap, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}, fh)
    os.remove(os.path.join(snap, "model.safetensors"))
    out = str(tmp_path / "plan")
    assert main(["plan", "--config", TINY, "--world", "2", "--meta", "--out", out,
                 "--set", "model.pretrained=tiny-org/config-only"]) == 0
    assert "chosen:" in capsys.readouterr().out
    with pytest.raises(ConfigError) as e:
        mmpipe.load_config(TINY, ["model.pretrained=tiny-org/config-only"])
    assert "tiny-org/config-only" in _one_line(e) and "model-00001-of-00001.safetensors" in _one_line(e)


@pytest.mark.dist
def test_qwen2_5_vl_given_the_id_trains_as_its_directory(tiny_native_chat_data, tmp_path, monkeypatch):
    """Qwen2.5-VL from ``tiny-org/qwen`` (offline, a cache snapshot of a tiny save_pretrained directory with
    its processor and tokenizer) and from that directory: the same losses, two steps on mixed-size images."""
    from mmpipe.families.qwen_vl.tiny import write_tiny_qwen2_5_vl
    d = write_tiny_qwen2_5_vl(str(tmp_path / "qwen"), seed=2)
    cache = str(tmp_path / "cache")
    _snapshot(cache, "tiny-org/qwen", C1, d, "main")
    env = dict(_env(), HF_HUB_CACHE=cache, HF_HUB_OFFLINE="1")
    losses = {}
    for name, value in (("id", "tiny-org/qwen"), ("path", d)):
        (tmp_path / f"{name}.yaml").write_text(
            f"model: {{type: qwen2_5_vl, pretrained: {value}}}\n"
            f"data: {{train: {tiny_native_chat_data['train']}, max_length: 256, num_workers: 0, min_pixels: 3136, "
            "max_pixels: 12544}\n"
            f"parallel: {{pipeline_stages: 1, micro_batch_size: 2}}\n"
            f"train: {{steps: 2, batch_size: 4, output_dir: {tmp_path / name}, eval_every: 0, save_every: 0}}\n"
            "log: {progress: false}\n")
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--config",
                               str(tmp_path / f"{name}.yaml")], capture_output=True, text=True, env=env,
                              cwd=str(tmp_path), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[name] = train_losses(str(tmp_path / name))
    assert len(losses["id"]) == 2 and losses["id"] == losses["path"]


def test_a_llava_given_by_id_is_the_directory_given_by_path(tmp_path, monkeypatch):
    """A LLaVA-style VLM from ``tiny-org/llava`` (offline) builds the model the directory builds: every
    weight equal, transformers' own weights."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                       image_size=32, patch_size=8),
        text_config=LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=100, max_position_embeddings=64),
        image_token_id=99))
    d = str(tmp_path / "llava")
    model.save_pretrained(d)
    cache = str(tmp_path / "cache")
    _snapshot(cache, "tiny-org/llava", C1, d, "main")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sets = ["model.type=vlm", "model.image_token_id=99"]
    by_id = mmpipe.build_model(mmpipe.load_config(None, sets + ["model.pretrained=tiny-org/llava"]))
    by_path = mmpipe.build_model(mmpipe.load_config(None, sets + [f"model.pretrained={d}"]))
    a, b = by_id.state_dict(), by_path.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    emb = model.get_input_embeddings().weight
    assert any(v.shape == emb.shape and torch.equal(v, emb) for v in a.values())
