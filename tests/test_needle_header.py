"""`posttrainllm needle`'s header: its label says "top 32 pages" where the JSON records
top_pages 256; both are true, of different things (a query reads its 32 best pages, 256 tokens,
from a pool of the 256 pages per query row its pass fetches), and the header now says so."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tinygpt_mlx.cli.main import app


def test_header_says_what_a_query_reads_and_the_pool_top_pages_counts(native_path, tmp_path):
    out = tmp_path / "grid.json"
    r = CliRunner().invoke(app, ["needle", str(native_path), "--contexts", "128", "--depths", "0.5",
                                 "--seeds", "1", "--policies", "retrieval", "--kiv-hot-budget", "64",
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    retrieval = json.loads(out.read_text())["policies"]["retrieval"]["retrieval"]
    pages = retrieval["retrieve_tokens"] // retrieval["page_size"]
    header = " ".join(r.output.split())     # rich wraps the line
    assert (f"a query reads its top {pages} pages ({retrieval['retrieve_tokens']} tokens) of a pool of "
            f"{retrieval['top_pages']} pages of {retrieval['page_size']} per query row: --kiv-top-pages, "
            "the JSON's top_pages") in header
    assert retrieval["top_pages"] != pages    # the two numbers the header used to leave apart


def test_header_names_each_policy_the_grid_runs_and_no_other(native_path, tmp_path):
    """A grid of StreamingLLM and the full cache names those two, each by its label, and says
    nothing of retrieval (the header named the retrieval config alone, whatever --policies said)."""
    r = CliRunner().invoke(app, ["needle", str(native_path), "--contexts", "128", "--depths", "0.5",
                                 "--seeds", "1", "--policies", "streaming,full", "--kiv-hot-budget", "64",
                                 "--streaming-llm-sink", "4", "--kv-quantize", "fp16"])
    assert r.exit_code == 0, r.output
    header = " ".join(r.output.split())
    assert "policies streaming: fp16 + StreamingLLM sink 4 + window 64" in header, header
    assert "; full: fp16" in header, header
    assert "retrieval" not in header.split("needle grid")[0], header
