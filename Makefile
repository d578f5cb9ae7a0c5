# Two commands for a fresh clone; each creates .venv (and installs meshpar into it) when missing.
#   make train   train the tiny transformer on 8 fake CPU devices with FSDP
#   make test    run the test suite, but for the slow tests (`make test-slow`, which CI also runs)
# CI also runs `make test-newest PYTHON312=...`: every parity module on the newest releases the pins allow
# (.venv312); transformers' reference runs in .venv's Python there (tests/hf_reference.py); and then
# `make test-gpu-compile`: the step compiled by XLA's GPU compiler for H100/H200/A100/B200 clusters, with no GPU
# (jax's CUDA plugin and cuDNN's wheel, --no-deps, added to .venv312 by `make gpu-compile-deps`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# jax 0.11 and later need Python 3.12: python3.12 on PATH if it runs, else a pyenv one
PYTHON312 ?= $(shell for c in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python; do \
	$$c -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && echo $$c && break; done)
VENV312 := .venv312
# The parity modules of the layouts (each against one device, the pipelines, offload, mixtures of experts, LoRA on
# three of its layouts, FP8's numerics and two of its layouts), checkpoint resume, real 2-process runs,
# attention, flash and the loss. Left to the main legs, for CI's time: the pipelines' MoE and split-backward
# variants, whose JAX calls test_pipeline_1f1b and test_moe already make here; the planner against XLA:CPU's
# full-size programs (test_fit: the newest jax compiles full-size programs in the GPU leg, for the target the
# planner is held to); Hugging Face against transformers (test_hf, test_hf_moe, test_hf_training: the model's
# numerics, not a jax release's); generation and packed documents.
NEWEST_TESTS := tests/test_train.py tests/test_parallel.py tests/test_pipeline.py tests/test_pipeline_1f1b.py \
	tests/test_offload.py tests/test_checkpoint.py tests/test_attention.py tests/test_flash.py \
	tests/test_loss.py tests/test_moe.py tests/test_gpu.py \
	tests/test_lora.py::test_lora_matches_one_device[fsdp+tp] tests/test_lora.py::test_lora_matches_one_device[1f1b] \
	tests/test_lora.py::test_lora_matches_one_device[experts] \
	tests/test_lora.py::test_the_merged_model_computes_what_the_adapted_one_does \
	tests/test_fp8.py::test_one_fp8_matmul_equals_the_reference_and_stays_within_the_rounding_bound \
	tests/test_fp8.py::test_a_mixtures_grouped_matmul_is_fp8_forward_and_backward \
	tests/test_fp8.py::test_a_scale_is_the_smallest_power_of_two_that_fits_bit_for_bit \
	tests/test_fp8.py::test_fp8_on_a_mesh_matches_one_device[fsdp-tensorwise] \
	tests/test_fp8.py::test_fp8_on_a_mesh_matches_one_device[gpipe-rowwise] \
	tests/test_distributed.py::test_each_process_reads_only_its_rows \
	tests/test_distributed.py::test_two_processes_match_one_across_checkpoints

# The cuDNN wheel XLA's GPU compiler builds fused attention with; the plugin takes .venv312's jax version.
CUDNN_WHEEL := nvidia-cudnn-cu12==9.28.0.42

.PHONY: train test test-slow test-newest test-gpu-compile gpu-compile-deps bench
train: $(VENV)/core
	$(PY) -m launch.train --config tiny --cpu-devices 8 --mesh fsdp=8

# Each test leg ends with its wall time (the install before it apart).
timed = start=$$(date +%s); $(1); rc=$$?; echo "make $@: $$(( $$(date +%s) - start )) s"; exit $$rc

test: $(VENV)/installed
	@$(call timed,$(PY) -m pytest -m "not slow")

test-slow: $(VENV)/installed
	@$(call timed,$(PY) -m pytest -m slow)

test-newest: $(VENV312)/installed $(VENV)/installed
	@$(call timed,MESHPAR_TORCH_PYTHON=$(abspath $(PY)) $(VENV312)/bin/python -m pytest -W error::DeprecationWarning \
		$(NEWEST_TESTS))

# XLA_FLAGS set (empty unless the caller's): the GPU program compiled as users compile it, without the tests'
# fast XLA:CPU flags (tests/conftest.py). Scheduled by xdist group: the tests that read one program run in one
# process (test_gpu_fit's groups are its programs; test_gpu_compile.py is one), so both workers finish together.
test-gpu-compile: $(VENV312)/gpu-compile
	@$(call timed,XLA_FLAGS="$${XLA_FLAGS:-}" $(VENV312)/bin/python -m pytest -W error::DeprecationWarning \
		--dist loadgroup tests/test_gpu_compile.py tests/test_gpu_fit.py)

gpu-compile-deps: $(VENV312)/gpu-compile

bench: $(VENV)/installed
	$(PY) -m launch.bench

# Training needs the core only (jax, flax, optax, orbax, numpy); the test extras (torch, transformers,
# datasets, matplotlib) come with the first `make test`.
$(VENV)/core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/installed: $(VENV)/core
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

$(VENV312)/installed: pyproject.toml
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install --quiet --upgrade pip
	$(VENV312)/bin/python -m pip install --quiet -e ".[test]"
	touch $@

$(VENV312)/gpu-compile: $(VENV312)/installed
	version=$$($(VENV312)/bin/python -c 'import jax; print(jax.__version__)') && \
	$(VENV312)/bin/python -m pip install --quiet --no-deps "jax-cuda12-plugin==$$version" \
		"jax-cuda12-pjrt==$$version" "$(CUDNN_WHEEL)"
	touch $@
