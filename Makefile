# The two commands a new machine needs: `make demo` and `make test`.
# Both create or reuse .venv/ and install the whole stack first (seconds when
# nothing changed).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# The main job: the token world-model recipe (data, tokenizer, pretraining, GRPO,
# held-out eval, report). DEMO_TASK=text_addition runs the small text GRPO instead.
DEMO_TASK ?= worldmodel_tokens_demo

.PHONY: setup demo test test-fast test-slow bench lint

setup:
	@bash scripts/setup_env.sh

demo: setup
	$(VENV)/bin/mmrl train task=$(DEMO_TASK) $(ARGS)

# CI runs this: lint, the default tier, then the slow tier.
test: setup lint
	bash scripts/run_tests.sh default
	bash scripts/run_tests.sh slow

test-fast: setup
	bash scripts/run_tests.sh default

test-slow: setup
	bash scripts/run_tests.sh slow

bench: setup
	bash scripts/run_tests.sh bench

# pylint checks one thing: no two places in mmrl/ keep copied logic (8+ similar lines).
# Comparing lines needs no third-party source; without the ignore list astroid follows the
# imports into torch, transformers and vllm, and the check takes minutes instead of seconds.
THIRD_PARTY := PIL,av,decord,diffusers,hydra,math_verify,matplotlib,numpy,omegaconf,psutil
THIRD_PARTY := $(THIRD_PARTY),pyarrow,ray,safetensors,tensordict,tokenizers,torch,torchmetrics
THIRD_PARTY := $(THIRD_PARTY),tqdm,transformers,vllm,wandb
lint: setup
	$(VENV)/bin/ruff check mmrl tests benchmarks
	$(VENV)/bin/pylint --disable=all --enable=duplicate-code --min-similarity-lines=8 \
		--ignored-modules=$(THIRD_PARTY) mmrl
