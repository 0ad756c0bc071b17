# mmpipe: `make test` is the README's test command (CI runs it via .ci/run).
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
NPROC ?= 2
DEMO_N ?= 4200

.PHONY: install test test-fast demo demo-vlm demo-qwen demo-qwen3_5 clean

install:
	$(PIP) install -q -e ".[test]"

# two workers, a module's tests on one (tests/conftest.py): 1.35x faster on a 2-core machine; xdist's own
# order of modules (most tests first) mixes multi-process modules with in-process ones: ordering the longest
# first ran 52 min instead of 44 (both workers then launch ranks at once, on 2 cores)
test: install
	$(PYTHON) -m pytest -q --durations=60 -n 2 --dist loadfile tests

test-fast: install
	$(PYTHON) -m pytest -q -m "not dist" tests

# Generate data, train P = 2 (image stage 0, text+loss stage 1) with the deepspeed launcher,
# print zero-shot retrieval recall on the held-out pairs. CPU here; GPUs where present.
demo: install
	@test -f data/synth/train.jsonl || mmpipe data synth --out data/synth --n $(DEMO_N) --val-fraction 0.0477
	deepspeed --num_gpus $(NPROC) launch/train.py --config configs/demo.yaml --overwrite
	@$(PYTHON) -c "from mmpipe.train.metrics import read_metrics as r; e=r('runs/demo/metrics.jsonl','eval')[-1]; \
	print(f\"demo: image->text R@1 {e['i2t_r1']:.3f} (chance {e['chance_r1']:.3f}, {e['i2t_r1']/e['chance_r1']:.0f}x) R@5 {e['i2t_r5']:.3f} | text->image R@1 {e['t2i_r1']:.3f} R@5 {e['t2i_r5']:.3f}\"); \
	s=r('runs/demo/metrics.jsonl'); print(f\"demo: loader wait {100*sum(x['loader_wait'] for x in s)/sum(x['step_time'] for x in s):.1f}% of step time; stage busy {', '.join(str(round(100*sum(x[k] for x in s)/len(s)))+'%' for k in sorted(s[0]) if k.endswith('.busy'))}\")"

# Generate a chat set, train a small LLaVA-style VLM at P = 2 (placement auto), then answer the
# held-out questions greedily (KV cache) and compare exact match with constant-answer baselines.
demo-vlm: install
	@test -f data/synth_vlm/train.jsonl || mmpipe data synth --kind vlm --out data/synth_vlm --n 4000 --size 32
	deepspeed --num_gpus $(NPROC) launch/train.py --config configs/demo_vlm.yaml --overwrite
	mmpipe generate --run runs/demo_vlm --eval data/synth_vlm/val.jsonl --limit 200
	mmpipe generate --run runs/demo_vlm --image data/synth_vlm/images/000000.jpg --prompt "what colour are the shapes?"

# The same at native resolution: a small Qwen2.5-VL on chat about images of six sizes (each its own
# image-token count), P = 2 placed by the data's measured costs, then the held-out answers.
demo-qwen: install
	@test -f data/synth_qwen/train.jsonl || mmpipe data synth --kind qwen2_5_vl --out data/synth_qwen --n 4000 --sizes mixed
	deepspeed --num_gpus $(NPROC) launch/train.py --config configs/demo_qwen.yaml --overwrite
	mmpipe generate --run runs/demo_qwen --eval data/synth_qwen/val.jsonl --limit 200
	mmpipe generate --run runs/demo_qwen --image data/synth_qwen/images/000000.jpg --prompt "what colour are the shapes?"

# Qwen3.5 on the same data: a hybrid decoder (GatedDeltaNet + gated full attention), packed rows (three
# samples or so a row, none leaking state into the next), P = 2, then the held-out answers.
demo-qwen3_5: install
	@test -f data/synth_qwen/train.jsonl || mmpipe data synth --kind qwen2_5_vl --out data/synth_qwen --n 4000 --sizes mixed
	deepspeed --num_gpus $(NPROC) launch/train.py --config configs/demo_qwen3_5.yaml --overwrite
	mmpipe generate --run runs/demo_qwen3_5 --eval data/synth_qwen/val.jsonl --limit 200
	mmpipe generate --run runs/demo_qwen3_5 --image data/synth_qwen/images/000000.jpg --prompt "what colour are the shapes?"

clean:
	rm -rf runs build *.egg-info .pytest_cache
