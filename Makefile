# The two commands a newcomer needs: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-grain-lowest durations test-newest lock lock-diff fuzz proto clean host-tools \
  beam-venv beam-venv-or-skip docs

# Every venv installs from a lock: lock/main.txt (.venv) and lock/beam.txt
# (.venv-beam) name every package and its version, those the suite last passed
# with, so a fresh clone gets what CI got. pyproject.toml keeps the ranges a
# library user installs against. The lock is a constraints file exported to
# pip as PIP_CONSTRAINT, which also binds the build of this package (its
# setuptools) and what the tests install (tests/deploy/test_install.py).
# `make test-newest` installs the newest versions the ranges admit instead;
# `make lock` then writes what it got into lock/ (README.md, "Refreshing the lock").
LOCK ?= lock/main.txt
BEAM_LOCK ?= lock/beam.txt
pip_with = $(if $(1),PIP_CONSTRAINT=$(CURDIR)/$(1) )

# System tools the tests use beyond Python: iptables (random loss on the
# netns test's link). Installed with apt where we are root and it is missing;
# elsewhere the tests that need it are skipped with the reason.
HOST_TOOLS := iptables

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(call pip_with,$(LOCK))$(PY) -m pip install --quiet --upgrade pip

# PyTorch for the torch client's tests and `elevator demo-torch`, kept out of
# pyproject's test extra: `torch` unpinned would pull a CUDA build of several
# GB. pip takes torch 2.13.0's CPU build (192 MB, 754 MB installed, ~30 s)
# from this machine's wheel folder; elsewhere the pin downloads PyPI's build.
# The pin stands in `make test-newest` too (PyTorch's CPU index is not PyPI).
# `make test TORCH=` skips it (tests/client/test_torch.py then skips).
TORCH ?= 'torch==2.13.0' 'torchdata>=0.11'
# torchtitan, for docs/pytorch.md's recipe test (tests/client/test_trainer_loaders.py):
# only its dataloader module is used, which needs tyro beside torch. Its own
# requirements (datasets<4.8, whose fsspec conflicts with the lock's) would
# not resolve against lock/main.txt, so it goes, without them, into a folder
# of its own that only that test puts on its path. Left out with TORCH=.
TITAN_DIR := $(VENV)/torchtitan
TITAN := 'torchtitan==0.3.0' 'tyro==1.0.17'

# The [test] extra brings moto's S3 server and gcp-storage-emulator, which the
# bucket tests (tests/server/data/storage/) start on 127.0.0.1 themselves.
#
# Bytecode is compiled after the install on every core (pip compiles file by
# file: ~45 s of a fresh install here, ~25 s this way); a third-party file that
# does not compile (Python 2 test data) is skipped, as pip skips it.
$(STAMP): $(PY) pyproject.toml $(LOCK)
	$(call pip_with,$(LOCK))$(PY) -m pip install --quiet --no-compile -e '.[test,demo]' $(TORCH)
	$(if $(TORCH),$(PY) -m pip install --quiet --no-compile --no-deps --upgrade --target $(TITAN_DIR) $(TITAN))
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/elevator demo

# Everything: real servers on 127.0.0.1, the slow end-to-end runs, the
# network-namespace test where it can run; and, beside them, the contract's
# Grain paths on the lowest Grain release pyproject.toml admits (everything
# else runs on the highest, which pip installs). The set-ups, too, run at
# once: they share nothing, and each waits on pip.
#
# The main run is PYTEST_WORKERS pytest processes (pytest-xdist), each given
# a whole test file at a time (its module fixtures start once), the files
# that took longest first (tests/durations.json, `make durations`), so the
# run does not end waiting on a long file started last. Its tests wait on
# servers and sockets as much as they compute: three share two cores well.
#
# The main run has a budget (TEST_BUDGET_S, far past the suite's length):
# past it, pytest gets SIGINT and prints what failed so far and where it
# was, instead of a CI runner's limit killing it with nothing said.
#
# Times on this 2-core machine, `CI=true bash .ci/run` in a clean clone, the
# venvs built from nothing (pip's cache warm):
#   idle (178bf98):    12 min 6 s in all; the main run 1,271 passed,
#                      3 skipped in 626.5 s; lowest Grain 86 passed in 24.9 s
#   idle (8a4de96):    12 min 21 s; 1,271 passed, 3 skipped in 618.4 s
#   one core busy      16 min 45 s in all; the main run 1,271 passed,
#   (441e036, a shell  3 skipped in 859.5 s; lowest Grain 86 passed in 41.9 s
#   loop):
# The longest tests (--durations, idle): test_bench_text 65 s,
# test_bench_tfds 49 s, test_bench's image and every-system runs 45 s each,
# test_bench_storage 42 s, test_bench_shared 34 s, test_bench_clients 32 s,
# test_fuzz_wire 30 s, test_demo's torch and lm runs 29 s each. Before this
# layout (d397928, one process, elevator serve per test file): ~26 min idle.
PYTEST_WORKERS ?= 3
XDIST = $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile)
TEST_BUDGET_S ?= 2400
test:
	$(MAKE) --no-print-directory -j3 $(STAMP) host-tools beam-venv-or-skip $(GRAIN_LOWEST_DIR)/.installed
	@$(MAKE) --no-print-directory test-grain-lowest > $(VENV)/grain-lowest.log 2>&1 & lowest=$$!; \
	$(call pip_with,$(LOCK))ELEVATOR_BEAM_VENV=$(CURDIR)/$(BEAM_VENV) \
	  timeout -s INT -k 60 $(TEST_BUDGET_S) $(PY) -m pytest $(XDIST) $(PYTEST_ARGS); main=$$?; \
	wait $$lowest; low=$$?; \
	echo "--- make test-grain-lowest (run beside the main run) ---"; cat $(VENV)/grain-lowest.log; \
	exit $$(( main != 0 || low != 0 ))

