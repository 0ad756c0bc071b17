"""The mixture-of-experts part the Qwen MoE families share (Qwen3.5-MoE, Qwen3-VL-MoE): transformers' sparse
blocks as they are (a bare router ``weight`` [E, H] -> softmax in fp32 -> top-k, always renormalised; fused experts
``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I], dropless; Qwen3.5-MoE's shared expert behind its sigmoid gate),
run by transformers' ``grouped_mm`` experts path (what its own model runs), and the **router's load-balancing loss
exactly as transformers adds it across a pipeline**.

transformers' ``load_balancing_loss_func`` sums, over every MoE layer of a forward, each expert's top-k hits, its
router probabilities and the real rows (padding weighted out by the attention mask), and only then takes
``E * sum_e hits_e / rows * prob_e / rows``: not a sum of per-layer terms, so no stage can finish it alone. Here the
three E-vectors ride with the hidden states as one float tensor ``stats`` [3, E] (row 0 the hits: no gradient; row 1
the probability sums: the router's gradient path; row 2 the rows), right after the hidden states::

    llm      (hidden, stats, *family tensors, input_ids, attention_mask, position_ids)
    head     (logits, stats)

``llm.embed`` starts it at zero (tied to the hidden states: a stage always sends back a gradient for it), every
routed block adds its layer's three sums (its router logits taken by a forward hook, as transformers'
``OutputRecorder`` takes them), and the loss closes it: ``lm_loss + router_aux_loss_coef * aux``, per micro-batch.
A packed row counts its real tokens as the unpacked rows do (sums over tokens: no sample sees another's), padding
(segment id 0) none."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
from torch import nn

from mmpipe.config.fields import Section, option
from mmpipe.errors import ConfigError
from mmpipe.families.chat import loss as lm
from mmpipe.families.expert_dispatch import dispatch, shard_experts
from mmpipe.families.qwen_vl import products

EXPERTS_IMPLEMENTATION = "mmpipe_grouped"  # transformers' grouped_mm; on the meta device, its shapes (planning)


@dataclass
class ExpertFields(Section):
    """The routed-experts fields of a MoE text config (transformers' names)."""
    num_experts: Optional[int] = option(None, "routed experts per MoE block", ge=1)
    num_experts_per_tok: Optional[int] = option(None, "experts each token is routed to (top-k)", ge=1)
    moe_intermediate_size: Optional[int] = option(None, "an expert's MLP width", ge=1)
    router_aux_loss_coef: Optional[float] = option(None, "weight of the router's load-balancing loss added to the LM "
                                                   "loss (transformers' router_aux_loss_coef: 0.001; 0 = none)", ge=0)


EXPERT_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")  # the architecture's
EXPERT_SETTINGS = ("router_aux_loss_coef",)  # a training setting: over model.pretrained's value


def check_experts(t) -> None:
    """One line for an expert layout transformers would build wrong."""
    if t.num_experts_per_tok > t.num_experts:
        raise ConfigError(f"model.llm.num_experts_per_tok={t.num_experts_per_tok} is more than "
                          f"model.llm.num_experts={t.num_experts}: route each token to at most num_experts experts")


# ---- transformers' experts, run as its model runs them ------------------------------------------------------
def _grouped(self, hidden_states, top_k_index, top_k_weights):
    """transformers' ``grouped_mm`` experts forward (its experts split over ranks: ``expert_dispatch``); on the meta
    device (the memory plan) the same products' shapes (every routed token through one expert's matrices: what the
    grouped kernel keeps for backward)."""
    from transformers.integrations.moe import grouped_mm_experts_forward
    if getattr(self, "mmpipe_shard", None) is not None:  # split over an expert-parallel group
        return dispatch(self, hidden_states, top_k_index, top_k_weights, grouped_mm_experts_forward)
    if not hidden_states.is_meta:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    routed = hidden_states.repeat_interleave(top_k_index.shape[-1], dim=0)
    up = self._apply_gate(nn.functional.linear(routed, self.gate_up_proj[0]))
    out = nn.functional.linear(up, self.down_proj[0]) * top_k_weights.reshape(-1, 1)
    return out.view(hidden_states.shape[0], -1, hidden_states.shape[-1]).sum(1)


def use_experts(text_config) -> None:
    """The run's experts path on a transformers text config (``EXPERTS_IMPLEMENTATION``, registered once)."""
    from transformers.integrations.moe import ExpertsInterface
    if EXPERTS_IMPLEMENTATION not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, _grouped)
    text_config._experts_implementation = EXPERTS_IMPLEMENTATION


def init_experts(module: nn.Module, std: float) -> None:
    """transformers' init of what ``init_transformer_part`` does not know: the fused expert matrices and the router's
    bare weight, N(0, std) (a block built alone has an empty experts tensor and a zero router)."""
    for m in module.modules():
        for name in ("gate_up_proj", "down_proj"):
            p = m._parameters.get(name)
            if p is not None and p.dim() == 3:
                nn.init.normal_(p, std=std)
        if is_router(m):
            nn.init.normal_(m.weight, std=std)


