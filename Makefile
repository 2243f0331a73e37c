# torchrig: the two quickstart commands are `make demo` and `make test`.
# Both install what they need on a fresh Debian/Ubuntu machine (apt packages as root,
# a venv with the project) before doing anything else.

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
INVOKE  := $(BIN)/invoke
# Operator-side tools the testbed and tests use (systemd-nspawn, debootstrap, ssh-keygen,
# dpkg-deb/apt-ftparchive for the stand-in repo, gpg to sign it, ip for the bridge; chromium,
# headless, renders `invoke report`'s page in its test; ipmitool is what `power` runs, and
# openipmi's ipmi_sim the BMC its test talks to).
APT_PKGS := systemd-container debootstrap openssh-client apt-utils dpkg-dev gpg iproute2 procps python3-venv chromium ipmitool openipmi
APT_TOOLS := systemd-nspawn debootstrap ssh-keygen apt-ftparchive dpkg-deb gpg ip pgrep chromium ipmitool ipmi_sim

.PHONY: deps venv test unit integration golden demo bench clean

deps:
	@missing=""; for t in $(APT_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	$(PY) -c 'import ensurepip' 2>/dev/null || missing="$$missing ensurepip"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "missing:$$missing; run 'sudo make deps'"; exit 1; fi; \
	  echo "installing apt packages (missing:$$missing)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(APT_PKGS); \
	fi

$(BIN)/activate: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,report]'
	touch $(BIN)/activate

venv: $(BIN)/activate

unit: venv
	$(BIN)/python -m pytest -q -n auto tests/unit tests/payload

integration: deps venv
	$(BIN)/python -m pytest -q tests/integration

# Rewrite tests/golden/ from the generators (after a deliberate change; review the diff).
golden: venv
	TORCHRIG_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/unit/test_golden.py

# Unit tests first (fast, no root; spread over the cores: pytest-xdist), then integration tests
# on a testbed they bring up and down (one process: they share session testbeds). Both always
# run; the target fails if either did.
test: deps venv
	$(BIN)/python -m pytest -q -ra -n auto tests/unit tests/payload; u=$$?; \
	$(BIN)/python -m pytest -q -ra tests/integration; i=$$?; \
	exit $$(( u || i ))

demo: deps venv
	$(INVOKE) demo

bench: deps venv
	$(BIN)/python bench/run_all.py

clean:
	-$(INVOKE) testbed.down
	rm -rf $(VENV) *.egg-info
