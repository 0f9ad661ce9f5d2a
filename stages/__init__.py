"""Pipeline stages, one thin module each over library calls: prepare, extract, vocab, train, evaluate.

Each module exposes NAME, UPSTREAM (names of the stages whose artifacts it reads), VERSION (bumped
when its output format or semantics change), `key_config(cfg, facts)` (the config slice its
output depends on) and `run(ctx)` (writes into ctx.out, returns metrics).
"""
