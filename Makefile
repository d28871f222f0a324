# Two commands: `make suggest` runs the main job, `make test` runs the whole suite.
# Each creates its own virtual environment on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: suggest test lint bench fuzz clean notebooks

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,validate]'
	touch $(STAMP)

suggest: $(STAMP)
	$(BIN)/planner suggest --model 1T --chips 1024

# Two workers (CI's two cores); worksteal evens out the long validator compiles
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist worksteal

bench: $(STAMP)
	$(BIN)/python benchmarks/published_runs.py

fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest tests/test_properties.py tests/test_invariants.py

# Re-run every notebook and store its outputs (text and plots); tests/test_notebooks.py fails until this is rerun
# after a change that moves a printed figure.
notebooks: $(STAMP)
	$(BIN)/python notebooks/render.py

clean:
	rm -rf $(VENV) build *.egg-info

include benchmarks/maxtext_memory/Makefile.inc
