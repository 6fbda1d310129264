"""Measurement code behind the numbers in docs/: speed and memory benchmarks (bench_*), probes
of what a cache policy keeps or loses (*_probe, chat_*reach*, kivi_*), the tables the docs print
(*_table, decode_costs, model_report) and the shell drivers that re-run a doc's measurements
(*.sh, which call `posttrainllm`). Each page of docs/ names the command behind its numbers;
docs/results/README.md maps every results file to it.

Run a module from the repository root, with the package installed (`pip install -e .`):

    python -m benchmarks.NAME --help
    python -m benchmarks.decode_costs --parts retrieval --steps 300
    bash benchmarks/smollm2_tables.sh bench

The modules import the library as `tinygpt_mlx` and each other as `benchmarks.NAME`, and carry
what else they need (decode_costs its pre-RoPE reference caches, bench_server_ttft its random
models) or import it from the package (distributed_table: tinygpt_mlx/evaluate/sharded.py's
two-rank runs, which tests/test_distributed.py checks); none imports tests/ (scripts/structure.py
counts it, tests/test_structure.py holds it at zero). They are not part of the wheel and are
not tests: tests/test_scripts.py only checks that some refuse bad arguments. Repository tools
(fetching the corpus and SmolLM2, building prompt sets, the results index, the structure
metrics) stay in scripts/.
"""
