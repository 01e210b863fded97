.PHONY: demo test test-quick release-check bench docs clean

demo:  ## Serve the test project on SQLite at http://127.0.0.1:8000/
	scripts/demo.sh

test:  ## Gates, then the Django x Python matrix (noxfile.py) on SQLite, PostgreSQL and MariaDB
	scripts/test.sh

test-quick:  ## The loop between two edits: ruff, then the quick tests on SQLite and PostgreSQL (< 3 min)
	scripts/test-quick.sh

release-check:  ## Build the sdist and wheel, twine check --strict, install the wheel with Django only
	scripts/release-check.sh

bench:  ## Benchmarks against PostgreSQL
	scripts/bench.sh

docs:  ## Serve the documentation site at http://127.0.0.1:8001/
	scripts/bootstrap.sh dev && NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs serve -a 127.0.0.1:8001

clean:
	rm -rf .venv .nox .reports build dist site *.egg-info .coverage .pytest_cache testproject/*.sqlite3
