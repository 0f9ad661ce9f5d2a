"""vLLM servers: the server the runner starts and stops (`vllm_server`), several for one stage
(`server_pool`), the one a sweep's jobs share (`shared_servers`), checks of a server the runner
did not start (`endpoint`), and the arguments of a hidden-states server (`hidden_states`).

May import: runner.core, runner.assets, runner.processes, runner.integrations.
"""
