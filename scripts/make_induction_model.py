"""Build a hand-wired 2-layer TinyGPT that answers pass-key needles by induction, to test
long-context cache policies when no trained model is at hand. No training: every weight is set.

Residual (d_model 768): [0:128] the token's embedding (random unit vector), [128:256],
[256:384], [384:512] the embeddings of the 1st, 2nd, 3rd previous tokens, [767] a constant 1.
Heads have dim 256, RoPE base 1e6 (non-traditional halves: pair i = dims i and i + 128,
angle pos * 1e6^(-i/128)).
  layer 0: three query heads share one key head (GQA); queries and key come from the constant
           dim on the 16 fastest RoPE pairs, phased so head h peaks at distance h + 1; the
           value is the token embedding, written to the h+1-th previous slot.
  layer 1: induction by trigram: the query superposes (cur, prev1, prev2) and the key
           (prev1, prev2, prev3), each through its own random rotation, on the 64 slowest
           pairs; the position whose three previous tokens equal the current trigram wins and
           its embedding is added (x4) to the residual, which the tied unembedding reads.
So "... The pass key is 48213 ... The pass key is" continues " 48213". The slow pairs rotate by
up to ~0.5 rad over 512 positions but by several radians over 8K: like a model trained on
512 tokens, it works while query-key distances stay within ~512 and degrades beyond.

    python scripts/make_induction_model.py TOKENIZER_JSON OUT.tinygpt
"""

from __future__ import annotations

import json
import math
import sys

import mlx.core as mx
import numpy as np

from tinygpt_mlx import format as fmt
from tinygpt_mlx.config import ModelConfig
from tinygpt_mlx.model import Model

DM, HD, DE, BASE, NH = 768, 256, 128, 1e6, 3
C = DM - 1
HALF = HD // 2
POS_PAIRS, SLOW = 16, list(range(64, 128))
SLOT = [slice(i * DE, (i + 1) * DE) for i in range(4)]  # cur, prev1, prev2, prev3


def build(tokenizer_json: str, seed: int = 0) -> Model:
    vocab = len(json.loads(tokenizer_json)["model"]["vocab"]) + 1
    cfg = ModelConfig(vocab_size=vocab, d_model=DM, n_layers=2, n_heads=NH, n_kv_heads=1, d_ff=1,
                      context_length=512, rope_theta=BASE)
    model = Model(cfg)
    rng = np.random.RandomState(seed)
    emb = rng.randn(vocab, DE)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    E = np.zeros((vocab, DM), np.float32)
    E[:, :DE], E[:, C] = emb, 1.0
    theta = BASE ** (-np.arange(HALF) * 2 / HD)
    s0 = math.sqrt(DM / 2)   # RMSNorm gain at layer 0 (|e| = 1, const 1)
    s1 = math.sqrt(DM / 5)   # at layer 1 (four unit vectors + const)
    w = {"embed.weight": E}
    # layer 0: previous-token heads at distances 1, 2, 3
    A = 16.0
    q = np.zeros((NH * HD, DM)); k = np.zeros((HD, DM)); v = np.zeros((HD, DM)); o = np.zeros((DM, NH * HD))
    for h in range(NH):
        for i in range(POS_PAIRS):
            q[h * HD + i, C] = A * math.cos((h + 1) * theta[i]) / s0
            q[h * HD + i + HALF, C] = -A * math.sin((h + 1) * theta[i]) / s0
        o[SLOT[h + 1], h * HD:h * HD + DE] = np.eye(DE) / s0
    for i in range(POS_PAIRS):
        k[i, C] = A / s0
    v[:DE, :DE] = np.eye(DE)
    w.update({"layers.0.attn.q_proj.weight": q, "layers.0.attn.k_proj.weight": k,
              "layers.0.attn.v_proj.weight": v, "layers.0.attn.o_proj.weight": o})
    # layer 1: trigram induction in superposition on the slow pairs (heads 1, 2 unused)
    B = 2.4
    dims = SLOW + [i + HALF for i in SLOW]            # 128 slow dims
    rot = [np.linalg.qr(rng.randn(DE, DE))[0] for _ in range(3)]
    q = np.zeros((NH * HD, DM)); k = np.zeros((HD, DM)); v = np.zeros((HD, DM)); o = np.zeros((DM, NH * HD))
    for a in range(3):
        q[dims, SLOT[a]] += B * rot[a]               # query: cur, prev1, prev2
        k[dims, SLOT[a + 1]] += B * rot[a]           # key:   prev1, prev2, prev3
    v[:DE, :DE] = np.eye(DE)
    o[:DE, :DE] = 4.0 * np.eye(DE) / s1
    w.update({"layers.1.attn.q_proj.weight": q, "layers.1.attn.k_proj.weight": k,
              "layers.1.attn.v_proj.weight": v, "layers.1.attn.o_proj.weight": o})
    for i in range(2):
        w[f"layers.{i}.mlp.gate_proj.weight"] = np.zeros((1, DM))
        w[f"layers.{i}.mlp.up_proj.weight"] = np.zeros((1, DM))
        w[f"layers.{i}.mlp.down_proj.weight"] = np.zeros((DM, 1))
    model.load_weights([(n, mx.array(np.asarray(a, np.float32))) for n, a in w.items()], strict=False)
    mx.eval(model.parameters())
    return model


if __name__ == "__main__":
    tok = open(sys.argv[1]).read()
    print(fmt.save(sys.argv[2], build(tok), tok))
