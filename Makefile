# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test proto clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test,demo]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/elevator demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Regenerate the gRPC stubs after editing proto/elevator.proto.
proto: $(STAMP)
	$(PY) -m grain_elevator.proto.generate

clean:
	rm -rf $(VENV) build *.egg-info
