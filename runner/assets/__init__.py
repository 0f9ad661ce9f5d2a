"""What a run reads: the target (facts from its config files, where its text model lives, the
Kimi-K2.5 miniature, the tokenizer the plan uses, loading its weights), conversation data (files
read row by row, several sources mixed, the chat template's rendering), prompt sets, and drafts
packed for another machine (`transfer`).

May import: runner.core. Not the integrations (which read assets), the engine, serving, tracking
or commands.
"""
