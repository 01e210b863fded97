.PHONY: demo test test-quick bench docs clean

demo:  ## Serve the test project on SQLite at http://127.0.0.1:8000/
	scripts/demo.sh

test:  ## The whole suite: gates, then SQLite, PostgreSQL and MariaDB
	scripts/test.sh

test-quick:  ## The same without the slow race, crash, worker and browser tests
	QUICK=1 scripts/test.sh

bench:  ## Benchmarks against PostgreSQL
	scripts/bench.sh

docs:  ## Serve the documentation site at http://127.0.0.1:8001/
	scripts/bootstrap.sh dev && .venv/bin/mkdocs serve -a 127.0.0.1:8001

clean:
	rm -rf .venv build dist site *.egg-info .coverage .pytest_cache testproject/*.sqlite3
