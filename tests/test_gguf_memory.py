"""What loading a GGUF holds in memory (docs/gguf.md, "Memory").

ggml's reader path (`tinygpt_mlx.ggml.tensors._read_with_gguf`) dequantises each tensor a block
of rows at a time into its MLX array: the values must be those of `gguf.quants.dequantize` over
the whole tensor (the simple path it replaced, kept here as the reference), and a tensor must be
held about once, not four times (Gemma 3 270M's token embedding took 2.7 GB at once for 671 MB).
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from tinygpt_mlx.ggml import tensors as T

Q = gguf.GGMLQuantizationType


def _write(path: Path, arrays: dict) -> Path:
    """A GGUF of bare tensors, name -> (float32 array, ggml type)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (arr, qtype) in arrays.items():
        if qtype == Q.F32:
            w.add_tensor(name, arr.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        elif arr.dtype == np.uint8:     # raw blocks (gguf's Python cannot quantise K-quants)
            w.add_tensor(name, arr, raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference(path: Path) -> dict:
    """The replaced path: each whole tensor through ggml's reader and `gguf.quants.dequantize`."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type in (Q.F32, Q.F16):
            arr = np.asarray(t.data).reshape(shape)
        else:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        out[t.name] = arr if arr.dtype == np.float16 else arr.astype(np.float32)
    return out


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")   # random K-quant scales
def test_ggml_reader_gives_whole_tensor_values_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    arrays = {
        # K-quants (256-weight blocks) as random block bytes: 2 blocks a row of Q6_K (210 bytes each), 1 of Q4_K
        "k6.weight": (rng.integers(0, 256, (37, 420), dtype=np.uint8), Q.Q6_K),
        "k4.weight": (rng.integers(0, 256, (19, 144), dtype=np.uint8), Q.Q4_K),
        "q5.weight": (rng.standard_normal((53, 96)).astype(np.float32), Q.Q5_0),
        "q8.weight": (rng.standard_normal((41, 64)).astype(np.float32), Q.Q8_0),
        "bf.weight": (rng.standard_normal((23, 48)).astype(np.float32), Q.BF16),
        "h.weight": (rng.standard_normal((29, 40)).astype(np.float32), Q.F16),
        "f.weight": (rng.standard_normal((31, 24)).astype(np.float32), Q.F32),
        "cube.weight": (rng.standard_normal((3, 7, 32)).astype(np.float32), Q.F32),
        "norm.weight": (rng.standard_normal((40,)).astype(np.float32), Q.F32),
    }
    path = _write(tmp_path / "m.gguf", arrays)
    ref = _reference(path)
    for chunk in (1, 1000, 3000, 1 << 20):   # a row at a time, uneven blocks with a remainder, whole
        monkeypatch.setattr(T, "CHUNK_BYTES", chunk)
        got = T._read_with_gguf(path).tensors
        assert set(got) == set(ref)
        for name, want in ref.items():
            have = np.array(got[name])
            assert have.shape == want.shape and have.dtype == want.dtype, (chunk, name)
            assert np.array_equal(have, want, equal_nan=True), (chunk, name)   # random fp16 scales: a few NaN


def test_ggml_reader_holds_a_tensor_about_once(tmp_path, monkeypatch):
    """A 16 MiB float32 tensor read 1 MiB at a time: numpy's allocations (tracemalloc sees them)
    stay a fraction of the tensor (the replaced path held three float32 copies in numpy), and MLX's
    peak is the tensor plus a block of rows (the rows are written in place)."""
    rows, cols = 4096, 1024
    tensor_bytes = rows * cols * 4
    rng = np.random.default_rng(1)
    path = _write(tmp_path / "big.gguf", {"big.weight": (rng.standard_normal((rows, cols)).astype(np.float32), Q.Q8_0)})
    monkeypatch.setattr(T, "CHUNK_BYTES", 1 << 20, raising=False)
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    tracemalloc.start()
    try:
        contents = T._read_with_gguf(path)
        _, numpy_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    mlx_peak = mx.get_peak_memory() - before
    assert contents.tensors["big.weight"].shape == (rows, cols)
    assert numpy_peak < tensor_bytes / 2, f"numpy held {numpy_peak / 2**20:.1f} MiB for a 16 MiB tensor"
    assert mlx_peak <= tensor_bytes + 3 * (1 << 20), f"MLX peak {mlx_peak / 2**20:.1f} MiB for a 16 MiB tensor"


def test_tokenizer_is_built_before_any_tensor_is_dequantised(tmp_path, monkeypatch, tokenizer_json):
    """Building a large vocabulary's tokenizer takes memory for a while (~400 MB for Gemma 3's
    262,144 tokens): done first, the float32 weights reuse it instead of adding to it."""
    from tests.conftest import build_llama_dir
    from tests.gguf_writer import write_gguf
    from tinygpt_mlx import loading

    src = build_llama_dir(tmp_path / "src", tokenizer_json)
    path = write_gguf(src, tmp_path / "m.gguf", quant="Q5_0")     # Q5_0: ggml's reader
    events = []
    real_dequantize, real_tok = gguf.quants.dequantize, loading.tokenizer_from_metadata
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: events.append("tensor") or real_dequantize(*a))
    monkeypatch.setattr(loading, "tokenizer_from_metadata", lambda *a: events.append("tokenizer") or real_tok(*a))
    loaded = loading.load(path)
    assert events[0] == "tokenizer" and events.count("tokenizer") == 1 and "tensor" in events
    assert loaded.tokenizer.encode("the old ship")


def test_packed_file_converted_a_tensor_at_a_time(tmp_path, tokenizer_json):
    """MLX's reader path (SmolLM2's Q4_1 file): each packed tensor is dequantised and evaluated on
    its own and the file's copy let go, so MLX's peak is the dense model plus one tensor's worth,
    not the packed file, the dense model and their temporaries at once."""
    from tests.conftest import build_llama_dir
    from tests.gguf_writer import write_gguf
    from tinygpt_mlx.ggml.load import load_gguf_model

    src = build_llama_dir(tmp_path / "src", tokenizer_json, hidden_size=256, n_layers=4, intermediate_size=1024)
    path = write_gguf(src, tmp_path / "m.gguf", quant="Q8_0")
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    model, *_ = load_gguf_model(path, "dense")
    from mlx.utils import tree_flatten
    params = tree_flatten(model.parameters())
    dense = sum(v.nbytes for _, v in params)
    largest = max(v.nbytes for _, v in params)
    peak = mx.get_peak_memory() - before
    assert all(v.dtype == mx.float32 for _, v in params)
    assert peak <= dense + 2 * largest, (f"MLX peak {peak / 2**20:.1f} MiB for {dense / 2**20:.1f} MiB of "
                                         f"weights (largest {largest / 2**20:.1f} MiB)")
