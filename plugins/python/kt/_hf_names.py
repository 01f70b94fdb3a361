"""The names and layouts Hugging Face models and PEFT give routed-expert
tensors, and the conversions between them and kt's stacked tensors
(gate, up [E,I,H], down [E,H,I]; LoRA A [E,r,in], B [E,out,r]).

Namings (``MoEExperts.hf_naming``, set by kt.hf):
* "qwen" / "mixtral": per-expert modules ``{e}.gate_proj`` ... or ``{e}.w1``.
* "fused": ``gate_up_proj`` [E,2I,H] (gate rows first), ``down_proj`` [E,H,I].
* "fused_in_out": ``gate_up_proj`` [E,H,2I], ``down_proj`` [E,I,H].
* "gpt_oss_in_out" / "gpt_oss": as fused, gate and up interleaved (even
  rows gate), with ``gate_up_proj_bias`` [E,2I] and ``down_proj_bias`` [E,H].

PEFT's LoRA on per-expert modules is ``{e}.{proj}.lora_A.weight`` [r,in] and
``lora_B.weight`` [out,r]. On fused parameters PEFT targets the parameter
itself (``target_parameters``): a 3-D parameter of expert projections
in -> out gets lora_A ``nn.Linear(in, r*E)`` (weight [r*E, in], row e*r + k)
and lora_B ``nn.Linear(r*E, out)`` (weight [out, r*E], column k*E + e);
the change of expert e's projection is scaling * B_e A_e, stored
transposed for [E, in, out] parameters (gpt-oss). Several targeted parameters
of one module nest: the first listed is innermost, so with
["gate_up_proj", "down_proj"] gate_up_proj's factors are under
``base_layer.lora_*`` and down_proj's under ``lora_*``.
kt keeps separate gate and up factors of rank r; on gate_up_proj they are
one factor pair of rank 2r (A = [A_gate; A_up], B block-diagonal), with
lora_alpha doubled (sqrt(2) times for rsLoRA) so the scale is kept.
"""
import torch

PER_EXPERT = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
PROJ = ("gate", "up", "down")


def is_fused(naming):
    return naming is not None and naming.startswith(("fused", "gpt_oss"))


def _interleaved(naming):
    return naming.startswith("gpt_oss")


def _in_out(naming):
    return naming.endswith("_in_out")


def join_gate_up(gate, up, interleaved):
    """[E, I, ...] x2 -> [E, 2I, ...]."""
    if interleaved:
        return torch.stack((gate, up), dim=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])
    return torch.cat((gate, up), dim=1)


def split_gate_up(gate_up, interleaved):
    n = gate_up.shape[1] // 2
    if interleaved:
        return gate_up[:, 0::2], gate_up[:, 1::2]
    return gate_up[:, :n], gate_up[:, n:]


def weights_to_hf(naming, w):
    """Stacked kt weights {gate, up, down, bias_*} -> {relative key: tensor}."""
    out = {}
    if naming in PER_EXPERT:
        names = PER_EXPERT[naming]
        for e in range(w["gate"].shape[0]):
            for p, n in zip(PROJ, names):
                out["%d.%s.weight" % (e, n)] = w[p][e]
                if "bias_" + p in w:
                    out["%d.%s.bias" % (e, n)] = w["bias_" + p][e]
        return out
    if is_fused(naming):
        gu = join_gate_up(w["gate"], w["up"], _interleaved(naming))
        down = w["down"]
        if _in_out(naming):
            gu, down = gu.transpose(1, 2), down.transpose(1, 2)
        out["gate_up_proj"], out["down_proj"] = gu.contiguous(), down.contiguous()
        if "bias_gate" in w:
            out["gate_up_proj_bias"] = join_gate_up(w["bias_gate"], w["bias_up"], _interleaved(naming))
            out["down_proj_bias"] = w["bias_down"]
        return out
    out = {"w_" + p: w[p] for p in PROJ}
    out.update({"b_" + p: w["bias_" + p] for p in PROJ if "bias_" + p in w})
    return out


def hf_weight_keys(naming, E, bias):
    return list(weights_to_hf(naming, _shapes_only(E, bias)).keys())


def _shapes_only(E, bias):
    z = torch.empty(E, 1, 1)
    w = {"gate": z, "up": z, "down": z}
    if bias:
        b = torch.empty(E, 1)
        w.update(bias_gate=b, bias_up=b, bias_down=b)
    return w


