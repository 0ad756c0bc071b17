"""The commands around training, as a user calls them: `mmpipe generate` (--eval asks the first user
turn as training encoded it, with the images its markers name; its arguments), `mmpipe plan` (odd
--world / --memory-gb, nothing that fits, --run of a short run), `mmpipe data prepare` of a VLM
config, `mmpipe report`'s axes, and a bench's temporary directory (issue 37 items 4, 10, 14, 15,
17, 19, 20)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import TINY, TINY_VLM, launch

from mmpipe.cli.main import main


def _one_line_error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("mmpipe: error: "), err
    return lines[0]


# ---- mmpipe generate (a tiny VLM trained two steps, one process) ------------------------------------------------
@pytest.fixture(scope="module")
def vlm_run(tiny_chat_data, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("gen") / "run")
    sets = [f"data.train={tiny_chat_data['train']}", f"data.val={tiny_chat_data['val']}", f"train.output_dir={run}",
            "train.steps=2", "parallel.pipeline_stages=1"]
    launch(1, ["--config", TINY_VLM] + [a for s in sets for a in ("--set", s)], launcher="python")
    return run


def _images(tiny_chat_data, n: int) -> list:
    from mmpipe.families.chat import read_chat
    return [p for s in read_chat(tiny_chat_data["val"]) + read_chat(tiny_chat_data["train"]) if s.error is None
            for p in s.images][:n]


def _eval_file(path, images: list) -> str:
    """Conversations whose first user turn has no image (its image belongs to turn 3), two images,
    a marker after the question (as LLaVA-1.5's data writes some), and one image of two."""
    a, b, c = images
    rows = [
        {"messages": [{"role": "user", "content": "what colour is the sky?"}, {"role": "assistant", "content": "blue"},
                      {"role": "user", "content": "<image>\nwhat kind of shape is shown?"},
                      {"role": "assistant", "content": "square"}], "images": [a]},
        {"messages": [{"role": "user", "content": "<image>\n<image>\nwhat colour are the shapes?"},
                      {"role": "assistant", "content": "red"}], "images": [b, c]},
        {"messages": [{"role": "user", "content": "what colour are the shapes?\n<image>"},
                      {"role": "assistant", "content": "green"}], "images": [c]},
        {"messages": [{"role": "system", "content": "answer in one word"},
                      {"role": "user", "content": "<image>\nwhat colour is it?"}, {"role": "assistant", "content": "red"},
                      {"role": "user", "content": "and this one?\n<image>"}, {"role": "assistant", "content": "blue"}],
         "images": [a, b]},
    ]
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.mark.dist
def test_eval_asks_the_first_user_turn_as_training_encoded_it(vlm_run, tiny_chat_data, tmp_path, monkeypatch):
    """Item 4: --eval's prompt ids are training's chat encoder's tokens of the conversation up to the
    first learned token (the first user turn's text with its <image> markers where they stand, and
    the assistant header), and the pixels are the images that turn's markers name: none, one of two,
    two in order; a trailing marker stays at the end."""
    from mmpipe.cli.generate import Generator, exact_match
    from mmpipe.families.chat import read_chat
    from mmpipe.families.chat.generate import ChatGenerator
    path = _eval_file(tmp_path / "eval.jsonl", _images(tiny_chat_data, 3))
    asked, real = [], ChatGenerator.prompt

    def recorded(self, *a, **k):  # the real prompt, kept
        out = real(self, *a, **k)
        asked.append(out)
        return out
    monkeypatch.setattr(ChatGenerator, "prompt", recorded)
    r = exact_match(vlm_run, path, progress=False)
    monkeypatch.undo()
    assert r["n"] == 4 and len(asked) == 4 and not r["skipped"]
    g = Generator(vlm_run)
    want_images = [0, 2, 1, 1]  # how many of the sample's images its first user turn names
    for sample, (ids, pix), k in zip(read_chat(path), asked, want_images):
        enc = g.encoder.encode(sample)
        first_learned = next(i for i, t in enumerate(enc.labels) if t != -100)
        assert ids[0].tolist() == enc.input_ids[:first_learned], sample.where
        assert int((ids == g.family.image_token_id).sum()) == k * g.family.n_image_tokens()
        if k == 0:
            assert pix is None
        else:
            assert torch.equal(pix["pixel_values"], g.images(sample.images[:k])["pixel_values"])
    assert r["examples"][1]["images"] == list(read_chat(path)[1].images)
    assert r["examples"][0]["images"] == [] and r["exact_match_image_questions"] == pytest.approx(
        sum(e["want"] == e["got"] for e in r["examples"][1:]) / 3)


@pytest.mark.dist
def test_generate_takes_several_images_in_order_and_one_image_goes_first(vlm_run, tiny_chat_data):
    """The list of images reaches transformers' model in marker order (its logits equal mmpipe's own
    model's; swapped images give others); --image with a prompt without a marker puts it first."""
    import mmpipe
    from mmpipe.cli.generate import Generator
    from mmpipe.errors import ConfigError
    a, b = _images(tiny_chat_data, 2)
    g = Generator(vlm_run)
    ids, pix = g.prompt("<image>\nwhat colour?\n<image>", [a, b])
    pix = pix["pixel_values"]
    model = mmpipe.build_model(mmpipe.load_config(os.path.join(vlm_run, "config.yaml"))).eval()
    model.load_state_dict(mmpipe.load_weights(vlm_run))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = model.eval_outputs(pix, ids, mask)[0, -1]
        theirs = g.model(input_ids=ids, attention_mask=mask, pixel_values=pix).logits[0, -1]
        swapped = g.model(input_ids=ids, attention_mask=mask, pixel_values=pix.flip(0)).logits[0, -1]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(swapped, ours, rtol=1e-5, atol=1e-5)
    one, _ = g.prompt("what colour?", a)
    assert one[0].tolist() == g.encoder.prompt_ids((("user", "<image>\nwhat colour?"),), [a])
    with pytest.raises(ConfigError, match="1 <image> marker.* but 2 image"):
        g.prompt("<image>\nwhat colour?", [a, b], what="eval.jsonl line 1: image")


@pytest.mark.dist
def test_generate_arguments(vlm_run, tiny_chat_data, tmp_path, capsys, monkeypatch):
    """Items 10 and 15: --max-new-tokens below 1 and --limit below 1 are one line each; --eval gives
    every answer --max-new-tokens (not 24), and --limit N scores N questions."""
    from mmpipe.families.chat.generate import ChatGenerator as Generator  # the class whose method is recorded
    image = _images(tiny_chat_data, 1)[0]
    ask = ["generate", "--run", vlm_run, "--image", image, "--prompt", "what colour are the shapes?"]
    for n in ("0", "-3"):
        assert "--max-new-tokens" in _one_line_error(capsys, ask + ["--max-new-tokens", n])
    val = tiny_chat_data["val"]
    for n in ("-1", "0"):
        assert "--limit" in _one_line_error(capsys, ["generate", "--run", vlm_run, "--eval", val, "--limit", n])
    budgets, real = [], Generator.generate_ids

    def recorded(self, prompt, image=None, max_new_tokens=None, *a, **k):
        budgets.append(max_new_tokens)
        return real(self, prompt, image, max_new_tokens, *a, **k)
    monkeypatch.setattr(Generator, "generate_ids", recorded)
    assert main(["generate", "--run", vlm_run, "--eval", val, "--limit", "3", "--max-new-tokens", "1"]) == 0
    assert budgets == [1, 1, 1]
    assert "on 3 held-out questions" in capsys.readouterr().out


@pytest.mark.dist
def test_generate_takes_several_images_in_order(vlm_run, tiny_chat_data, capsys, monkeypatch):
    """``--image`` repeated: a multi-image prompt, the images in order (all first when the prompt has no
    marker; else one per marker); a marker count that differs is one line. (It kept the last image.)"""
    from mmpipe.families.chat.generate import ChatGenerator as Generator
    a, b = _images(tiny_chat_data, 2)
    asked, real = [], Generator.generate_ids

    def recorded(self, prompt, image=None, *args, **kw):
        asked.append((prompt, image))
        return real(self, prompt, image, *args, **kw)
    monkeypatch.setattr(Generator, "generate_ids", recorded)
    base = ["generate", "--run", vlm_run, "--max-new-tokens", "1", "--image", a, "--image", b]
    assert main(base + ["--prompt", "what colour are the shapes?"]) == 0
    assert asked[-1] == ("<image>\n<image>\nwhat colour are the shapes?", [a, b])
    assert main(base + ["--prompt", "<image> left, <image> right: same colour?"]) == 0
    assert asked[-1] == ("<image> left, <image> right: same colour?", [a, b])
    assert "2 image(s)" in _one_line_error(capsys, base + ["--prompt", "<image>\nwhat colour?"])


# ---- mmpipe plan ------------------------------------------------------------------------------------------------
def test_plan_refuses_odd_world_and_budget_in_one_line(capsys, tmp_path, monkeypatch):
    """Item 14: --world below 1 and --memory-gb of 0 or less are one line naming the flag."""
    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path / "cache"))
    base = ["plan", "--config", TINY_VLM, "--meta", "--out", str(tmp_path / "plan")]
    for w in ("-2", "0"):
        assert f"--world {w}" in _one_line_error(capsys, base + ["--world", w])
    for m in ("0", "-5"):
        assert f"--memory-gb {m}" in _one_line_error(capsys, base + ["--world", "2", "--memory-gb", m])