# The tests marked grain_contract (Grain's shuffle, mix and checkpointing, which
# the service reproduces: server/data/grain_private.py) on the lowest Grain
# release pyproject.toml admits, installed beside .venv and put first on the
# path, in embedded mode only (ELEVATOR_EMBEDDED_ONLY, tests/conftest.py): a
# server runs the same code, and the main run compares the two.
GRAIN_LOWEST := $(shell sed -n 's/^ *"grain>=\([0-9.]*\),.*/\1/p' pyproject.toml)
GRAIN_LOWEST_DIR := .venv-grain-$(GRAIN_LOWEST)
$(GRAIN_LOWEST_DIR)/.installed: pyproject.toml | $(STAMP)
	$(PY) -m pip install --quiet --no-deps --target $(GRAIN_LOWEST_DIR) grain==$(GRAIN_LOWEST)
	touch $@

test-grain-lowest: $(STAMP) $(GRAIN_LOWEST_DIR)/.installed
	ELEVATOR_EMBEDDED_ONLY=1 ELEVATOR_EXPECT_GRAIN=$(GRAIN_LOWEST) \
	  PYTHONPATH=$(CURDIR)/$(GRAIN_LOWEST_DIR) \
	  $(PY) -m pytest -m grain_contract -p no:cacheprovider $(PYTEST_ARGS)

# The edit loop, ~3 minutes: what `make test` runs but the tests marked slow
# (pyproject.toml: end-to-end runs, servers killed, signalled or waiting out
# a limit, floods, the bucket emulators) or netns.
test-fast: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not slow and not netns" $(PYTEST_ARGS)

# tests/durations.json, the seconds each test file took in a whole run (the
# order `make test` starts them in): rewrite it after adding a long file.
durations: $(STAMP)
	$(PY) -m pytest $(XDIST) -p no:cacheprovider --junitxml=$(VENV)/durations.xml $(PYTEST_ARGS); \
	  $(PY) tests/durations.py $(VENV)/durations.xml > tests/durations.json

# Three fuzzers side by side for FUZZ_SECONDS, a process each (tests/fuzz): the
# shard reader (server/data/shards/riegeli.c built with ASan and UBSan) against
# ArrayRecord's own reader, on mutants of real shards, many re-signed so that
# every hash checks; the wire (fuzz_wire.py, its lines "fuzz-wire:"): the
# client's batch decoding, a live server's bulk framing and the bulk client's,
# on mutants of real batches and sessions; and stream positions
# (fuzz_positions.py, "fuzz-positions:"): mutants of real positions of three
# stream shapes sent to a live server; and the health port's HTTP/2
# (fuzz_health.py, "fuzz-health:"): mutants of grpcio's recorded calls and of
# crafted floods sent to a health port. Fails if any fails; findings go to
# fuzz-findings/. `make test` runs each briefly (tests/fuzz/test_fuzz_*.py).
FUZZ_SECONDS ?= 1800
fuzz: $(STAMP)
	$(PY) tests/fuzz/fuzz_reader.py --seconds $(FUZZ_SECONDS) --out fuzz-findings & \
	  reader=$$!; \
	$(PY) tests/fuzz/fuzz_positions.py --seconds $(FUZZ_SECONDS) --out fuzz-findings & \
	  positions=$$!; \
	$(PY) tests/fuzz/fuzz_health.py --seconds $(FUZZ_SECONDS) --out fuzz-findings & \
	  health=$$!; \
	$(PY) tests/fuzz/fuzz_wire.py --seconds $(FUZZ_SECONDS) --out fuzz-findings; wire=$$?; \
	wait $$reader; reader=$$?; wait $$positions; positions=$$?; wait $$health; health=$$?; \
	echo "make fuzz: fuzz_reader.py exited $$reader, fuzz_wire.py $$wire, fuzz_positions.py $$positions, fuzz_health.py $$health"; \
	[ $$reader -eq 0 ] && [ $$wire -eq 0 ] && [ $$positions -eq 0 ] && [ $$health -eq 0 ]

