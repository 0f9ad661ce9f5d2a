"""Adapters to other libraries' internals, one module per library; each docstring lists the
private APIs it touches and the library version they were checked against:

- `runner.integrations.speculators`: speculators 0.9.0 (trainer on CPU, metric capture,
  a hidden-states backend that reads a subset of slots, the data-generation client's log).
- `runner.integrations.vllm`: vLLM 0.32.0 (does a model class support EAGLE-3).
- `runner.integrations.vllm_cpu_connector`: vLLM 0.32.0 (the hidden-states connector on CPU;
  imported by the vLLM server, never by the runner).
"""
