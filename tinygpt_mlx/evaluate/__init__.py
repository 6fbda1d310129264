"""Evaluation: what a cache policy costs (bench) and what it changes (compare, perplexity).

compare.py     greedy prefix match against the fp32 full cache
perplexity.py  teacher-forced perplexity through the cached path, KL and top-1 to a baseline
bench.py       prefill/decode speed and cache bytes per context, beside mlx-lm's caches
modes.py       policy spec strings ("int4", "int8+sink4/window256", ...) -> CacheConfig
inputs.py      reading the text files the commands take (the shipped held-out text by default)
needle.py, retrieval_bench.py   the needle grid and the retrieval scaling bench
sharded.py     two ranks (mlx.launch) against one: each policy's tokens, bytes and logits

The package imports nothing, so the CLI can read `modes` and `inputs` without MLX's model
code; import the module you need (`from tinygpt_mlx.evaluate import compare`).
"""