def weights_from_hf(naming, tensors, E, bias):
    """{relative key: tensor} -> stacked {gate, up, down, bias_*}."""
    if naming in PER_EXPERT:
        names = PER_EXPERT[naming]
        w = {p: torch.stack([tensors["%d.%s.weight" % (e, n)] for e in range(E)]) for p, n in zip(PROJ, names)}
        if bias:
            for p, n in zip(PROJ, names):
                w["bias_" + p] = torch.stack([tensors["%d.%s.bias" % (e, n)] for e in range(E)])
        return w
    if is_fused(naming):
        gu, down = tensors["gate_up_proj"], tensors["down_proj"]
        if _in_out(naming):
            gu, down = gu.transpose(1, 2), down.transpose(1, 2)
        gate, up = split_gate_up(gu, _interleaved(naming))
        w = {"gate": gate, "up": up, "down": down}
        if bias:
            w["bias_gate"], w["bias_up"] = split_gate_up(tensors["gate_up_proj_bias"], _interleaved(naming))
            w["bias_down"] = tensors["down_proj_bias"]
        return w
    w = {p: tensors["w_" + p] for p in PROJ}
    if bias:
        w.update({"bias_" + p: tensors["b_" + p] for p in PROJ})
    return w


# ------------------------------------------------------------------ LoRA


def _peft_param_factors(delta_A, delta_B, naming_in_out, peft_in_out=False):
    """kt factors of one fused parameter (A [E,R,in], B [E,out,R], nn.Linear
    sense, delta = B A) -> PEFT's (lora_A.weight, lora_B.weight). PEFT
    (0.21) reads a 3-D parameter [E, d1, d2] as [E, in, out] where the
    experts module says ``is_transposed`` (transformers v5 gpt-oss) and as
    [E, out, in] otherwise, and gives it lora_A = Linear(d_in, R*E) (row
    e*R + k), lora_B = Linear(R*E, d_out) (column k*E + e), adding
    B_e A_e to the [d_out, d_in] view. Where that view is the parameter's
    own orientation, kt's factors go as they are; where it is not
    (transformers v4 gpt-oss, [E, in, out] without is_transposed), PEFT's
    product must be the transpose: lora_A from B^T, lora_B from A^T."""
    if naming_in_out != peft_in_out:
        delta_A, delta_B = delta_B.transpose(1, 2), delta_A.transpose(1, 2)
    E, R = delta_A.shape[0], delta_A.shape[1]
    lora_a = delta_A.reshape(E * R, delta_A.shape[2]).contiguous()
    lora_b = delta_B.permute(1, 2, 0).reshape(delta_B.shape[1], R * E).contiguous()
    return lora_a, lora_b


def _kt_factors(lora_a, lora_b, E, naming_in_out, peft_in_out=False):
    """Inverse of _peft_param_factors: -> A [E,R,in], B [E,out,R]."""
    R = lora_a.shape[0] // E
    a, b = lora_a.reshape(E, R, lora_a.shape[1]), lora_b.reshape(lora_b.shape[0], R, E).permute(2, 0, 1)
    if naming_in_out != peft_in_out:
        a, b = b.transpose(1, 2), a.transpose(1, 2)
    return a, b


def lora_to_peft(naming, lora, targets, per_expert_names=None, peft_in_out=False):
    """kt LoRA {lora_A_<p>: [E,r,in], lora_B_<p>: [E,out,r]} -> {relative
    key: tensor} in PEFT's saved form, plus the rank/alpha factor of each
    fused parameter ({parameter: rank multiplier}). ``per_expert_names``
    (gate, up, down module names) writes a fused block in the per-expert
    form of the checkpoints it was converted from (PEFT fuses such adapters
    when it loads them onto a transformers v5 model)."""
    out, multipliers = {}, {}
    if per_expert_names is not None or naming in PER_EXPERT or not is_fused(naming):
        names = per_expert_names or PER_EXPERT.get(naming, PER_EXPERT["qwen"])
        for p, n in zip(PROJ, names):
            if p not in targets:
                continue
            a, b = lora["lora_A_" + p], lora["lora_B_" + p]
            for e in range(a.shape[0]):
                out["%d.%s.lora_A.weight" % (e, n)] = a[e]
                out["%d.%s.lora_B.weight" % (e, n)] = b[e]
        return out, multipliers
    in_out = _in_out(naming)
    gu = [p for p in ("gate", "up") if p in targets]
    params = []
    if gu:
        a = torch.cat([lora["lora_A_" + p] for p in gu], dim=1)  # [E, R, H]
        E, r = a.shape[0], lora["lora_A_" + gu[0]].shape[1]
        I = lora["lora_B_" + gu[0]].shape[1]
        zero = torch.zeros(E, I, r, dtype=a.dtype)
        parts = {p: lora["lora_B_" + p] if p in gu else None for p in ("gate", "up")}
        cols = []
        for i, p in enumerate(gu):
            blocks = [parts[q] if q == p else zero for q in ("gate", "up")]
            cols.append(join_gate_up(blocks[0], blocks[1], _interleaved(naming)))
        b = torch.cat(cols, dim=2)  # [E, 2I, R]
        params.append(("gate_up_proj", a, b))
        multipliers["gate_up_proj"] = len(gu)
    if "down" in targets:
        a, b = lora["lora_A_down"], lora["lora_B_down"]
        m = max(1, len(gu))
        if m > 1:
            # One rank for every parameter of the config: zero factors are exact.
            a = torch.cat([a, torch.zeros(a.shape[0], (m - 1) * a.shape[1], a.shape[2], dtype=a.dtype)], 1)
            b = torch.cat([b, torch.zeros(b.shape[0], b.shape[1], (m - 1) * b.shape[2], dtype=b.dtype)], 2)
        params.append(("down_proj", a, b))
        multipliers["down_proj"] = m
    for depth, (name, a, b) in enumerate(params):
        prefix = "base_layer." * (len(params) - 1 - depth)
        la, lb = _peft_param_factors(a, b, in_out, peft_in_out)
        out[prefix + "lora_A.weight"], out[prefix + "lora_B.weight"] = la, lb
    return out, multipliers


