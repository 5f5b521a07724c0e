"""The DFlash drafter: a small block-diffusion transformer conditioned on target hidden states.

For each anchor position `a` of a sequence the drafter gets a block of `block_size` slots: slot 0
is the anchor token (known), slots 1.. are the mask token. It predicts the tokens at a+1 ..
a+block_size-1 in ONE parallel pass. Every layer attends, from the block's slots, to
  - the target's context features at positions 0..a-1, strictly before the anchor (the captured
    layers' hidden states, concatenated and projected to the drafter's width). At inference the
    anchor is the token the target has just sampled and not yet run, so its state does not exist
    (SpecForge's mask is `kv_idx < anchor` for the same reason), and
  - all slots of its own block (bidirectional: block diffusion, not autoregressive).
Positions are rotary: context t at t, slot j of anchor a at a+j.

The token embedding and lm_head are the TARGET's, frozen (`TargetHead`). Logits are computed only
for the block slots, never for the whole sequence; so are the verifier (target) logits: the target's
final hidden states are gathered at the anchors' block positions first, then lm_head is applied.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


@dataclass
class DrafterConfig:
    hidden_size: int  # = the target's hidden size (embedding and lm_head are shared with it)
    n_target_layers: int  # captured target layers feeding the context features
    vocab_size: int
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    block_size: int = 16
    mask_token_id: int = -1  # -1: the last (padding) row of the vocab
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.mask_token_id < 0:
            self.mask_token_id = self.vocab_size + self.mask_token_id
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2 (anchor + at least one predicted token)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# Drafter shapes by name; the hidden size, vocab and captured layers come from the target.
DRAFTER_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"num_layers": 2, "num_heads": 4, "intermediate_size": 512},
    # 5 layers at the width of a 1024-wide target (qwen35-0.8b): the reference drafter's depth
    # for the small target of bench/multigpu.py.
    "small": {"num_layers": 5, "num_heads": 8, "intermediate_size": 3584},
    # ~1.7B-class drafter of the reference run, for a 5120-wide target: 5 layers.
    "reference": {"num_layers": 5, "num_heads": 32, "intermediate_size": 17408},
}


def drafter_config(spec: str, hidden_size: int, n_target_layers: int, vocab_size: int, block_size: int
                   ) -> DrafterConfig:
    """A preset name, or a JSON file of DrafterConfig fields (target-derived fields are filled in)."""
    if spec in DRAFTER_PRESETS:
        fields = dict(DRAFTER_PRESETS[spec])
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"--drafter {spec!r}: neither a preset ({', '.join(DRAFTER_PRESETS)}) nor a JSON file")
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"--drafter {path}: not JSON ({exc})") from None
        known = set(DrafterConfig.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"--drafter {path}: unknown field(s) {', '.join(unknown)}")
    fields.setdefault("block_size", block_size)
    return DrafterConfig(**{"hidden_size": hidden_size, "n_target_layers": n_target_layers,
                            "vocab_size": vocab_size, **fields})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding. x [B, heads, N, d], pos [B, N]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.to(torch.float32)[:, None, :, None] * inv  # [B, 1, N, d/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, self.heads, self.theta = cfg.hidden_size, cfg.num_heads, cfg.rope_theta
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, h, bias=False)
        self.v = nn.Linear(h, h, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, pos_q: torch.Tensor, pos_kv: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [B, N, H] block slots; ctx [B, T, H] context features; mask [B, N, T+N] (True = attend)."""
        b, n, h = x.shape
        y = self.attn_norm(x)
        kv_in = torch.cat([ctx, y], dim=1)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, t.shape[1], self.heads, h // self.heads).transpose(1, 2)

        q = rope(split(self.q(y)), pos_q, self.theta)
        k = rope(split(self.k(kv_in)), pos_kv, self.theta)
        att = F.scaled_dot_product_attention(q, k, split(self.v(kv_in)), attn_mask=mask[:, None])
        x = x + self.o(att.transpose(1, 2).reshape(b, n, h))
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class TargetHead(nn.Module):
    """The target's frozen token embedding and lm_head (loaded from the target or its extraction)."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight.float().clone(), freeze=True)
        self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_head_weight.float().clone(), requires_grad=False)


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.n_target_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.ctx_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, hidden: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor,
                lengths: torch.Tensor) -> torch.Tensor:
        """Drafter hidden states of the block slots.

        hidden [B, T, n_layers*H] target context; block_embeds [B, A, K, H]; anchors [B, A] (-1 =
        no anchor); lengths [B]. Returns [B, A, K, H].
        """
        bsz, n_anchor, k, h = block_embeds.shape
        t = hidden.shape[1]
        ctx = self.ctx_norm(self.fc(hidden))
        x = block_embeds.reshape(bsz, n_anchor * k, h)
        slot = torch.arange(k, device=x.device)
        anchor_of_q = anchors.clamp(min=0)[:, :, None].expand(bsz, n_anchor, k).reshape(bsz, -1)  # [B, N]
        pos_q = anchor_of_q + slot.repeat(n_anchor)[None]
        pos_kv = torch.cat([torch.arange(t, device=x.device).expand(bsz, t), pos_q], dim=1)
        # context t visible to slots of anchor a iff t < a: strictly before the anchor, as at inference
        ctx_pos = torch.arange(t, device=x.device)
        see_ctx = (ctx_pos[None, None] < anchor_of_q[:, :, None]) & (ctx_pos[None, None] < lengths[:, None, None])
        block_id = torch.arange(n_anchor, device=x.device).repeat_interleave(k)
        see_block = (block_id[:, None] == block_id[None, :]).expand(bsz, -1, -1)
        mask = torch.cat([see_ctx, see_block], dim=2)
        for layer in self.layers:
            x = layer(x, ctx, pos_q, pos_kv, mask)
        return self.norm(x).view(bsz, n_anchor, k, h)

    @torch.no_grad()
    def match_output_scale(self, lm_head_weight: torch.Tensor) -> None:
        """Initialise the final norm so logits through the frozen head start with unit std.

        A trained target's lm_head rows have norms near 1 and this is close to a no-op; a random-init
        target (std 0.02) would otherwise give near-uniform logits that take many steps to sharpen.
        """
        logit_std = float(lm_head_weight.float().std()) * math.sqrt(self.cfg.hidden_size)
        self.norm.weight.fill_(1.0 / max(logit_std, 1e-6))

    def save(self, path: Path) -> None:
        torch.save({"config": asdict(self.cfg), "state_dict": self.state_dict()}, path)


def sample_anchors(lengths: torch.Tensor, n_anchors: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """[B, n_anchors] anchor positions per row, distinct, with a full block after them; -1 = none.

    An anchor a needs tokens a+1 .. a+block_size-1 in the row, so a <= len - block_size.
    """
    out = torch.full((len(lengths), n_anchors), -1, dtype=torch.long)
    for r, n in enumerate(lengths.tolist()):
        choices = n - block_size + 1
        if choices <= 0:
            continue
        pick = torch.randperm(choices, generator=gen)[:n_anchors]
        out[r, : len(pick)] = pick.sort().values
    return out


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(block token ids [B, A, K]: anchor token then masks; labels [B, A, K-1]: the true next tokens)."""
    offs = torch.arange(block_size, device=input_ids.device)
    valid = anchors >= 0
    idx = (anchors.clamp(min=0)[:, :, None] + offs).clamp(max=input_ids.shape[1] - 1)  # [B, A, K]
    truth = torch.gather(input_ids[:, None, :].expand(-1, anchors.shape[1], -1), 2, idx)
    blocks = torch.full_like(truth, mask_token_id)
    blocks[:, :, 0] = truth[:, :, 0]
    labels = truth[:, :, 1:].masked_fill(~valid[:, :, None], IGNORE_INDEX)
    return blocks, labels


