# make demo   - .venv with RelStorage, then a short run on SQLite (no server)
# make test   - .venv with the test extras, then the whole suite
# make bench  - benchmark harness (bench/, docs/benchmarks.md); needs servers;
#               runs RelStorage 4.3 (installed into .venv-peer) side by side
# make bench-smoke - the harness on SQLite only, tiny sizes (under a minute)
# make bench-deps  - install the harness's own dependencies into .venv
# make bench-peer  - install RelStorage 4.3 and its drivers into .venv-peer
#
# Only python3 is assumed. Build requirements missing from the machine
# (venv support, a C compiler, Python headers and libmariadb-dev for the
# mysqlclient driver, memcached and redis-server for the tests) are
# installed with apt-get when running as root, and listed otherwise.

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
PIP    := $(VPY) -m pip
# RelStorage 4.3 for "make bench" (see bench-peer below).
PEER   := .venv-peer
PEER_SHIM := ../shared/bench

.PHONY: all demo test .venv venv sysdeps sysdeps-venv clean \
	bench bench-smoke bench-deps bench-peer

all: test

demo: $(VENV)/.installed
	$(VPY) -m relstorage.demo

# RS_PG_BIG_BLOB=1: the multi-GB blob streaming test also runs on
# PostgreSQL (about 2.5 minutes); set RS_PG_BIG_BLOB= to leave it out.
RS_PG_BIG_BLOB ?= 1
export RS_PG_BIG_BLOB

# The second run: the level-2 tests (the deep crash-point sweep, ten runs
# per fault point, and the 200,000-object transaction) on SQLite only.
# --ignore_dir build: "pip install ." in the checkout leaves a copy of the
# package in build/lib, which the runner would otherwise try to import as
# build.lib.relstorage and report as an import failure.
TESTRUNNER_ARGS = --test-path=. --ignore_dir build
test: $(VENV)/.installed-test $(VENV)/.installed-bench
	$(VPY) -m relstorage.tests.servers
	$(VENV)/bin/zope-testrunner $(TESTRUNNER_ARGS) -v
	$(VENV)/bin/zope-testrunner $(TESTRUNNER_ARGS) -v -m test_sqlite --only-level 2

# Benchmarks (see docs/benchmarks.md). BENCH_ARGS is passed to
# "python -m bench", e.g. BENCH_ARGS="--targets sqlite,pg-psycopg2 -p 2".
BENCH_ARGS ?=
bench: $(VENV)/.installed-bench $(PEER)/.installed
	$(VPY) -m bench --peer-python $(PEER)/bin/python $(BENCH_ARGS)

bench-smoke: $(VENV)/.installed-bench
	$(VPY) -m bench --smoke $(BENCH_ARGS)

bench-deps: $(VENV)/.installed-bench

bench-peer: $(PEER)/.installed

# The site-packages directory of the virtualenv whose python is $(1).
site_packages = $$($(1) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# RelStorage 4.3 from PyPI, the incumbent "make bench" compares with, in a
# virtualenv of its own: a black box that the harness only runs (from a
# neutral directory), never imports. bench/hooks/ lets every benchmark
# process of either side record which relstorage it imported. On MariaDB
# 10.11, RelStorage 4.3 needs the shim in ../shared/bench/ (see its
# README.md; it acts only when RS_PEER_MARIADB_COMPAT=1, which the harness
# sets for the peer's MariaDB runs); without it, the report says why the
# peer cannot run there.
$(PEER)/.installed: bench/peer-requirements.txt bench/hooks/rs_bench_whoami.py | sysdeps
	test -x $(PEER)/bin/python || $(PYTHON) -m venv $(PEER)
	$(PEER)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(PEER)/bin/python -m pip install -q -r bench/peer-requirements.txt
	cp bench/hooks/rs_bench_whoami.py bench/hooks/rs_bench_whoami.pth \
		$(call site_packages,$(PEER)/bin/python)/
	if [ -f $(PEER_SHIM)/peer_mariadb_compat.py ]; then \
		cp $(PEER_SHIM)/peer_mariadb_compat.py $(PEER_SHIM)/peer_mariadb_compat.pth \
			$(call site_packages,$(PEER)/bin/python)/; \
	else echo "$(PEER_SHIM)/peer_mariadb_compat.py not found:" \
		"RelStorage 4.3 will not run on MariaDB"; fi
	touch $@

# zodbshootout is installed without its dependencies: its extras name the
# PyPI "relstorage", which must never replace this checkout. Its real
# imports are installed explicitly; pyperf is pinned (newer versions clash
# with zodbshootout's --profile option). The last step fails if anything
# moved the relstorage distribution away from this checkout.
$(VENV)/.installed-bench: bench/requirements.txt bench/hooks/rs_bench_whoami.py | $(VENV)/.installed
	$(PIP) install -q --no-deps 'zodbshootout==0.8.0'
	$(PIP) install -q -r bench/requirements.txt
	cp bench/hooks/rs_bench_whoami.py bench/hooks/rs_bench_whoami.pth \
		$(call site_packages,$(VPY))/
	$(VPY) -m bench.checkenv
	touch $@

# The development environment with the test extras.
.venv venv: $(VENV)/.installed-test

$(VENV)/.installed: setup.py | sysdeps-venv
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -e .
	touch $@

$(VENV)/.installed-test: setup.py | sysdeps
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -e '.[test]'
	touch $(VENV)/.installed $@

# Installs (as root, with apt-get) or lists the packages named in $(1).
define install_or_tell
	@missing="$(strip $(1))"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing system packages:$$missing"; \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	else \
		echo "Please install these system packages first (e.g. with" \
		     "sudo apt-get install):$$missing" >&2; \
		exit 1; \
	fi
endef

# Shell tests; each prints the Debian package to install when it fails.
NEED_VENV    = $(shell $(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || echo python3-venv)
NEED_CC      = $(shell command -v cc >/dev/null 2>&1 || echo build-essential)
NEED_HEADERS = $(shell $(PYTHON) -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null || echo python3-dev)
NEED_MARIADB = $(shell (command -v mysql_config >/dev/null 2>&1 || pkg-config --exists libmariadb 2>/dev/null || pkg-config --exists mysqlclient 2>/dev/null) && command -v pkg-config >/dev/null 2>&1 || echo libmariadb-dev pkg-config)
NEED_MEMCACHED = $(shell command -v memcached >/dev/null 2>&1 || echo memcached)
NEED_REDIS     = $(shell command -v redis-server >/dev/null 2>&1 || echo redis-server)
# The private servers of test_replication (initdb, pg_basebackup, mariadbd,
# mariadb-install-db): the tests restart, pause and promote only these.
NEED_PG_SERVER = $(shell ls /usr/lib/postgresql/*/bin/pg_basebackup >/dev/null 2>&1 || echo postgresql)
NEED_MARIADB_SERVER = $(shell (command -v mariadb-install-db && test -x /usr/sbin/mariadbd) >/dev/null 2>&1 || echo mariadb-server)

sysdeps-venv:
	$(call install_or_tell,$(if $(wildcard $(VPY)),,$(NEED_VENV)))

sysdeps:
	$(call install_or_tell,$(if $(wildcard $(VPY)),,$(NEED_VENV)) $(NEED_CC) $(NEED_HEADERS) $(NEED_MARIADB) $(NEED_MEMCACHED) $(NEED_REDIS) \
		$(NEED_PG_SERVER) $(NEED_MARIADB_SERVER))

clean:
	rm -rf $(VENV) $(PEER) build *.egg-info bin parts develop-eggs .installed.cfg
	find . -name __pycache__ -prune -exec rm -rf {} +
