# CPU set-up: a local virtualenv with the CPU torch build pinned by constraints-cpu.txt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# test processes (pytest-xdist: whole files each, so a file's fixtures and uid ranges stay
# in one process); 1 runs the suite in this one
TEST_WORKERS ?= 2
# torch threads per test process: the cores shared out, so that the test processes (and
# the servers and ranks they start) do not oversubscribe them
TEST_THREADS ?= $(shell n=$$(( $$(nproc) / $(TEST_WORKERS) )); echo $$(( n > 0 ? n : 1 )))

.PHONY: demo test lint clean sandbox-tools slime

# slime (not on PyPI) for the real-slime tests, at the commit the hooks are tested against:
# the vendored tarball where this checkout sits beside ../shared, else GitHub (or name a
# .tar.gz, a checkout or a git URL: make test SLIME_SOURCE=...)
SLIME_COMMIT := 624b824a898ab0ec1fcb4d373004c7f3852bf515
SLIME_VENDOR := ../shared/vendor/slime-624b824a.tar.gz
SLIME_SOURCE ?= $(if $(wildcard $(SLIME_VENDOR)),$(SLIME_VENDOR),git+https://github.com/THUDM/slime@$(SLIME_COMMIT))
# Megatron-LM's training package (slime's train.py imports megatron.training; the
# megatron-core wheel does not ship it), at the tag matching the pinned megatron-core: the
# vendored tarball beside ../shared, else GitHub (or MEGATRON_LM_SOURCE=.tar.gz, checkout, URL)
MEGATRON_LM_TAG := core_v0.16.1
MEGATRON_LM_VENDOR := ../shared/vendor/megatron-lm-$(MEGATRON_LM_TAG)-training.tar.gz
MEGATRON_LM_SOURCE ?= $(if $(wildcard $(MEGATRON_LM_VENDOR)),$(MEGATRON_LM_VENDOR),git+https://github.com/NVIDIA/Megatron-LM@$(MEGATRON_LM_TAG))

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints-cpu.txt torch==2.13.0+cpu
	$(BIN)/pip install --quiet -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

# Sandboxed code runs under bubblewrap (strict isolation); without it the sandbox falls
# back to basic isolation, where a root-only interpreter (a pyenv under /root) cannot run.
sandbox-tools:
	@command -v bwrap >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; \
		else echo "install bubblewrap (bwrap) for sandboxed code: e.g. sudo apt-get install bubblewrap"; fi; }

demo: $(STAMP) sandbox-tools
	$(BIN)/opd demo

slime: $(STAMP)
	bash tests/install_slime.sh "$(SLIME_SOURCE)" "$(VENV)"
	bash tests/install_megatron_lm.sh "$(MEGATRON_LM_SOURCE)" "$(VENV)"

test: $(STAMP) sandbox-tools slime
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint docker/*.Dockerfile

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache .hypothesis
