"""Hybrid stacks (`attn.layers`): a per-layer schedule of attention kinds, repeated over depth.

`attn.layers` is null (every layer is the attn group: a homogeneous stack, as every run before it) or a list of
entries, each a mapping of attn keys laid over the group for its layers: entry i serves layers i, i + n, i + 2n, ...
(n entries, which must divide model.n_layers), as Zoology's Hybrid mixer picks `configs[layer_idx % len(configs)]`
(HazyResearch/zoology, zoology/mixers/hybrid.py). An entry sets any attn field (kind, pattern, window, n_kv_heads,
scale, qk_norm, short_conv) and its kind's or pattern's own options; what it leaves out it takes from the group,
except a kind's (pattern's) options when it names another kind (pattern): those belong to the group's. What the
whole stack shares, it cannot set: causal (one position scheme and mask for every layer), layers itself.

Based (Arora et al. 2024) is such a stack: gated short convolutions, Taylor linear attention and sliding-window
softmax, one kind per layer (conf/experiment/based_hybrid.yaml, conf/attn/based_mqar.yaml)."""
from dataclasses import fields, replace

STACK_KEYS = ("causal", "layers", "options", "pattern_options")  # the stack's, or not config keys: no entry sets them
EXAMPLE = "[{kind: base_conv}, {kind: taylor}]"


def layer_attn(attn, layer: int):
    """The AttnConfig of layer `layer`: `attn` with its schedule's entry for that layer laid over it (attn itself
    where there is no schedule)."""
    if not attn.layers:
        return attn
    entry = attn.layers[layer % len(attn.layers)]
    names = {f.name for f in fields(attn)} - set(STACK_KEYS)
    own = replace(attn, layers=None, **{key: value for key, value in entry.items() if key in names})
    extra = {key: value for key, value in entry.items() if key not in names and key not in STACK_KEYS}
    kind_options, pattern_options = type(attn).split_options(own.kind, own.pattern_name, extra)
    return replace(own, options={**(attn.options if own.kind == attn.kind else {}), **kind_options},
                   pattern_options={**(attn.pattern_options if own.pattern_name == attn.pattern_name else {}),
                                    **pattern_options})


def schedule_errors(attn, n_layers: int) -> list[str]:
    """What is wrong with the schedule's shape, one line each: not a list of mappings, an entry setting what the
    stack shares, a length that does not divide model.n_layers. Each layer's own checks are ModelConfig's."""
    layers = attn.layers
    if layers is None:
        return []
    if not isinstance(layers, list) or not layers:
        return [f"attn.layers={layers!r} must be null (every layer alike) or a non-empty list of per-layer settings, "
                f"e.g. {EXAMPLE}"]
    errs = []
    for index, entry in enumerate(layers):
        if not isinstance(entry, dict) or not all(isinstance(key, str) for key in entry):
            errs.append(f"attn.layers[{index}]={entry!r} must be a mapping of attn keys, e.g. {{kind: taylor}}")
            continue
        errs += [f"attn.layers[{index}].{key} is the whole stack's, not a layer's; set attn.{key} (or leave it out)"
                 for key in STACK_KEYS if key in entry]
    if not errs and n_layers % len(layers):
        errs.append(f"attn.layers has {len(layers)} entries, which does not divide model.n_layers={n_layers}; "
                    f"use model.n_layers={len(layers) * max(1, n_layers // len(layers))} or a schedule whose length "
                    f"divides {n_layers}")
    return errs
