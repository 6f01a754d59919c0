# relaybox: `make demo` shows it working, `make test` proves it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install check lint types imports docs test fuzz demo bench chaos soak clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

lint: install
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

types: install
	$(BIN)/mypy

imports: install
	$(BIN)/lint-imports

# The documentation site (mkdocs.yml) with every warning an error: a broken link or
# anchor, a page left out of the navigation, a docstring the API reference cannot read.
# Built into a temporary directory and thrown away: this only checks that it builds.
docs: install
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict \
		--site-dir "$$site"; status=$$?; rm -rf "$$site"; exit $$status

check: lint types imports docs

# Three workers, each file's tests in one of them: the tests mostly wait on services and
# processes, and each makes its own tables, streams, ports and servers.
test: check
	$(BIN)/pytest -q -p no:cacheprovider -n 3 --dist loadfile

# The property tests (tests/properties) with many examples each: every decoder fed what a
# hostile producer could send, every header mapping through every broker; about five
# minutes. `make test` runs the same properties with a few hundred examples each.
fuzz: install
	RELAYBOX_FUZZ=1 $(BIN)/pytest -q -p no:cacheprovider tests/properties \
		tests/unit/test_url_masking.py tests/consumers/test_http_limits.py

demo: install
	$(BIN)/relaybox demo

bench: install
	$(BIN)/python benchmarks/writer_overhead.py
	$(BIN)/python benchmarks/relay_driver.py

# The chaos suite at full length on every database x broker and on log mode (PostgreSQL
# + NATS in both modes with 100,000+ messages and 80+ faults, the other eight smaller);
# `make test` runs it short, with several faults of each kind on four of them. Reports are printed, tabled at the end, and kept in chaos-reports/.
chaos: install
	RELAYBOX_CHAOS=full RELAYBOX_CHAOS_REPORTS=chaos-reports $(BIN)/pytest -s -p no:cacheprovider tests/chaos

# 30 minutes at 2,000 msg/s through PostgreSQL and NATS: relay memory and publish lag.
soak: install
	$(BIN)/python benchmarks/soak.py --out soak-report.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
