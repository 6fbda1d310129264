"""Defaults of the evaluation commands, kept in a module that imports nothing heavy, so that
the CLI's option help can show them without loading MLX's model code."""

#: `bench`: the policies run by default (fp32 always runs: ratios are against REFERENCE)
BENCH_POLICIES = "fp32,bf16,int8,int4,sink4/window252,sink4/window252:absolute,mlx,mlx-rotating256,mlx-q8,mlx-q4"
BENCH_DECODE_STEPS = 32
BENCH_REFERENCE = "fp32"
#: `compare`: greedy tokens per prompt and mode
COMPARE_TOKENS = 60
#: `perplexity`: tokens prefilled before teacher forcing starts
PERPLEXITY_PREFILL_TOKENS = 64
