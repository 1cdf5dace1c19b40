"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral, OLMoE, Qwen3-Next, gpt-oss) over the model's ops (engine-core
process).

The router is a linear layer; a softmax over its logits in fp32 picks each token's top_k experts, and
their probabilities, renormalised where the family asks, weight the experts' outputs. gpt-oss's router
has a bias and takes the top_k logits first, their softmax the weights; its experts have biases and the
clamped SwiGLU (MoeArgs.clamped_swiglu). Batch invariance
holds as for the dense MLP: every token is routed by its own row alone, each expert's products run on
the rows routed to it through `ops.linear` (row by row the same numbers in any batch on the CPU
kernels), nothing is dropped for capacity, and a token's weighted outputs are summed in one fixed
order, its experts' ids ascending (Hugging Face's order, whose loop adds the experts by id). A shared
expert (Qwen3-Next) sees every token; its output, times sigmoid(shared_expert_gate(x)), is added last.
"""

from __future__ import annotations

import torch
from torch import nn

from coreserve.worker.models.config import DecoderArgs
from coreserve.worker.models.ops import ModelOps


class Expert(nn.Module):
    """One expert's SwiGLU MLP; gate and up fused as the dense layers' are."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)


class SparseMoe(nn.Module):
    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        moe = args.moe
        assert moe is not None
        self.top_k, self.norm_topk_prob, self.clamped_swiglu = moe.top_k, moe.norm_topk_prob, moe.clamped_swiglu
        has_bias = moe.clamped_swiglu is not None
        self.gate = nn.Linear(args.hidden_size, moe.num_experts, bias=has_bias)  # the router
        self.experts = nn.ModuleList(
            Expert(args.hidden_size, moe.intermediate_size, has_bias) for _ in range(moe.num_experts)
        )
        shared_width = moe.shared_intermediate_size
        self.shared_expert = Expert(args.hidden_size, shared_width) if shared_width else None
        if self.shared_expert is not None:
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor, ops: ModelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> each token's experts [T, top_k] int64, most probable first (HF's router
        order), and their weights [T, top_k] in x's dtype."""
        if self.clamped_swiglu is not None:  # gpt-oss: the top_k logits, then their softmax
            top, experts = torch.topk(ops.linear(self.gate, x).float(), self.top_k, dim=-1)
            return experts, torch.softmax(top, dim=-1).to(x.dtype)
        probs = torch.softmax(ops.linear(self.gate, x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, ops: ModelOps) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (the post-attention norm's output) -> (this rank's partial MLP output
        [T, hidden], the routed experts [T, top_k])."""
        experts, weights = self.route(x, ops)
        order = experts.argsort(dim=-1)  # each token's experts by id: the sum's fixed order
        by_id, weights = experts.gather(-1, order), weights.gather(-1, order)
        num_tokens, k = by_id.shape
        outputs = x.new_empty(num_tokens * k, x.shape[-1])  # row t k + j: token t's j-th expert by id
        flat = by_id.flatten()
        slots_by_expert = flat.argsort(stable=True)  # one sort groups every expert's slots
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        start = 0
        for expert_id, count in enumerate(counts):
            if not count:
                continue
            slots = slots_by_expert[start : start + count]
            start += count
            expert = self.experts[expert_id]
            hidden = self._activation(ops.linear(expert.gate_up_proj, x[slots // k]), ops)
            outputs[slots] = ops.linear(expert.down_proj, hidden)
        outputs = outputs.view(num_tokens, k, -1)
        total = outputs[:, 0] * weights[:, :1]
        for j in range(1, k):
            total = total + outputs[:, j] * weights[:, j : j + 1]
        if self.shared_expert is not None:
            shared_mlp = self.shared_expert
            shared = ops.linear(shared_mlp.down_proj, ops.silu_mul(ops.linear(shared_mlp.gate_up_proj, x)))
            total = total + ops.sigmoid(ops.linear(self.shared_expert_gate, x)) * shared
        return total, experts

    def _activation(self, gate_up: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        """[rows, 2 I] -> [rows, I]: SwiGLU, or gpt-oss's clamped one."""
        if self.clamped_swiglu is None:
            return ops.silu_mul(gate_up)
        return ops.clamped_swiglu(gate_up, *self.clamped_swiglu)