def is_router(m: nn.Module) -> bool:
    """transformers' top-k router: a bare ``weight`` [E, H] with ``top_k`` (Qwen3.5-MoE's, Qwen3-VL-MoE's)."""
    return hasattr(m, "top_k") and hasattr(m, "num_experts") and isinstance(m._parameters.get("weight"), nn.Parameter)


def routed(block_cls):
    """``block_cls`` (a decoder block) that keeps its router's logits of the last forward (``router_logits``; None
    for a dense block: Qwen3-VL-MoE's ``mlp_only_layers``), as transformers' ``OutputRecorder`` records them."""

    class RoutedBlock(block_cls):
        def __init__(self, config, layer_idx: int):
            super().__init__(config, layer_idx)
            gate = getattr(self.mlp, "gate", None)
            self.top_k = gate.top_k if isinstance(gate, nn.Module) and is_router(gate) else None  # (None: dense)
            self.router_logits = None
            if self.top_k is not None:
                gate.register_forward_hook(self._keep)

        def _keep(self, module, args, out):
            self.router_logits = out[0]

    RoutedBlock.__name__ = RoutedBlock.__qualname__ = "Routed" + block_cls.__name__
    return RoutedBlock


# ---- the router statistics through the layers ---------------------------------------------------------------
def add_router_stats(stats: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor, top_k: int) -> torch.Tensor:
    """``stats`` plus one layer's (top-k hits, router probabilities, rows) over the real tokens of ``mask`` (segment
    ids: 0 = padding), as ``load_balancing_loss_func`` accumulates them (its operations, in its order)."""
    E = logits.shape[-1]
    w = (mask > 0).reshape(-1).to(device=logits.device, dtype=torch.float32)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    hits = torch.zeros(E, dtype=torch.float32, device=logits.device).scatter_add_(0, chosen.reshape(-1),
                                                                                 w.repeat_interleave(top_k))
    prob = (probs.float() * w.unsqueeze(-1)).sum(dim=0)
    return stats + torch.stack([hits.detach(), prob, w.sum().expand(E)])


def aux_loss(stats: torch.Tensor) -> torch.Tensor:
    """transformers' load-balancing loss of a forward's summed router statistics."""
    rows = stats[2]
    return torch.sum((stats[0] / rows) * (stats[1] / rows).unsqueeze(0)) * stats.shape[-1]


def embed_step(base, part, acts, num_experts: int):
    """``llm.embed``, then the zero statistics (tied to the hidden states) after them."""
    out = base(part, acts)
    h = out[0]
    zero = torch.zeros((3, num_experts), dtype=torch.float32, device=h.device)
    if h.requires_grad:
        zero = zero + h.reshape(-1)[:1].sum().float() * 0.0
    return (h, zero) + tuple(out[1:])


def block_step(base, part, acts):
    """A decoder block (the statistics set aside), then its router's statistics added (a dense block: passed on)."""
    stats = acts[1]
    out = base(part, (acts[0],) + tuple(acts[2:]))
    logits, part.router_logits = part.router_logits, None
    if logits is not None:
        stats = add_router_stats(stats, logits, acts[-2], part.top_k)
    elif out[0].requires_grad and not stats.requires_grad:  # a dense block on a stage whose inputs came as constants
        stats = stats + out[0].reshape(-1)[:1].sum().float() * 0.0  # (frozen_first): the statistics sent on want a
    return (out[0], stats) + tuple(out[1:])  # gradient back like the hidden states


def head_step(base, part, acts):
    """The LM head: (logits, statistics)."""
    return base(part, (acts[0],) + tuple(acts[2:])), acts[1]