def lora_from_peft(naming, tensors, targets, E, r, per_expert_names=None, peft_in_out=False):
    """PEFT's saved form (relative keys) -> kt LoRA tensors; raises
    ValueError where PEFT's factors cannot be kt's. A fused gate_up_proj
    factor pair is either kt's own (rank 2r, B block-diagonal: separate gate
    and up factors) or PEFT's of rank r (one A for both halves, as PEFT
    trains it on the fused parameter): kt then gives gate and up that same A
    and their halves of B, which is exact. ``per_expert_names`` reads a
    fused block from the per-expert form (see lora_to_peft)."""
    out = {}
    if per_expert_names is not None or not is_fused(naming):
        names = per_expert_names or PER_EXPERT.get(naming, PER_EXPERT["qwen"])
        for p, n in zip(PROJ, names):
            if p in targets:
                out["lora_A_" + p] = torch.stack([tensors["%d.%s.lora_A.weight" % (e, n)] for e in range(E)])
                out["lora_B_" + p] = torch.stack([tensors["%d.%s.lora_B.weight" % (e, n)] for e in range(E)])
        return out
    in_out = _in_out(naming)
    gu = [p for p in ("gate", "up") if p in targets]
    order = (["gate_up_proj"] if gu else []) + (["down_proj"] if "down" in targets else [])
    for depth, name in enumerate(order):
        prefix = "base_layer." * (len(order) - 1 - depth)
        a, b = _kt_factors(tensors[prefix + "lora_A.weight"], tensors[prefix + "lora_B.weight"], E, in_out,
                           peft_in_out)
        if name == "down_proj":
            if a.shape[1] < r or bool(a[:, r:].any()) or bool(b[:, :, r:].any()):
                raise ValueError("kt: down_proj's LoRA has rank %d beyond kt's rank %d" % (a.shape[1], r))
            out["lora_A_down"], out["lora_B_down"] = a[:, :r], b[:, :, :r]
            continue
        gate_rows, up_rows = split_gate_up(b, _interleaved(naming))
        rows = {"gate": gate_rows, "up": up_rows}
        if len(gu) == 2 and a.shape[1] == r:
            for p in gu:
                out["lora_A_" + p], out["lora_B_" + p] = a, rows[p]
            continue
        if a.shape[1] != r * len(gu):
            raise ValueError("kt: gate_up_proj's LoRA has rank %d; kt's layer holds rank %d for each of %s"
                             % (a.shape[1], r, "/".join(gu)))
        for i, p in enumerate(gu):
            cols = slice(i * r, (i + 1) * r)
            others = [rows[q][:, :, cols] for q in ("gate", "up") if q != p]
            if any(bool(o.any()) for o in others):
                raise ValueError("kt: gate_up_proj's LoRA mixes gate and up rows; kt's layer keeps "
                                 "separate gate and up factors")
            out["lora_A_" + p] = a[:, cols]
            out["lora_B_" + p] = rows[p][:, :, cols]
        missing = [q for q in ("gate", "up") if q not in gu]
        for q in missing:
            if bool(rows[q].any()):
                raise ValueError("kt: gate_up_proj's LoRA changes %s, which the layer does not target" % q)
    return out
