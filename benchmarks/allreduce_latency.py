"""Ring all-reduce latency (docs/distributed.md): run under mlx.launch, e.g.

    mlx.launch -n 2 --backend ring -- python -m benchmarks.allreduce_latency

For each message size (one all-reduce of a decode step's hidden state: d_model values), the
median time of one `mx.distributed.all_sum` over 200 calls; rank 0 prints one line per size.
"""
import statistics
import time

import mlx.core as mx

g = mx.distributed.init(strict=True)
for n, dtype in ((256, mx.float32), (4096, mx.bfloat16), (8192, mx.bfloat16)):
    x = mx.ones((1, 1, n), dtype=dtype)
    for _ in range(20):
        mx.eval(mx.distributed.all_sum(x, group=g))
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=g))
        times.append(time.perf_counter() - t0)
    if g.rank() == 0:
        print(f"{n} x {dtype} ({n * x.itemsize} B): median {statistics.median(times) * 1e6:.0f} us, "
              f"p10 {sorted(times)[20] * 1e6:.0f} us")
