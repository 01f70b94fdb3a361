"""Small torch modules shaped like the MoE blocks of HF models (their
attribute names and forward semantics), for kt.hf tests without transformers."""
import functools

import torch
import torch.utils.checkpoint
from torch import nn
import torch.nn.functional as F


class QwenMLP(nn.Module):
    def __init__(self, H, I, bias=False, device=None):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=bias, device=device)
        self.up_proj = nn.Linear(H, I, bias=bias, device=device)
        self.down_proj = nn.Linear(I, H, bias=bias, device=device)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MixtralExpert(nn.Module):
    def __init__(self, H, I, device=None):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False, device=device)
        self.w2 = nn.Linear(I, H, bias=False, device=device)
        self.w3 = nn.Linear(H, I, bias=False, device=device)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


def _expert_loop(experts, h, ids, weights):
    """The HF eager loop: per expert, gather its tokens, run, scale, scatter."""
    out = torch.zeros_like(h)
    mask = F.one_hot(ids, num_classes=len(experts)).permute(2, 1, 0)
    for e in range(len(experts)):
        slot, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        y = experts[e](h[tok]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(h.dtype))
    return out


class Qwen2MoeSparseMoeBlock(nn.Module):
    """Qwen2-MoE: softmax top-k (norm_topk_prob), sigmoid-gated shared expert."""

    def __init__(self, H, I, E, k, shared_I, norm_topk_prob=False):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, k, norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([QwenMLP(H, I) for _ in range(E)])
        self.shared_expert = QwenMLP(H, shared_I)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden_states):
        B, S, H = hidden_states.shape
        h = hidden_states.view(-1, H)
        logits = self.gate(h)
        w = F.softmax(logits, dim=1, dtype=torch.float)
        w, ids = torch.topk(w, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(h.dtype)
        out = _expert_loop(self.experts, h, ids, w)
        out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out.reshape(B, S, H), logits


class Qwen3MoeSparseMoeBlock(nn.Module):
    """expert_device="meta" builds the routed experts without memory, as a
    host does before loading them from a checkpoint."""

    def __init__(self, H, I, E, k, norm_topk_prob=True, expert_device=None):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, k, norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([QwenMLP(H, I, device=expert_device) for _ in range(E)])

    def forward(self, hidden_states):
        B, S, H = hidden_states.shape
        h = hidden_states.view(-1, H)
        logits = self.gate(h)
        w = F.softmax(logits, dim=1, dtype=torch.float)
        w, ids = torch.topk(w, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        out = _expert_loop(self.experts, h, ids, w.to(h.dtype))
        return out.reshape(B, S, H), logits


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, H, I, E, k, expert_device=None):
        super().__init__()
        self.num_experts, self.top_k, self.jitter_noise = E, k, 0.0
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([MixtralExpert(H, I, device=expert_device) for _ in range(E)])

    def forward(self, hidden_states):
        B, S, H = hidden_states.shape
        h = hidden_states.view(-1, H)
        logits = self.gate(h)
        w = F.softmax(logits, dim=1, dtype=torch.float)
        w, ids = torch.topk(w, self.top_k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(h.dtype)
        return _expert_loop(self.experts, h, ids, w).reshape(B, S, H), logits


class DeepseekGate(nn.Module):
    """DeepSeek-V3-style router: sigmoid scores, bias-corrected top-k,
    normalised, scaled; returns (topk_idx, topk_weight)."""

    def __init__(self, H, E, k, scaling=2.5):
        super().__init__()
        self.top_k, self.scaling = k, scaling
        self.weight = nn.Parameter(torch.randn(E, H) / H ** 0.5)
        self.register_buffer("e_score_correction_bias", torch.randn(E) * 0.1)

    def forward(self, hidden_states):
        h = hidden_states.view(-1, hidden_states.shape[-1])
        scores = torch.sigmoid(F.linear(h.float(), self.weight.float()))
        _, idx = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1)
        w = scores.gather(1, idx)
        w = w / w.sum(dim=-1, keepdim=True) * self.scaling
        return idx, w


class DeepseekV3MoE(nn.Module):
    def __init__(self, H, I, E, k, shared_I):
        super().__init__()
        self.num_experts_per_tok = k
        self.gate = DeepseekGate(H, E, k)
        self.experts = nn.ModuleList([QwenMLP(H, I) for _ in range(E)])
        self.shared_experts = QwenMLP(H, shared_I)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        idx, w = self.gate(hidden_states)
        h = hidden_states.view(-1, shape[-1])
        out = _expert_loop(self.experts, h, idx, w.to(h.dtype)).view(*shape)
        return out + self.shared_experts(hidden_states)


class FusedExperts(nn.Module):
    """transformers v5 experts: gate_up_proj [E, 2I, H] (gate rows first),
    down_proj [E, H, I]; forward(hidden, top_k_index, top_k_weights)."""

    def __init__(self, H, I, E):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) / H ** 0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) / I ** 0.5)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, slot = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            gate, up = F.linear(hidden_states[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])
            out.index_add_(0, tok, y * top_k_weights[tok, slot, None])
        return out