host-tools:
	@missing=$$(for t in $(HOST_TOOLS); do command -v $$t >/dev/null || echo $$t; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $$missing (apt-get)"; \
	  apt-get install -y -q $$missing >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $$missing >/dev/null 2>&1; } || \
	    echo "could not install $$missing; the tests that need it will be skipped"; \
	fi

# `python -m grain_elevator.tools.convert.beam` (docs/convert.md) runs in a venv
# of its own: apache-beam wants protobuf<7 and pyarrow<26, the gRPC stubs of
# .venv protobuf 7. The converter's modules import neither the stubs nor grpc.
# `make test` tries to build it; where it cannot, the Beam test is skipped.
BEAM_VENV ?= .venv-beam
BEAM_STAMP := $(BEAM_VENV)/.installed
BEAM_PACKAGES := 'apache-beam>=2.60' 'array-record>=0.8.6' 'numpy>=2.0' 'pyarrow>=14' \
  'google-crc32c>=1.5' 'tqdm>=4.66' 'obstore>=0.12'

$(BEAM_STAMP): pyproject.toml Makefile $(BEAM_LOCK)
	$(PYTHON) -m venv $(BEAM_VENV)
	$(call pip_with,$(BEAM_LOCK))$(BEAM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(call pip_with,$(BEAM_LOCK))$(BEAM_VENV)/bin/python -m pip install --quiet $(BEAM_PACKAGES)
	@# The converter's sources, live, without building the package (an editable
	@# install would rebuild server/data/shards/_riegeli*.so in place under running tests):
	@# grain_elevator.{tools,pipelines,proto,server} are this checkout's folders; of proto the
	@# converter loads only modules that import neither the gRPC stubs nor grpc
	@# (varint.py, dtypes.py, rows.py), of server only data/storage/urls.py (plain re).
	mkdir -p $(BEAM_VENV)/src/grain_elevator
	echo $(CURDIR)/$(BEAM_VENV)/src > "$$($(BEAM_VENV)/bin/python -c \
	  'import sysconfig; print(sysconfig.get_path("purelib"))')/grain_elevator_src.pth"
	touch $(BEAM_STAMP)

beam-venv: $(BEAM_STAMP)
	@for d in tools pipelines proto server; do ln -sfn $(CURDIR)/$$d $(BEAM_VENV)/src/grain_elevator/$$d; done

beam-venv-or-skip:
	@$(MAKE) --no-print-directory beam-venv || \
	  echo "could not build $(BEAM_VENV); tests/tools/test_convert_beam.py will be skipped"

# Drift found on purpose, not by a red CI: fresh venvs (.venv-newest,
# .venv-beam-newest) with the newest versions pyproject.toml and BEAM_PACKAGES
# admit, no lock, and the whole of `make test` on them. What they installed is
# printed after the run; `make lock` writes it into lock/.
NEWEST := VENV=.venv-newest BEAM_VENV=.venv-beam-newest LOCK= BEAM_LOCK=
test-newest:
	rm -rf .venv-newest .venv-beam-newest
	@$(MAKE) --no-print-directory test $(NEWEST); status=$$?; \
	  echo "--- make test-newest: what differs from lock/ (exit $$status) ---"; \
	  $(MAKE) --no-print-directory -s lock-diff; exit $$status

# The lock from the venvs `make test-newest` built: run that first, and write
# the lock only from a green run.
LOCK_FREEZE = $(1)/bin/python -m pip freeze --all --exclude-editable | \
  sed -e 's/+[a-z0-9.]*$$//' | sort -f
LOCK_HEADER = \# The versions `make test` installs ($(1)): written by `make lock` from\n\# the venv `make test-newest` built (README.md, "Refreshing the lock").
lock:
	@test -x .venv-newest/bin/python && test -x .venv-beam-newest/bin/python || \
	  { echo "make lock: run make test-newest first (it builds the venvs to lock)"; exit 2; }
	printf '$(call LOCK_HEADER,.venv)\n' > lock/main.txt
	$(call LOCK_FREEZE,.venv-newest) >> lock/main.txt
	printf '$(call LOCK_HEADER,.venv-beam)\n' > lock/beam.txt
	$(call LOCK_FREEZE,.venv-beam-newest) >> lock/beam.txt

lock-diff:
	@for pair in .venv-newest:lock/main.txt .venv-beam-newest:lock/beam.txt; do \
	  venv=$${pair%%:*}; lock=$${pair#*:}; \
	  test -x $$venv/bin/python || continue; \
	  $(call LOCK_FREEZE,$$venv) | diff <(grep -v '^#' $$lock) - | \
	    sed -n -e "s|^< |$$lock: |p" -e "s|^> |$$venv: |p"; \
	done

# The documentation site (mkdocs.yml, docs/hooks.py) on http://127.0.0.1:8000,
# rebuilt as docs/, README.md or BENCHMARKS.md change.
docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

# Regenerate the gRPC stubs after editing proto/elevator.proto.
proto: $(STAMP)
	$(PY) -m grain_elevator.proto.generate

clean:
	rm -rf $(VENV) $(BEAM_VENV) .venv-newest .venv-beam-newest .venv-grain-* build *.egg-info
