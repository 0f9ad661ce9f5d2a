"""Adapters to other libraries' internals, one module per library; each docstring lists the
private APIs it touches and the library version they were checked against:

- `runner.integrations.speculators`: speculators 0.9.0, one module per concern: the trainer
  on CPU and over gloo, stopped at a step boundary with a resumable checkpoint, and the
  fused-loss fix for torch 2.11 (`speculators`); its settings resolved, refused and recorded
  (`speculators_config`); its metric records and settings captured for MLflow
  (`speculators_metrics`); its checkpoint folder (`speculators_checkpoints`); a hidden-states
  backend that reads a subset of slots (`speculators_slots`); the CPU kernels
  (`speculators_cpu`); the module torchrun starts on each rank (`speculators_worker`).
- `runner.integrations.vllm`: vLLM 0.32.0 (does a model class support EAGLE-3).
- `runner.integrations.hydra_plugins`: hydra-core 1.3.2 (the runner's search-path plugin found
  by Hydra's plugin scan under an editable install).
- `runner.integrations.vllm_cpu_connector`: vLLM 0.32.0 (the hidden-states connector on CPU;
  imported by the vLLM server, never by the runner).
"""

# The hidden-states backend that reads only some slots (speculators_slots.py), and the variable
# that says which ("0,2,4"); here so that naming it imports neither torch nor hs-connectors.
SLOT_BACKEND = "runner-slots"
SLOTS_ENV = "EAGLE3_RUNNER_SLOTS"
