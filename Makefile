# rollstream: the README's two commands are `make demo` and `make test`.
# Both work on a fresh machine: they create .venv, install rollstream with its extras, and
# resolve the Kafka broker jars from Maven Central once (see infra/kafka/pom.xml).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# The import contracts (pyproject's [tool.importlinter]): layers, no cycles, pure modules, light SDK.
LINT_IMPORTS := $(VENV)/bin/lint-imports --no-cache --no-logo

.PHONY: sysdeps install kafka-jars test test-unit chaos demo bench lint clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel

# System packages the tests and the demo need, installed when missing (Debian's apt, as root):
# Java and Maven for the Kafka broker and the test registry, bubblewrap and docker.io (+ a static
# busybox for the locally built sandbox image) for the rollout sandboxes, chromium for the web
# UI's browser tests.
SYSPKGS := java:openjdk-17-jre-headless mvn:maven bwrap:bubblewrap dockerd:docker.io \
           busybox:busybox-static chromium:chromium

sysdeps:
	@missing=""; for pair in $(SYSPKGS); do cmd=$${pair%%:*}; pkg=$${pair#*:}; \
	  command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then apt-get update && apt-get install -y $$missing; fi

$(STAMP): pyproject.toml | $(VENV)/bin/python sysdeps
	$(PY) -m pip install --quiet -e ".[all,dev]"
	touch $(STAMP)

install: $(STAMP)

kafka-jars: $(STAMP) sysdeps
	$(PY) -c "from rollstream.infra.kafka import resolve_classpath; resolve_classpath()"

# The test session starts the real Kafka broker itself (tests/conftest.py) and stops it.
# pytest exit codes: 0 passed; 5 means no test ran, which is a failure here too.
# On a failure the failed tests are listed last (.ci/failed_tests.py reads pytest's JUnit XML).
# The import contracts are checked first: a broken one fails the target before pytest runs.
test: kafka-jars
	$(LINT_IMPORTS)
	@mkdir -p .rollstream
	@$(PY) -m pytest -q -p no:cacheprovider --junitxml=.rollstream/pytest-junit.xml $(PYTEST_ARGS); \
	rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	if [ $$rc -ne 0 ]; then $(PY) .ci/failed_tests.py .rollstream/pytest-junit.xml; fi; \
	exit $$rc

# The chaos run (docs/chaos.md): the whole loop, each part SIGKILLed in turn, then audited end
# to end. `make test` runs its short form (one kill of each part, ~2 min); this, more rounds.
ROUNDS ?= 1
chaos: kafka-jars
	ROLLSTREAM_CHAOS_ROUNDS=$(ROUNDS) $(PY) -m pytest tests/chaos -q -s -p no:cacheprovider

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

demo: kafka-jars
	$(VENV)/bin/rollstream demo

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b --quick | tail -n 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy schemas adapters producers inference streams consumers infra
	$(LINT_IMPORTS)

clean:
	-$(VENV)/bin/rollstream down
	rm -rf .rollstream
