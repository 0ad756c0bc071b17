# mmpipe: `make test` is the README's test command (CI runs it via .ci/run).
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
NPROC ?= 2
DEMO_N ?= 4200

.PHONY: install test test-fast demo clean

install:
	$(PIP) install -q -e ".[test]"

test: install
	$(PYTHON) -m pytest -q tests

test-fast: install
	$(PYTHON) -m pytest -q tests/test_units.py tests/test_errors.py

# Generate data, train P = 2 (image stage 0, text+loss stage 1) with the deepspeed launcher,
# print zero-shot retrieval recall on the held-out pairs. CPU here; GPUs where present.
demo: install
	@test -f data/synth/train.jsonl || mmpipe data synth --out data/synth --n $(DEMO_N) --val-fraction 0.0477
	deepspeed --num_gpus $(NPROC) launch/train.py --config configs/demo.yaml --overwrite
	@$(PYTHON) -c "from mmpipe.metrics import read_metrics as r; e=r('runs/demo/metrics.jsonl','eval')[-1]; \
	print(f\"demo: image->text R@1 {e['i2t_r1']:.3f} (chance {e['chance_r1']:.3f}, {e['i2t_r1']/e['chance_r1']:.0f}x) R@5 {e['i2t_r5']:.3f} | text->image R@1 {e['t2i_r1']:.3f} R@5 {e['t2i_r5']:.3f}\"); \
	s=r('runs/demo/metrics.jsonl'); print(f\"demo: loader wait {100*sum(x['loader_wait'] for x in s)/sum(x['step_time'] for x in s):.1f}% of step time; stage busy {', '.join(str(round(100*sum(x[k] for x in s)/len(s)))+'%' for k in sorted(s[0]) if k.endswith('.busy'))}\")"

clean:
	rm -rf runs build *.egg-info .pytest_cache
