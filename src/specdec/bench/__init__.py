"""`specdec bench`: which speculation to run on a workload, measured on the user's own prompts.

    methods.py   `--methods` entries -> SpeculativeConfig (plain, ngram, draft:MODEL, medusa, eagle; K, trees)
    prompts.py   JSONL prompts or the shipped data sets (HumanEval, Spec-Bench)
    compare.py   the methods take turns prompt by prompt on one target; per-method summaries against plain
    report.py    report.md / report.json, ending with the recommended `--speculative-config`
    plots.py     the PNG plots (matplotlib, the `bench` extra)
    serve.py     `specdec bench serve`: concurrent streaming clients against an OpenAI-compatible server
    cli.py       the two commands' flags
"""
