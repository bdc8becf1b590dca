# Set-up and entry points. `make train` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-16)

.PHONY: setup test train bench fine-tune-example docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@# The editable install finds its packages after sys.path, so a folder named like one of them beside a user's
	@# script (a clone called dpfleet/, a workers/ folder) would be imported instead, as an empty namespace package.
	@# A path entry that holds links to the four packages makes Python find the real ones first.
	@mkdir -p $(VENV)/packages
	@for package in orchestrator/dpfleet orchestrator workers accounting; do \
		ln -sfn "$(CURDIR)/$$package" $(VENV)/packages/$$(basename $$package); done
	@echo "$(CURDIR)/$(VENV)/packages" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dpfleet-packages.pth"
	@rm -f $(VENV)/.stamp-*
	@touch $@

test: setup
	$(BIN)/python -m pytest

train: setup
	$(BIN)/dpfleet train --config examples/mnist.toml --workers 2 --overwrite

bench: setup
	$(BIN)/python -m pip install --quiet -e '.[bench,hf]'
	$(BIN)/python -m bench $(BENCH)

# DP fine-tuning of a small pretrained model on Shakespeare's tragedies (examples/fine_tuning/run.sh).
fine-tune-example: setup
	$(BIN)/python -m pip install --quiet -e '.[hf]'
	PATH="$(CURDIR)/$(BIN):$$PATH" bash examples/fine_tuning/run.sh

# Offline: setup's test extra installs the docs extra, and the site fetches nothing as it builds.
docs: setup
	$(BIN)/python -m orchestrator.cli.reference
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info
