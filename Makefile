# zerolab: two commands do everything on a fresh machine.
#   make test   set up, then run the unit tests, the multi-process tests and nbval over every chapter
#   make test-fast   the library's unit tests only (no launched ranks), in under two minutes
#   make book   set up, then execute every chapter and build the HTML book into _build/html
#   make test-kernels   make test once under each CPU kernel set torch can use here (AVX2, AVX-512,
#               the plain default, Arm's SVE): one line each; CI runs make test only
#   make site   make book, then check that no page loads anything from another host: _build/html is
#               then exactly what .github/workflows/book.yml publishes on GitHub Pages
#   make shots  full-page screenshots of the built book with headless Chromium, into _build/screenshots
#
# Set-up makes a virtual environment in .venv. If this machine's python already has a torch
# (a GPU box, say), the venv sees it; otherwise it installs the CPU build torch==2.13.0 first,
# so that no CUDA wheels are pulled. Use PYTHON=... to choose the interpreter.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.zerolab-setup
CPU_TORCH := torch==2.13.0
# One compute thread in every kernel and test: the low bits of a float sum depend on how many
# threads added it up (and on the CPU's kernels: no compared output relies on them).
export OMP_NUM_THREADS := 1

.PHONY: setup test test-fast test-kernels book site shots clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "setup: using this machine's torch"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile "$(CPU_TORCH)"
	$(PY) -m pip install -q --no-compile -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@# pip would compile every installed module to bytecode one file at a time (40 s here); this
	@# does it on every core at once. (A file some package ships that does not compile is skipped,
	@# as pip skips it.) Left out: pip, and the ~550 Hugging Face models the book never builds
	@# (it builds GPT-2 only): a fifth of the files, 10 s of set-up. A module left out still
	@# imports; it is compiled in memory then.
	@$(PY) -m compileall -q -j 0 -x '/transformers/models/(?!(auto|gpt2)/)|/site-packages/pip/' \
	  "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	@touch $@

# The suite runs in TEST_WORKERS pytest processes (pytest-xdist) that share its files: a test file,
# or a notebook with all its cells in order in one kernel, goes to one worker (--dist loadscope).
# Two keep both cores of a small machine busy while tests wait on a timeout or a new process;
# TEST_WORKERS=0 runs everything in this one process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest tests chapters labs --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg \
	  --nbval-cell-timeout=600 -p no:cacheprovider -q --durations=10 -n $(TEST_WORKERS) --dist loadscope

# the library's unit tests alone, in seconds: no test that launches ranks or processes (marked slow)
test-fast: setup
	$(PY) -m pytest tests -m "not slow" -p no:cacheprovider -q

test-kernels: setup
	$(PY) tests/run_under_each_kernel.py

# The execution cache is keyed on the notebooks by jupyter-cache; we also key it on the
# library's sources, so a change in zerolab/ re-executes every chapter.
book: setup
	@mkdir -p _build
	@h=$$(find zerolab -name '*.py' -o -name '*.txt' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16); \
	 if [ "$$(cat _build/.zerolab-sources 2>/dev/null)" != "$$h" ]; then \
	   echo "book: zerolab sources changed, chapters will be re-executed"; rm -rf _build/.jupyter_cache; \
	 fi; echo $$h > _build/.zerolab-sources
	$(VENV)/bin/jupyter-book build . -W --keep-going
	@echo "book: open _build/html/index.html"

# The published site is the book as built above, checked to load no script, style sheet or font
# from another host (MathJax included): it must work with no network.
site: book
	$(PY) scripts/check_offline.py _build/html

shots: setup
	$(PY) scripts/screenshots.py --site _build/html --out _build/screenshots

clean:
	rm -rf _build .venv
