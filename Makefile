# cdc: make help lists the targets.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
APT_PACKAGES := postgresql-15 postgresql-15-wal2json openjdk-17-jre-headless
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: help setup system venv test demo bench lint clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

setup: system venv ## install system packages (apt) and the virtualenv with the package

system: ## apt-get what the system needs, only what is missing
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "system packages present: $(APT_PACKAGES)"; fi

venv: $(VENV)/.installed ## the virtualenv with cdc and its dev tools

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

test: setup ## set up, then run the whole test suite (real Postgres, Tansu, Spark)
	$(BIN)/pytest $(PYTEST_ARGS)

demo: setup ## set up, then run the pipeline end to end on the embedded log store
	$(BIN)/cdc demo

bench: setup ## benchmarks with their peers in the same run (installs the Debezium peer); figures go to docs/benchmarks/
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python -m bench

lint: venv ## ruff and mypy (strict on cdc/)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean: ## remove the virtualenv and local state
	rm -rf $(VENV) .cdc .pytest_cache .mypy_cache .ruff_cache
