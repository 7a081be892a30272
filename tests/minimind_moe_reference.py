"""A faithful reimplementation of MiniMind's mixture-of-experts feed-forward (jingyaogong/minimind,
model/model_minimind.py: `MOEFeedForward` with its `FeedForward` experts, `MoEGate` inlined):
a Python loop over the experts, each gathering its tokens and adding its weighted output back
with `index_add_`; the aux loss from `one_hot(topk_idx).float().mean(0)`. Read from its source to
check the project's grouped version against; shares no code with minimind_parallel.moe."""
import torch
import torch.nn.functional as F
from torch import nn


class ReferenceExpert(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ReferenceMOEFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList([ReferenceExpert(config.hidden_size, config.moe_intermediate_size)
                                      for _ in range(config.num_experts)])

    def forward(self, x):
        batch_size, seq_len, hidden_dim = x.shape
        x_flat = x.view(-1, hidden_dim)
        scores = F.softmax(self.gate(x_flat), dim=-1)
        topk_weight, topk_idx = torch.topk(scores, k=self.config.num_experts_per_tok, dim=-1, sorted=False)
        if self.config.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        y = torch.zeros_like(x_flat)
        for i, expert in enumerate(self.experts):
            mask = topk_idx == i
            if mask.any():
                token_idx = mask.any(dim=-1).nonzero().flatten()
                weight = topk_weight[mask].view(-1, 1)
                y.index_add_(0, token_idx, (expert(x_flat[token_idx]) * weight).to(y.dtype))
            elif self.training:
                y[0, 0] += 0 * sum(p.sum() for p in expert.parameters())
        if self.training and self.config.router_aux_loss_coef > 0:
            load = F.one_hot(topk_idx, self.config.num_experts).float().mean(0)
            self.aux_loss = (load * scores.mean(0)).sum() * self.config.num_experts * self.config.router_aux_loss_coef
        else:
            self.aux_loss = scores.new_zeros(1).squeeze()
        return y.view(batch_size, seq_len, hidden_dim)


def reference_model(config):
    """The project's dense model with every MoE layer swapped for the reference one, the same weights
    (MiniMind's keys); forward(...) -> (logits, loss, aux_loss summed over layers as MiniMind's model)."""
    from minimind_parallel import MiniMindForCausalLM
    model = MiniMindForCausalLM(config)
    state = model.state_dict()
    for layer in model.model.layers:
        layer.mlp = ReferenceMOEFeedForward(config)
    model.load_state_dict(state, strict=True)
    return model


def reference_aux_loss(model):
    return sum([layer.mlp.aux_loss for layer in model.model.layers], torch.zeros(()))
