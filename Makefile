# cdc: make help lists the targets.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PG_PACKAGES := postgresql-15 postgresql-client-15 postgresql-15-wal2json
APT_PACKAGES := $(PG_PACKAGES) gcc openjdk-17-jre-headless stunnel4 openssl chromium prometheus
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: help setup system venv check test test-pgoutput demo bench chaos soak lint clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

setup: system venv ## install system packages (apt) and the virtualenv with the package

system: ## apt-get what the system needs; Postgres packages always at Debian's current minor release
	@$(SUDO) apt-get update -qq || echo "apt-get update failed: using the package lists on this machine"; \
	todo=""; for p in $(APT_PACKAGES); do \
	  have=$$(dpkg-query -W -f='$${db:Status-Abbrev}$${Version}' $$p 2>/dev/null); \
	  case "$$have" in ii*) ;; *) todo="$$todo $$p"; continue;; esac; \
	  case " $(PG_PACKAGES) " in *" $$p "*) \
	    cand=$$(apt-cache policy $$p 2>/dev/null | awk '/Candidate:/ {print $$2}'); \
	    if [ -n "$$cand" ] && [ "$$cand" != "(none)" ] && [ "$${have#ii }" != "$$cand" ]; then \
	      echo "$$p: $${have#ii } installed, $$cand is current: upgrading"; todo="$$todo $$p"; fi;; \
	  esac; \
	done; \
	if [ -n "$$todo" ]; then \
	  echo "installing:$$todo"; \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$todo; \
	else echo "system packages present and current: $(APT_PACKAGES)"; fi; \
	echo "PostgreSQL: $$(dpkg-query -W -f='$${Version}' postgresql-15)"

venv: $(VENV)/.installed ## the virtualenv with cdc and its dev tools

# setup.py and the compiled sources too: a changed .pyx (or a .pxi it includes) is compiled again by
# the install
$(VENV)/.installed: pyproject.toml setup.py $(wildcard cdc/*/*.pyx cdc/*/*.pxd cdc/*/*.pxi cdc/*/*/*.pyx)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# the inner loop: no JVM (JAVA_HOME points nowhere, so a test that starts Spark unmarked fails), no
# broker, no browser; the check marker comes from the fixtures a test uses (tests/plugins/markers.py)
check: venv ## the inner loop: unit tests, pure logic, the embedded log store, bad input; no JVM
	JAVA_HOME=/nonexistent/make-check-starts-no-jvm $(BIN)/pytest -q -m check -n 2 --dist worksteal --durations=10 $(PYTEST_ARGS)

# three xdist workers, each with its own Postgres cluster, Spark session and broker (session
# fixtures): most of a test's time is spent waiting on the processes it drives, so three overlap even
# on 2 cores
test: setup ## set up, then run the whole test suite (real Postgres, Tansu, Spark) on 3 workers
	$(BIN)/pytest -n 3 --dist worksteal --durations=30 $(PYTEST_ARGS)

# the suites that read a source, with pgoutput wherever a test does not name its decoder (the
# decoders marker; the wal2json-only ones: the non-finite recorder, the allow-list)
PGOUTPUT_SUITES := tests/capture tests/snapshot tests/schema tests/oncall tests/apply/test_end_to_end.py
test-pgoutput: setup ## the capture, snapshot, schema and on-call suites again with decoder = "pgoutput"
	CDC_DECODER=pgoutput $(BIN)/pytest --durations=30 $(PGOUTPUT_SUITES) $(PYTEST_ARGS)

demo: setup ## set up, then run the pipeline end to end on the embedded log store
	$(BIN)/cdc demo

bench: setup ## benchmarks with their peers in the same run (installs the Debezium peer); figures go to docs/benchmarks/
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python -m bench

chaos: setup ## the fault suite at full size on both log-store backends (figures go in the README)
	$(BIN)/python -m tests.chaos --size full

DURATION ?= 10m
soak: setup ## a steady 2,000 changes/s through the whole pipeline for DURATION (default 10m)
	$(BIN)/python -m tests.chaos.soak --duration $(DURATION)

lint: venv ## ruff, mypy (strict on cdc/), the layers (import-linter, tools/check_layers.py), no import cycles, no function over 100 lines, no figure without its bench
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo
	$(BIN)/python tools/check_layers.py
	$(BIN)/python tools/check_cycles.py
	$(BIN)/python tools/check_function_length.py
	$(BIN)/python tools/check_figures.py

clean: ## remove the virtualenv and local state
	rm -rf $(VENV) .cdc .pytest_cache .mypy_cache .ruff_cache