class FusedMoeBlock(nn.Module):
    def __init__(self, H, I, E, k):
        super().__init__()
        self.top_k = k
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = FusedExperts(H, I, E)

    def forward(self, hidden_states):
        B, S, H = hidden_states.shape
        h = hidden_states.view(-1, H)
        logits = self.gate(h)
        w, ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        return self.experts(h, ids, w.to(h.dtype)).view(B, S, H), logits


class GptOssExperts(nn.Module):
    """gpt-oss experts (dequantized form): gate_up_proj [E, H, 2I] in x out with
    gate/up interleaved, biases, clamped swiglu; dense routing weights [N, E].
    is_transposed as transformers 5 marks it (PEFT reads its parameters as
    [E, in, out] by it)."""

    is_transposed = True

    def __init__(self, H, I, E):
        super().__init__()
        self.num_experts, self.alpha, self.limit = E, 1.702, 7.0
        self.gate_up_proj = nn.Parameter(torch.randn(E, H, 2 * I) / H ** 0.5 * 4)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * I) * 0.5)
        self.down_proj = nn.Parameter(torch.randn(E, I, H) / I ** 0.5)
        self.down_proj_bias = nn.Parameter(torch.randn(E, H) * 0.1)

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, _ = torch.where(router_indices == e)
            if tok.numel() == 0:
                continue
            gu = hidden_states[tok] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate, up = gu[..., ::2], gu[..., 1::2]
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            glu = gate * torch.sigmoid(gate * self.alpha)
            y = ((up + 1) * glu) @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, tok, y * routing_weights[tok, e, None])
        return out


class GptOssRouter(nn.Module):
    def __init__(self, H, E, k):
        super().__init__()
        self.top_k, self.num_experts = k, E
        self.weight = nn.Parameter(torch.randn(E, H) / H ** 0.5)
        self.bias = nn.Parameter(torch.zeros(E))

    def forward(self, h):
        logits = F.linear(h, self.weight, self.bias)
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.zeros_like(logits).scatter_(1, idx, F.softmax(top, dim=1))
        return scores, idx


class GptOssMLP(nn.Module):
    def __init__(self, H, I, E, k):
        super().__init__()
        self.router = GptOssRouter(H, E, k)
        self.experts = GptOssExperts(H, I, E)

    def forward(self, hidden_states):
        B, S, H = hidden_states.shape
        h = hidden_states.reshape(-1, H)
        scores, idx = self.router(h)
        out = self.experts(h, router_indices=idx, routing_weights=scores)
        return out.reshape(B, S, H), scores


def round_params_to_bf16(model):
    """kt stores base expert weights in bf16; rounding them first makes the
    torch model and the kt model compute with the same weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


class Decoder(nn.Module):
    """A few pre-norm layers: causal attention (torch) + an MoE block.
    gradient_checkpointing_enable() behaves as transformers' does."""

    def __init__(self, vocab, H, heads, layers, make_moe):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, H)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.input_layernorm = nn.LayerNorm(H)
            layer.self_attn = nn.MultiheadAttention(H, heads, batch_first=True)
            layer.post_attention_layernorm = nn.LayerNorm(H)
            layer.mlp = make_moe()
            self.layers.append(layer)
        self.norm = nn.LayerNorm(H)
        self.lm_head = nn.Linear(H, vocab, bias=False)
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = None

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        """As PreTrainedModel.gradient_checkpointing_enable: each decoder
        layer runs under torch.utils.checkpoint.checkpoint while training,
        reentrant unless the kwargs say use_reentrant=False."""
        kwargs = gradient_checkpointing_kwargs or {"use_reentrant": True}
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint, **kwargs)
        self.gradient_checkpointing = True

    @staticmethod
    def _layer(layer, h, mask):
        a = layer.input_layernorm(h)
        h = h + layer.self_attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        m = layer.mlp(layer.post_attention_layernorm(h))
        return h + (m[0] if isinstance(m, tuple) else m)

    def forward(self, tokens):
        S = tokens.shape[1]
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                h = self._gradient_checkpointing_func(functools.partial(self._layer, layer), h, mask)
            else:
                h = self._layer(layer, h, mask)
        return self.lm_head(self.norm(h))