def gather_block_positions(final: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Target final hidden states that predict the block's tokens: positions a .. a+K-2. [B, A, K-1, H].

    Only these rows ever reach lm_head (verifier logits at the anchors, not over the sequence).
    """
    offs = torch.arange(block_size - 1, device=final.device)
    idx = (anchors.clamp(min=0)[:, :, None] + offs).clamp(max=final.shape[1] - 1)  # [B, A, K-1]
    b, a, k1 = idx.shape
    flat = torch.gather(final, 1, idx.reshape(b, a * k1, 1).expand(-1, -1, final.shape[-1]))
    return flat.view(b, a, k1, final.shape[-1])


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """Loss weight of predicted slot j (1..K-1): exp(-(j-1)/gamma); early slots matter most for acceptance."""
    j = torch.arange(1, block_size, dtype=torch.float32)
    return torch.ones_like(j) if not gamma else torch.exp(-(j - 1) / gamma)


def drafter_loss(head: TargetHead, drafter_hidden: torch.Tensor, labels: torch.Tensor,
                 target_final_at_blocks: torch.Tensor | None, kl_weight: float, gamma: float | None
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted CE on the true tokens (+ kl_weight * KL to the verifier) over block slots only."""
    pred = drafter_hidden[:, :, 1:]  # slots that predict a token
    valid = labels != IGNORE_INDEX
    rows = pred[valid]  # [N, H]: only anchor-block rows reach lm_head
    logits = head.lm_head(rows)
    w = position_weights(drafter_hidden.shape[2], gamma).to(rows.device)
    w_rows = w.expand_as(labels)[valid]
    ce = F.cross_entropy(logits.float(), labels[valid], reduction="none")
    loss = (ce * w_rows).sum() / w_rows.sum().clamp(min=1e-9)
    stats = {"ce": float(ce.mean().detach()) if ce.numel() else math.nan,
             "acc": float((logits.argmax(-1) == labels[valid]).float().mean()) if ce.numel() else math.nan}
    if target_final_at_blocks is not None:
        with torch.no_grad():
            verifier = head.lm_head(target_final_at_blocks[valid].to(rows.dtype)).float()
        stats["target_agree"] = float((verifier.argmax(-1) == logits.argmax(-1)).float().mean()) if ce.numel() else 0.0
        if kl_weight > 0:
            kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(verifier, -1), log_target=True,
                          reduction="none").sum(-1)
            loss = loss + kl_weight * (kl * w_rows).sum() / w_rows.sum().clamp(min=1e-9)
            stats["kl"] = float(kl.mean().detach())
    return loss, stats