def test_plan_where_nothing_fits_prints_the_table_then_a_short_line(capsys, tmp_path, monkeypatch):
    """Item 14: the table of the sizes asked for, then one short line naming --memory-gb."""
    monkeypatch.setenv("MMPIPE_CACHE", str(tmp_path / "cache"))
    rc = main(["plan", "--config", TINY, "--set", "model.text.vocab_size=300", "--meta", "--world", "2",
               "--memory-gb", "0.000001", "--out", str(tmp_path / "plan")])
    out, err = capsys.readouterr()
    assert rc == 2
    rows = [line for line in out.splitlines() if line.startswith("| ") and "layout" not in line]
    assert len(rows) >= 3 and all(" no: " in row for row in rows), out  # DP (ZeRO 0-3), P2 ... each with its peak
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--memory-gb 1e-06" in lines[0] and len(lines[0]) < 300, err


def test_plan_run_of_three_steps_prints_memory_rows_and_says_why_no_timing(capsys, tmp_path):
    """Item 10: `mmpipe plan --run` of a run with 3 steps or fewer: the memory rows, and one line
    saying the timing rows need more than 3 steps (not a traceback)."""
    from mmpipe.config.schema import load_config
    from mmpipe.planning.offline import resolve_for_plan
    sets = ["model.text.vocab_size=300"]
    n = len(resolve_for_plan(load_config(TINY, sets))[1].layer_names())
    run = tmp_path / "run"
    (run / "memory").mkdir(parents=True)
    (run / "config.yaml").write_text(open(TINY).read())
    (run / "plan.json").write_text(json.dumps({"parts": [0, n // 2, n], "micro_batches": 2}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"kind": "train", "step": s, "loss": 1.0, "step_time": 0.1, "stage0.idle": 0.1, "stage0.busy": 0.9,
         "stage1.idle": 0.2, "stage1.busy": 0.8}) + "\n" for s in (1, 2, 3)))
    for rank in (0, 1):
        (run / "memory" / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "stage": rank,
                                                                    "peak": {"total": 50 * 2**20}}))
    assert main(["plan", "--run", str(run), "--config", TINY, "--set", sets[0], "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "| rank 0 (stage 0) peak MB |" in out and "| rank 1 (stage 1) peak MB |" in out
    assert "| step ms |" not in out and "more than 3 steps" in out


# ---- mmpipe data prepare, mmpipe report, benches ----------------------------------------------------------------
def test_data_prepare_of_a_vlm_config_says_it_has_no_cache(capsys, tiny_chat_data, tmp_path):
    """Item 17: the VLM trains from its chat file; `data prepare` says so in one line."""
    line = _one_line_error(capsys, ["data", "prepare", "--config", TINY_VLM, "--set",
                                    f"data.train={tiny_chat_data['train']}", "--out", str(tmp_path / "cache")])
    assert "model.type=vlm" in line and "no cache" in line and "chat file" in line
    assert not os.path.exists(tmp_path / "cache")


def test_report_draws_eval_losses_on_the_loss_axis_and_ratios_on_the_other():
    """Item 19: a VLM's val_loss beside the training loss; token_accuracy (a ratio) on the second axis."""
    from mmpipe.cli.report import _loss_chart, _plt
    recs = [{"kind": "train", "step": s, "loss": 3.0 - 0.1 * s} for s in range(1, 5)]
    evals = [{"kind": "eval", "step": s, "val_loss": 1.1, "token_accuracy": 0.4, "val_tokens": 10} for s in (2, 4)]
    plt = _plt()
    fig = _loss_chart(plt, recs, evals)
    labels = [[line.get_label() for line in ax.get_lines()] for ax in fig.axes]
    plt.close(fig)
    assert labels == [["train loss", "eval val_loss"], ["eval token_accuracy"]]


def test_a_bench_removes_its_temporary_directory(tmp_path, monkeypatch, capsys):
    """Item 20: `mmpipe bench data` leaves no mmpipe-bench-* directory behind."""
    import tempfile
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    assert main(["bench", "data", "--n", "16", "--repeats", "1", "--workers", "0", "--no-append"]) == 0
    assert "mmpipe cache" in capsys.readouterr().out
    assert not [p for p in os.listdir(scratch) if p.startswith("mmpipe-bench-")]


def test_train_ends_by_destroying_its_process_groups(tiny_data, tmp_path, monkeypatch):
    """A run that finished, or stopped at a one-line error, leaves no process group to the interpreter's
    exit (gloo's worker threads torn down there abort the process with "terminate called without an active
    exception", exit -6, whatever the run's own exit); a second run in the same process starts a fresh one."""
    import deepspeed.comm
    import torch.distributed as dist

    from mmpipe.cli.main import main
    if dist.is_initialized():  # (an earlier test's in this process: not the command's to end)
        deepspeed.comm.destroy_process_group()
    for i in range(2):
        rc = main(["train", "--config", TINY, "--set", f"data.train={tiny_data['train']}", "--set", "train.steps=2",
                   "--set", f"train.output_dir={tmp_path / str(i)}", "--set", "parallel.pipeline_stages=1",
                   "--set", "train.save=false", "--set", "train.eval_every=0", "--set", "log.progress=false"])
        assert rc == 0 and not dist.is_initialized()
        assert (tmp_path / str(i) / "metrics.jsonl").exists()
    # a one-line error after the group was made (raised where the model is built) ends it too
    from mmpipe.errors import ConfigError
    from mmpipe.train import setup

    def refuse(*a, **k):
        assert dist.is_initialized()
        raise ConfigError("model: refused here")
    monkeypatch.setattr(setup, "build_family", refuse)
    rc = main(["train", "--config", TINY, "--set", f"data.train={tiny_data['train']}",
               "--set", f"train.output_dir={tmp_path / '2'}", "--set", "parallel.pipeline_stages=1"])
    assert rc == 2 and not dist.is_initialized()