# ---- the family side ----------------------------------------------------------------------------------------
class RoutedExperts:
    """What a MoE family adds (listed first: ``class F(RoutedExperts, ..., Qwen25VLFamily)``): its decoder's layer
    steps carry the router statistics (``embed_step`` / ``block_step`` / ``head_step``), its blocks' experts and
    routers initialised as transformers does, its loss adds the load-balancing loss, and each step logs ``lm_loss``,
    ``aux_loss`` and the experts' load (tokens routed per expert in the step, averaged over the MoE layers: min, max,
    and ``expert_imbalance`` = max / mean)."""
    routed_experts = True  # (parallel.expert_parallel splits its experts)
    expert_shard = None  # while a run builds its layers with expert parallelism: each block keeps its slice

    def __init__(self, model_cfg, seed: int = 0):
        super().__init__(model_cfg, seed)
        t = self.text_cfg
        self.num_experts, self.top_k = t.num_experts, t.num_experts_per_tok
        self.aux_coef = float(t.router_aux_loss_coef or 0.0)
        wrap = {"llm.embed": partial(embed_step, num_experts=self.num_experts)}
        self._layers = [la._replace(step=partial(wrap.get(la.name, block_step if la.name.startswith("llm.blocks.")
                                                         else head_step), la.step))
                        if la.name.startswith("llm.") else la for la in self._layers]
        self._moe_step = None

    def build_unseeded(self, name: str):
        module = super().build_unseeded(name)
        if name.startswith("llm.blocks."):
            init_experts(module, getattr(self.text_cfg, "initializer_range", 0.02))
        return module

    def build_layer(self, name: str):
        """The layer as built (weights loaded, adapters added); with ``expert_shard`` set, its experts cut to this
        rank's slice at once: a rank never holds more than one block's whole experts."""
        module = super().build_layer(name)
        if self.expert_shard is not None:
            shard_experts(module, self.expert_shard)
        return module

    def source_weight(self, src, mine: str, shape) -> tuple:
        """The fused expert matrices from a checkpoint as transformers loads them (its ``conversion_mapping``): one
        tensor per expert (``experts.N.gate_proj`` / ``up_proj`` / ``down_proj``: what Qwen3.5-MoE checkpoints and
        ``save_pretrained`` hold) stacked, gate rows before up rows; a fused tensor in transformers' layout as is,
        or transposed where only its transpose has the layer's shape (Qwen3-VL-MoE's released checkpoints:
        [E, H, 2I] and [E, I, H])."""
        kind = mine.rsplit(".", 1)[1]
        if not mine.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return super().source_weight(src, mine, shape)
        theirs, w = super().source_weight(src, mine, shape)
        if w is not None:
            if tuple(w.shape) != tuple(shape) and tuple(w.transpose(1, 2).shape) == tuple(shape):
                w = w.transpose(1, 2).contiguous()
            return theirs, w
        stem = mine[:-len(kind)]
        parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        names = [[self.source_name(src, f"{stem}{e}.{p}.weight") for p in parts] for e in range(shape[0])]
        if any(n is None for row in names for n in row):
            return None, None
        w = torch.stack([torch.cat([src.get(n) for n in row], dim=0) for row in names])
        return names[0][0].replace(".experts.0.", ".experts.N.", 1), w

    def moe_layers(self) -> list:
        """The decoder blocks with routed experts."""
        return [n for n in self.layer_names() if n.startswith("llm.blocks.") and self.routed_block(int(n.rsplit(".", 1)[1]))]

    def routed_block(self, index: int) -> bool:
        return True

    def matmuls(self, name: str, mb) -> list:
        """The base decoder's products with a routed block's MLP replaced by its experts' (active parameters)."""
        out = super().matmuls(name, mb)
        if name.startswith("llm.blocks.") and self.routed_block(int(name.rsplit(".", 1)[1])):
            dense = [p for p in out if not (p.weight or "").startswith("mlp.")]
            out = dense + products.expert_products(mb.rows * mb.seq_len, self.text_cfg)
        return out

    # ---- loss and metrics ---------------------------------------------------------------------------------
    def loss(self, outputs, labels, normaliser=None) -> torch.Tensor:
        logits, stats = outputs
        lm_loss = lm.causal_lm_loss(logits, labels, normaliser)
        aux = aux_loss(stats)
        self._note(lm_loss, aux, stats)
        return lm_loss + self.aux_coef * aux.to(lm_loss.device)

    def eval_stats(self, outputs, labels) -> torch.Tensor:
        return lm.token_stats(outputs[0], labels)

    def _note(self, lm_loss, aux, stats) -> None:
        """This step's sums on the last stage (device tensors: read once, in the step's gather)."""
        row = torch.cat([torch.stack([lm_loss.detach().double(), aux.detach().double(),
                                      torch.ones((), dtype=torch.float64, device=lm_loss.device)]),
                         stats[0].detach().double().to(lm_loss.device)])
        self._moe_step = row if self._moe_step is None else self._moe_step + row

    def begin_step(self) -> None:
        self._moe_step = None

    def step_columns(self, device) -> torch.Tensor:
        """This rank's step sums (micro-batches' lm loss, aux loss, count, then tokens per expert); zeros on a rank
        without the loss."""
        row, self._moe_step = self._moe_step, None
        if row is None:
            return torch.zeros(3 + self.num_experts, dtype=torch.float64, device=device)
        return row.to(device)

    def step_record(self, columns) -> dict:
        """``lm_loss`` and ``aux_loss`` (means over the step's micro-batches, as ``loss``) and the experts' load
        from every rank's ``step_columns``."""
        total = columns.sum(0)
        n = total[2]
        if n <= 0:
            return {}
        load = total[3:] / max(len(self.moe_layers()), 1)
        mean = load.mean()
        return {"lm_loss": float(total[0] / n), "aux_loss": float(total[1] / n),
                "expert_load_min": float(load.min()), "expert_load_max": float(load.max()),
                "expert_imbalance": float(load.max() / mean) if mean > 0 else 0.0}
