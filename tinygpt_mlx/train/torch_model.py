"""A PyTorch re-implementation of `tinygpt_mlx.model.Model`, used only to train faster on CPU.

It matches the MLX model exactly: same parameter names and shapes (so `state_dict()` maps 1:1
onto `tree_flatten(Model(cfg).parameters())`), RMSNorm `x * rsqrt(mean(x^2) + eps) * w`,
non-traditional (half-split) RoPE with base `rope_theta`, grouped-query attention where query
head h reads kv head h // (n_heads // n_kv_heads), a gated SiLU MLP, tied embeddings and the
YOCO option (`ModelConfig.kv_owner`): a shared layer has no k_proj/v_proj and attends to its
owner's rotated K/V. `tests/test_train.py` checks the logits against the MLX model.
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from ..lazy import lazy

model_module = lazy("tinygpt_mlx.model")   # MLX's side (mlx-lm's code): only for the export


def require_torch():
    try:
        import torch  # noqa: PLC0415
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "training needs PyTorch (CPU build): pip install 'posttrainllm[train]' "
            "(or pip install torch==2.13.0)") from None
    return torch


def build_model(cfg: ModelConfig):
    """Return a torch `nn.Module` for `cfg` (torch is imported lazily)."""
    torch = require_torch()
    nn = torch.nn
    F = torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, dims: int, eps: float):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dims))
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def rope(x, offset: int, base: float):
        # x: [B, H, L, D]; mlx nn.RoPE(traditional=False): rotate halves (x1, x2).
        D = x.shape[-1]
        half = D // 2
        inv = base ** (-torch.arange(0, half, dtype=torch.float32, device=x.device) / half)
        pos = torch.arange(offset, offset + x.shape[-2], dtype=torch.float32, device=x.device)
        ang = pos[:, None] * inv[None, :]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    class Attention(nn.Module):
        def __init__(self, owns_kv: bool):
            super().__init__()
            self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
            self.owns_kv = owns_kv
            self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
            if owns_kv:
                self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
                self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
            self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

        def forward(self, x, shared_kv=None):
            B, L, _ = x.shape
            q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
            q = rope(q, 0, cfg.rope_theta)
            if shared_kv is None:
                k = self.k_proj(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
                v = self.v_proj(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
                k = rope(k, 0, cfg.rope_theta)
            else:
                k, v = shared_kv
            rep = self.n_heads // self.n_kv_heads
            kk = k.repeat_interleave(rep, dim=1) if rep > 1 else k
            vv = v.repeat_interleave(rep, dim=1) if rep > 1 else v
            out = F.scaled_dot_product_attention(q, kk, vv, is_causal=L > 1,
                                                 scale=self.head_dim ** -0.5)
            out = out.transpose(1, 2).reshape(B, L, -1)
            return self.o_proj(out), (k, v)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self, owns_kv: bool):
            super().__init__()
            self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.attn = Attention(owns_kv)
            self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.mlp = MLP()

        def forward(self, x, shared_kv=None):
            r, kv = self.attn(self.attn_norm(x), shared_kv)
            h = x + r
            return h + self.mlp(self.mlp_norm(h)), kv

    class TorchTinyGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = cfg
            owner = cfg.kv_owner
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.layers = nn.ModuleList(Block(owner[i] == i) for i in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            if not cfg.tie_embeddings:
                self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            self.reset_parameters()

        def reset_parameters(self):
            std = 0.02
            out_std = std / math.sqrt(2 * cfg.n_layers)
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    nn.init.ones_(p)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    nn.init.normal_(p, std=out_std)
                else:
                    nn.init.normal_(p, std=std)

        def forward(self, tokens):
            h = self.embed(tokens)
            owner = cfg.kv_owner
            fetched = {}
            for i, layer in enumerate(self.layers):
                shared = fetched[owner[i]] if owner[i] != i else None
                h, kv = layer(h, shared)
                fetched.setdefault(i, kv)
            h = self.norm(h)
            if cfg.tie_embeddings:
                return h @ self.embed.weight.t()
            return self.lm_head(h)

    return TorchTinyGPT()


def to_mlx(torch_model):
    """An MLX `Model` holding a copy of `torch_model`'s weights (names map 1:1)."""
    import mlx.core as mx  # noqa: PLC0415
    from mlx.utils import tree_flatten, tree_unflatten  # noqa: PLC0415

    model = model_module.Model(torch_model.config)
    expected = dict(tree_flatten(model.parameters()))
    state = {k: v.detach().to("cpu").float().numpy() for k, v in torch_model.state_dict().items()}
    if set(state) != set(expected):
        raise RuntimeError(f"parameter names differ: torch-only {sorted(set(state) - set(expected))[:5]}, "
                           f"mlx-only {sorted(set(expected) - set(state))[:5]}")
    model.update(tree_unflatten([(k, mx.array(state[k])) for k in expected]))
    mx.eval(model.parameters())
    return model


def load_from_mlx(torch_model, mlx_model) -> None:
    """Copy an MLX model's weights into `torch_model` (the inverse of `to_mlx`)."""
    import numpy as np  # noqa: PLC0415
    from mlx.utils import tree_flatten  # noqa: PLC0415

    torch = require_torch()
    state = {k: torch.from_numpy(np.array(v)) for k, v in tree_flatten(mlx_model.parameters())}
    torch_model.load_state_dict(state, strict=True)
